# SPDX-License-Identifier: Apache-2.0
"""Split-KV Triton MLA decode (``ops/triton_mla_split_kv.py``) against dense
attention.

The references here are plain torch, in float64, over keys gathered row by
row from the paged cache (no ops-layer code), so a bound or paging error the
kernel shares with ``dcp_decode`` cannot pass both sides. Tests whose name
holds ``triton_path`` launch the kernels: on CUDA when present (the H200
check runs this file there), otherwise under ``TRITON_INTERPRET=1`` in a
subprocess started by ``test_interpreter_runs_triton_path_tests`` on every CI
run. Small widths (Dv 64, Dr 16) keep the interpreter fast; one case runs
Kimi-K3's 512 + 64.
"""

from __future__ import annotations


import pytest
import torch

from triton_interpreted import (
    DEVICE, needs_triton, run_triton_path_tests, runs_where_triton_cannot)
from vllm.v1.attention.ops import dcp_decode
from vllm.v1.attention.ops.dcp_decode import DCPLayout
from vllm.v1.attention.ops.dcp_simulated_ranks import (
    decode_on_simulated_ranks,
    random_paged_kv,
)
from vllm.v1.attention.ops import triton_mla_split_kv as sk

SCALE = 0.0721


def _rows_reference(q, cache, table, row_lens, dv):
    """float64 attention of each row over its first ``row_lens[t]`` local
    keys, gathered one key at a time: ``(out [T, H, dv], lse [T, H])``;
    rows without keys: out 0, lse -inf."""
    page = cache.shape[1]
    num_rows, num_heads, _ = q.shape
    out = torch.zeros(num_rows, num_heads, dv, dtype=torch.float64)
    lse = torch.full((num_rows, num_heads), float("-inf"), dtype=torch.float64)
    for t, n in enumerate(row_lens.tolist()):
        if n == 0:
            continue
        keys = torch.stack([cache[int(table[t, j // page]), j % page]
                            for j in range(n)]).double()
        scores = q[t].double() @ keys.T * SCALE
        lse[t] = torch.logsumexp(scores, dim=-1)
        out[t] = torch.softmax(scores, dim=-1) @ keys[:, :dv]
    return out, lse


def _full_attention(cache, table, seq_lens, qsl, q, dv, *, causal):
    """Attention without DCP of every real query token (float64): token t of
    a request of length L and n query tokens sees L - n + 1 + t tokens when
    causal, L otherwise (none below 1)."""
    bounds = []
    for i, seq_len in enumerate(seq_lens.tolist()):
        n = int(qsl[i + 1] - qsl[i])
        bounds += [max(seq_len - n + 1 + t if causal else seq_len, 0) for t in range(n)]
    rows = torch.repeat_interleave(torch.arange(len(seq_lens)), qsl.diff())
    return _rows_reference(q[: len(bounds)], cache, table[rows],
                           torch.tensor(bounds, dtype=torch.int32), dv)


def _paged_cache(num_blocks, page, width, dtype, gen):
    """Random cache with the null block 0 NaN (unused table columns point
    there: reading it poisons the result)."""
    cache = torch.randn(num_blocks, page, width, generator=gen)
    cache[0] = float("nan")
    return cache.to(dtype)


# Small key blocks and no per-split key floor, so that the short rows of
# these tests spread over every split (the deployed 64-key blocks and
# 64-key floor run in test_triton_path_split_kv_kimi_widths).
SMALL_KNOBS = dict(block_n=16, min_split_keys=0)


def _run(q, cache, table, row_lens, *, num_splits, dv, num_rows=None,
         rows_per_program=1, row_to_req=None, **knobs):
    """Plan + run on DEVICE with NaN-poisoned outputs and partial buffers."""
    num_rows = q.shape[0] if num_rows is None else num_rows
    heads = q.shape[1]
    knobs = {**SMALL_KNOBS, **knobs}
    mla = sk.TritonMLASplitKV(
        num_heads=heads, sm_scale=SCALE, dtype=q.dtype, kv_lora_rank=dv,
        rope_dim=q.shape[2] - dv, max_rows=num_rows, max_local_len=1 << 20,
        device=DEVICE, max_partials=num_rows * num_splits,
        max_rows_per_program=rows_per_program, **knobs)
    mla._part_out.fill_(float("nan"))
    mla._part_lse.fill_(float("nan"))
    mla.plan(row_lens.to(DEVICE), table.to(DEVICE), num_rows=num_rows,
             num_splits=num_splits, rows_per_program=rows_per_program,
             row_to_req=None if row_to_req is None else row_to_req.to(DEVICE))
    out = torch.full((num_rows, heads, dv), float("nan"), dtype=q.dtype, device=DEVICE)
    lse = torch.full((num_rows, heads), float("nan"), device=DEVICE)
    got_out, got_lse = mla.run(q[:num_rows].to(DEVICE), cache.to(DEVICE), out=out,
                               lse=lse)
    assert got_out is out and got_lse is lse
    return out.cpu(), lse.cpu()


def _assert_rows_equal(out, lse, ref_out, ref_lse, dtype):
    has = torch.isfinite(ref_lse)
    assert torch.equal(torch.isinf(lse), ~has), "empty rows must be exactly -inf"
    assert bool((out[~has] == 0).all()), "rows without keys must be 0"
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), ref_out, atol=tol, rtol=tol)
    torch.testing.assert_close(lse[has].double(), ref_lse[has], atol=1e-4, rtol=0)


# Row lengths around every boundary: none, shorter than a key block (16) and
# than the split count, exactly one block, one past it, not a multiple of the
# page (8), several pages and blocks.
ADVERSARIAL_LENS = [0, 1, 5, 16, 17, 63, 100, 3, 0, 129]


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 3, 12])
def test_triton_path_split_kv_matches_dense(dtype, num_splits):
    """Adversarial rows, 20 heads (not a multiple of the 16-head block),
    NaN null block behind unused columns, 2 trailing padding rows (length 0),
    splits from 1 to more than any row's keys."""
    gen = torch.Generator().manual_seed(num_splits)
    dv, dr, page, heads = 64, 16, 8, 20
    lens = torch.tensor(ADVERSARIAL_LENS + [0, 0], dtype=torch.int32)
    cols = 20
    cache = _paged_cache(80, page, dv + dr, dtype, gen)
    table = torch.zeros(len(lens), cols, dtype=torch.int32)
    for t, n in enumerate(lens.tolist()):
        used = -(-n // page)
        table[t, :used] = torch.randint(1, 80, (used,), generator=gen, dtype=torch.int32)
    q = torch.randn(len(lens), heads, dv + dr, generator=gen).to(dtype)
    out, lse = _run(q, cache, table, lens, num_splits=num_splits, dv=dv)
    ref_out, ref_lse = _rows_reference(q, cache, table, lens, dv)
    _assert_rows_equal(out, lse, ref_out, ref_lse, dtype)


@needs_triton
@pytest.mark.parametrize("knobs", [dict(block_n=16, block_h=16),
                                   dict(block_n=64, block_h=32, num_warps=8),
                                   dict(block_n=16, min_split_keys=40)])
def test_triton_path_split_kv_knobs(knobs):
    """Other key / head blocks give the same result (the chunk is rounded to
    the key block: with 64-key blocks most splits of short rows are empty),
    and so does a floor of 40 keys (48 after rounding) per split."""
    gen = torch.Generator().manual_seed(3)
    dv, dr, page, heads = 64, 16, 16, 12
    lens = torch.tensor([70, 0, 33, 200, 1], dtype=torch.int32)
    cache = _paged_cache(40, page, dv + dr, torch.float32, gen)
    table = torch.randint(1, 40, (5, 13), generator=gen, dtype=torch.int32)
    q = torch.randn(5, heads, dv + dr, generator=gen)
    out, lse = _run(q, cache, table, lens, num_splits=5, dv=dv, **knobs)
    ref_out, ref_lse = _rows_reference(q, cache, table, lens, dv)
    _assert_rows_equal(out, lse, ref_out, ref_lse, torch.float32)


@needs_triton
def test_triton_path_split_kv_kimi_widths():
    """Kimi-K3's latent 512 + rope 64, bf16, page 64, rows across pages, with
    the deployed knobs (``TritonMLASplitKV``'s defaults: 64-key tiles, one
    page id per tile, 64-key floor per split): row 0 fills 4 splits of 192
    keys, row 4 three of 64 keys (the last holds one key), leaving one empty."""
    gen = torch.Generator().manual_seed(11)
    dv, dr, page, heads = 512, 64, 64, 16
    lens = torch.tensor([700, 0, 64, 65, 129], dtype=torch.int32)
    cache = _paged_cache(24, page, dv + dr, torch.bfloat16, gen)
    table = torch.zeros(5, 12, dtype=torch.int32)
    table[0, :11] = torch.randperm(23, generator=gen)[:11].int() + 1
    table[2, 0], table[3, :2], table[4, :3] = 2, torch.tensor([11, 4]), torch.tensor(
        [5, 13, 21])
    q = torch.randn(5, heads, dv + dr, generator=gen).bfloat16()
    defaults = dict(block_n=64, min_split_keys=64)
    out, lse = _run(q, cache, table, lens, num_splits=4, dv=dv, **defaults)
    ref_out, ref_lse = _rows_reference(q, cache, table, lens, dv)
    _assert_rows_equal(out, lse, ref_out, ref_lse, torch.bfloat16)


def _dcp_merged(query_lens, seq_lens, *, world, interleave, causal, num_splits,
                rows_per_program=1, seed=0):
    """Rows from ``build_flat_decode`` on every rank (2 padding rows), split-KV
    per rank, merged with ``merge_partials``; and attention without DCP."""
    gen = torch.Generator().manual_seed(seed)
    dv, dr, page, heads = 64, 16, 16, 16
    query_lens = torch.tensor(query_lens)
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
    qsl = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(query_lens, 0)
    num_rows = int(qsl[-1]) + 2
    cache, table, _ = random_paged_kv(seq_lens.tolist(), page, generator=gen,
                                      width=dv + dr, extra_blocks=1)
    q = torch.randn(num_rows, heads, dv + dr, generator=gen)

    def decode_rank(layout, local_cache, local_table):
        flat = dcp_decode.build_flat_decode(
            seq_lens, qsl, local_table, layout=layout, causal=causal,
            num_rows=num_rows)
        return _run(q, local_cache, flat.block_table, flat.seq_lens,
                    num_splits=num_splits, dv=dv,
                    rows_per_program=rows_per_program, row_to_req=flat.row_to_req)

    out, lse = decode_on_simulated_ranks(
        cache, table, seq_lens, decode_rank,
        layout=DCPLayout(world, interleave=interleave), generator=gen)
    real = int(qsl[-1])
    ref_out, ref_lse = _full_attention(cache, table, seq_lens, qsl, q, dv, causal=causal)
    return out, lse, ref_out, ref_lse, real


DCP_LAYOUTS = [(1, 1), (2, 1), (2, 16), (4, 1), (4, 64)]


@needs_triton
@pytest.mark.parametrize("world,interleave", DCP_LAYOUTS)
@pytest.mark.parametrize("causal", [True, False])
def test_triton_path_dcp_ranks_merge_to_full_attention(world, interleave, causal):
    """q_len 1..8, ragged, requests shorter than their query, 2 padding rows:
    the ranks' split-KV results merged == attention without DCP."""
    out, lse, ref_out, ref_lse, real = _dcp_merged(
        [1, 4, 8, 3, 2], [37, 2, 300, 130, 0], world=world, interleave=interleave,
        causal=causal, num_splits=3, seed=world * 100 + interleave + int(causal))
    _assert_rows_equal(out[:real], lse[:real], ref_out, ref_lse, torch.float32)
    assert bool((out[real:] == 0).all() and (lse[real:] == float("-inf")).all())


@needs_triton
@pytest.mark.parametrize("q_len", [4, 5])
@pytest.mark.parametrize("world,interleave", [(1, 1), (2, 16), (4, 1)])
@pytest.mark.parametrize("causal", [True, False])
def test_triton_path_grouped_rows_merge_to_full_attention(q_len, world, interleave,
                                                          causal):
    """Uniform batches, each request's q_len rows in one program (5: padded
    to 8 in the MMA), requests shorter than their query (causal: their first
    rows have no keys), 2 padding rows: merged == attention without DCP."""
    out, lse, ref_out, ref_lse, real = _dcp_merged(
        [q_len] * 4, [3, 300, 41, 130], world=world, interleave=interleave,
        causal=causal, num_splits=4, rows_per_program=q_len,
        seed=world * 10 + q_len + int(causal))
    _assert_rows_equal(out[:real], lse[:real], ref_out, ref_lse, torch.float32)
    assert bool((out[real:] == 0).all() and (lse[real:] == float("-inf")).all())


@needs_triton
def test_triton_path_grouping_two_requests_is_loud():
    """A plan whose row groups straddle two requests (rows_per_program not
    the batch's query length) gives NaN in those groups, not a wrong answer."""
    gen = torch.Generator().manual_seed(4)
    dv, dr, page, heads = 64, 16, 8, 16
    row_to_req = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2], dtype=torch.int32)
    lens = torch.tensor([9, 10, 11, 20, 21, 22, 0, 0], dtype=torch.int32)
    cache = _paged_cache(20, page, dv + dr, torch.float32, gen)
    table = torch.randint(1, 20, (3, 4), generator=gen, dtype=torch.int32)
    q = torch.randn(8, heads, dv + dr, generator=gen)
    out, lse = _run(q, cache, table[row_to_req.long()], lens, num_splits=2, dv=dv,
                    rows_per_program=4, row_to_req=row_to_req)
    # Rows 0-3 hold requests 0 and 1: NaN. Rows 4-7: request 1, then rows
    # without keys (any request): exact.
    assert bool(lse[:4].isnan().all() and out[:4].isnan().all())
    ref_out, ref_lse = _rows_reference(q, cache, table[row_to_req.long()], lens, dv)
    _assert_rows_equal(out[4:], lse[4:], ref_out[4:], ref_lse[4:], torch.float32)


def test_choose_num_splits():
    """Fills the SMs at small batch, never below min_chunk keys per split of
    the longest row, capped; 1 once the rows fill the SMs."""
    # Batch 1 x q_len 4, 16 heads, 32K local keys: 2 programs per SM.
    assert sk.choose_num_splits(4, 16, 65536, 132, max_splits=1000) == 66
    assert sk.choose_num_splits(4, 16, 65536, 132) == 66
    assert sk.choose_num_splits(4, 16, 65536, 132, max_splits=64) == 64  # capped
    assert sk.choose_num_splits(4, 128, 32768, 132) == 9  # 8 head blocks
    assert sk.choose_num_splits(4, 16, 2048, 132) == 4  # 512-key chunks
    assert sk.choose_num_splits(4, 16, 100, 132) == 1
    assert sk.choose_num_splits(264, 16, 1 << 20, 132) == 1
    assert sk.choose_num_splits(0, 16, 1 << 20, 132) == 1
    assert sk.choose_num_splits(4, 16, 32768, 132, min_chunk=4096,
                                programs_per_sm=1) == 8
    # 32 rows in groups of 4: 8 programs per split.
    assert sk.choose_num_splits(32, 16, 65536, 132, rows_per_program=4) == 33
    assert sk.choose_num_splits(32, 16, 65536, 132) == 9


def test_heads_per_program():
    """16 heads per program at G = 1; at G > 1 an MMA of 64 rows (G padded
    to a power of 2), never fewer than 16 rows nor more heads than exist."""
    hpp = sk.heads_per_program
    assert [hpp(16, g) for g in (1, 2, 3, 4, 5, 8)] == [16, 16, 16, 16, 8, 8]
    assert [hpp(128, g) for g in (1, 2, 4, 8)] == [16, 32, 16, 8]
    assert [hpp(4, g) for g in (1, 2, 4, 8, 32)] == [16, 8, 4, 4, 2]


def test_split_kv_preferred_where_it_measured_faster():
    """Split-KV for rows x heads <= 64 over <= 32K local keys (batch 1 x
    q_len 4 x 16 heads at DCP 8 of 256K), FA3 beyond either bound."""
    assert sk.split_kv_preferred(4, 16, 32768)
    assert sk.split_kv_preferred(1, 64, 4096)
    assert not sk.split_kv_preferred(8, 16, 32768)
    assert not sk.split_kv_preferred(4, 96, 32768)
    assert not sk.split_kv_preferred(4, 16, 32769)


def test_deployed_knobs_are_the_measured_ones():
    """The class defaults are the sweep's fastest configuration."""
    mla = sk.TritonMLASplitKV(num_heads=16, sm_scale=SCALE, max_rows=4,
                              max_local_len=32768, device="cpu", num_sms=132,
                              max_rows_per_program=4)
    assert mla.kernel_args == dict(block_n=64, block_h=16, block_m=64,
                                   num_warps=None, num_stages=2,
                                   min_split_keys=64)
    # Batch 1 x q_len 4: one program per split, 128 splits of >= 256 keys.
    assert mla.splits_for(4, 4) == 128


def test_plan_is_host_only_and_buffers_fixed():
    """Buffers are sized at init for every automatic plan up to max_rows and
    never move; plans beyond them, and runs of another row count, fail with
    a clear error."""
    mla = sk.TritonMLASplitKV(num_heads=16, sm_scale=SCALE, dtype=torch.float32,
                              kv_lora_rank=64, rope_dim=16, max_rows=64,
                              max_local_len=1 << 16, device="cpu", num_sms=132,
                              max_rows_per_program=4)
    ptrs = (mla._part_out.data_ptr(), mla._part_lse.data_ptr())
    lens = torch.zeros(64, dtype=torch.int32)
    table = torch.zeros(64, 4, dtype=torch.int32)
    row_to_req = torch.zeros(64, dtype=torch.int32)
    for rows in range(1, 65):
        for group in (1, 2, 3, 4):
            mla.plan(lens, table, num_rows=rows, rows_per_program=group,
                     row_to_req=row_to_req)
            assert mla.num_splits == mla.splits_for(rows, group)
            assert rows * mla.num_splits <= mla.max_partials
    assert (mla._part_out.data_ptr(), mla._part_lse.data_ptr()) == ptrs
    assert mla.splits_for(1) == 132 and mla.splits_for(64) == 3
    assert mla.splits_for(64, 4) == 9
    with pytest.raises(ValueError, match="exceeds the buffers"):
        mla.plan(lens, table, num_rows=65)
    with pytest.raises(ValueError, match="exceeds the buffers"):
        mla.plan(lens, table, num_rows=64, num_splits=64)
    with pytest.raises(ValueError, match="allows 1..4"):
        mla.plan(lens, table, num_rows=8, rows_per_program=5, row_to_req=row_to_req)
    with pytest.raises(ValueError, match="needs row_to_req"):
        mla.plan(lens, table, num_rows=8, rows_per_program=2)
    mla.plan(lens, table, num_rows=8)
    q = torch.zeros(4, 16, 80)
    with pytest.raises(ValueError, match="last plan was for 8"):
        mla.run(q, torch.zeros(2, 16, 80))


@runs_where_triton_cannot
def test_interpreter_runs_triton_path_tests():
    """Every CI run: the triton_path tests under Triton's interpreter."""
    run_triton_path_tests(__file__)
