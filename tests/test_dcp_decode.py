# SPDX-License-Identifier: Apache-2.0
"""The ops layer's DCP math (``dcp_decode``) against vLLM's own helpers and
against full attention."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.dense_reference import KV_LORA_RANK, full_attention, random_decode_batch
from vllm.v1.attention.ops.dcp_decode import (
    DCPLayout,
    alloc_flat_decode,
    build_flat_decode,
    merge_partials,
    mla_decode_reference,
)
from tools.dcp_simulated_ranks import (
    decode_on_simulated_ranks,
    shard_paged_kv,
)

WORLD_SIZES = [1, 2, 4, 8]
INTERLEAVES = [1, 16, 64]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("interleave", INTERLEAVES)
def test_local_seq_lens_equal_vllm(world_size, interleave):
    from vllm.v1.attention.backends.utils import get_dcp_local_seq_lens

    lens = torch.arange(0, 3 * world_size * interleave + 70, dtype=torch.int32)
    upstream = get_dcp_local_seq_lens(lens, world_size, None, interleave)  # [L, W]
    for layout in DCPLayout(world_size, 0, interleave).ranks():
        ours = layout.local_seq_lens(lens)
        assert ours.dtype == torch.int32
        torch.testing.assert_close(ours, upstream[:, layout.rank], rtol=0, atol=0)
    all_ranks = DCPLayout(world_size, 0, interleave).local_seq_lens(
        lens, rank=torch.arange(world_size)[:, None])
    assert torch.equal(all_ranks.sum(0).to(torch.int32), lens)


@pytest.mark.parametrize("world_size, rank, interleave, flag", [
    (0, 0, 1, "world size"), (2, 2, 1, "rank 2"), (2, -1, 1, "rank -1"),
    (2, 0, 0, "interleave"),
])
def test_layout_refuses_what_vllm_cannot_run(world_size, rank, interleave, flag):
    with pytest.raises(ValueError, match=flag):
        DCPLayout(world_size, rank, interleave)


def test_layout_is_a_frozen_value():
    layout = DCPLayout(4, 1, 16)
    assert layout == DCPLayout(world_size=4, rank=1, interleave=16)
    assert hash(layout) == hash(DCPLayout(4, 1, 16))
    assert layout.span == 64
    assert layout.with_rank(3) == DCPLayout(4, 3, 16)
    assert [r.rank for r in layout.ranks()] == [0, 1, 2, 3]
    assert DCPLayout() == DCPLayout(1, 0, 1)
    with pytest.raises(AttributeError):
        layout.rank = 2  # type: ignore[misc]


@settings(max_examples=200, deadline=None)
@given(world_size=st.sampled_from(WORLD_SIZES), interleave=st.sampled_from(INTERLEAVES),
       length=st.integers(0, 20000))
def test_local_seq_lens_count_owned_positions(world_size, interleave, length):
    owner, local_index = DCPLayout(world_size, 0, interleave).owner(
        torch.arange(length))
    for layout in DCPLayout(world_size, 0, interleave).ranks():
        mine = local_index[owner == layout.rank]
        expected = int(layout.local_seq_lens(torch.tensor(length)))
        assert mine.numel() == expected
        # A rank's local indices are 0..n-1 in position order.
        assert torch.equal(mine, torch.arange(expected))


def _flat_by_loop(seq_lens, query_lens, world_size, rank, interleave, causal,
                  num_rows):
    """Row fields spelled out per request and token (Python loops)."""
    rows = []
    for req, (seq_len, q_len) in enumerate(zip(seq_lens, query_lens)):
        for t in range(q_len):
            bound = max(seq_len - q_len + 1 + t if causal else seq_len, 0)
            span = world_size * interleave
            local = sum(1 for p in range(bound) if (p // interleave) % world_size == rank)
            assert local == (bound // span) * interleave + min(
                max(bound % span - rank * interleave, 0), interleave)
            rows.append((req, bound, local))
    rows += [(len(seq_lens) - 1, 0, 0)] * (num_rows - len(rows))
    return rows


@settings(max_examples=150, deadline=None)
@given(data=st.data(), world_size=st.sampled_from(WORLD_SIZES),
       interleave=st.sampled_from(INTERLEAVES), causal=st.booleans(),
       padding=st.integers(0, 5))
def test_build_flat_decode_matches_loop(data, world_size, interleave, causal, padding):
    num_reqs = data.draw(st.integers(1, 6))
    query_lens = data.draw(st.lists(st.integers(0, 8), min_size=num_reqs,
                                    max_size=num_reqs))
    # Adversarial too: requests shorter than their query (seq len < q_len).
    seq_lens = [max(q + data.draw(st.integers(-9, 300)), 0) for q in query_lens]
    qsl = torch.zeros(num_reqs + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(query_lens), 0)
    table = torch.randint(1, 100, (num_reqs, 5), dtype=torch.int32)
    num_rows = sum(query_lens) + padding
    flat = build_flat_decode(torch.tensor(seq_lens, dtype=torch.int32), qsl, table,
                             layout=DCPLayout(world_size, world_size - 1, interleave),
                             causal=causal, num_rows=num_rows)
    expected = _flat_by_loop(seq_lens, query_lens, world_size, world_size - 1,
                             interleave, causal, num_rows)
    assert flat.row_to_req.tolist() == [r for r, _, _ in expected]
    assert flat.seq_lens.tolist() == [n for _, _, n in expected]
    assert flat.empty.tolist() == [n == 0 for _, _, n in expected]
    assert torch.equal(flat.block_table, table[flat.row_to_req.long()])
    for field in ("seq_lens", "row_to_req", "block_table"):
        assert getattr(flat, field).dtype == torch.int32, field
    # Every rank's rows together hold the row's global bound.
    held = sum(build_flat_decode(torch.tensor(seq_lens, dtype=torch.int32), qsl, table,
                                 layout=DCPLayout(world_size, rank, interleave),
                                 causal=causal, num_rows=num_rows).seq_lens
               for rank in range(world_size))
    assert held.tolist() == [g for _, g, _ in expected]


def test_build_flat_decode_writes_into_buffers():
    out = alloc_flat_decode(max_rows=32, max_blocks=8)
    for field in ("seq_lens", "row_to_req", "block_table"):
        getattr(out, field).fill_(-7)  # poison
    seq_lens = torch.tensor([40, 3], dtype=torch.int32)
    qsl = torch.tensor([0, 3, 6], dtype=torch.int32)
    table = torch.arange(10, dtype=torch.int32).view(2, 5)
    flat = build_flat_decode(seq_lens, qsl, table, layout=DCPLayout(2, 1, 1),
                             causal=True, num_rows=8, out=out)
    assert flat.seq_lens.data_ptr() == out.seq_lens.data_ptr()
    assert flat.block_table.data_ptr() == out.block_table.data_ptr()
    assert flat.block_table.shape == (8, 5)
    # Request 1 (seq 3, q_len 3) sees 1, 2, 3 tokens: rank 1 holds 0, 1, 1.
    assert flat.seq_lens.tolist() == [19, 19, 20, 0, 1, 1, 0, 0]
    assert flat.empty.tolist() == [False] * 3 + [True, False, False, True, True]
    assert (flat.block_table >= 0).all() and (flat.row_to_req >= 0).all()


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("rank", [0, 1])
def test_request_shorter_than_its_query_has_empty_rows(causal, rank):
    """seq 0 with q_len 4 (and seq 2 with q_len 4): the bounds clamp at 0
    and such rows are empty, never negative lengths that reach a kernel."""
    from vllm.v1.attention.backends.utils import get_dcp_local_seq_lens

    seq_lens = torch.tensor([0, 2], dtype=torch.int32)
    qsl = torch.tensor([0, 4, 8], dtype=torch.int32)
    table = torch.arange(1, 5, dtype=torch.int32).view(2, 2)
    flat = build_flat_decode(seq_lens, qsl, table, layout=DCPLayout(2, rank, 1),
                             causal=causal, num_rows=8)
    if causal:
        expected_global = [0, 0, 0, 0, 0, 0, 1, 2]
    else:
        expected_global = [0, 0, 0, 0, 2, 2, 2, 2]
    other = build_flat_decode(seq_lens, qsl, table, layout=DCPLayout(2, 1 - rank, 1),
                              causal=causal, num_rows=8)
    assert (flat.seq_lens + other.seq_lens).tolist() == expected_global
    upstream = get_dcp_local_seq_lens(torch.tensor(expected_global, dtype=torch.int32),
                                      2, rank, 1)
    assert flat.seq_lens.tolist() == upstream.tolist()
    assert (flat.seq_lens >= 0).all()
    assert flat.empty.tolist() == [n == 0 for n in upstream.tolist()]
    assert flat.empty[:4].all()


def test_merge_partials_masks_invalid_lses():
    gen = torch.Generator().manual_seed(0)
    outs = torch.randn(3, 5, 2, 4, generator=gen)
    lses = torch.randn(3, 5, 2, generator=gen)
    lses[0, 0] = float("-inf")
    lses[1, 1] = float("nan")
    lses[2, 2] = float("inf")
    lses[:, 3] = float("-inf")  # every rank empty
    outs[0, 0] = float("nan")  # an empty rank's undefined output
    out, lse = merge_partials(outs, lses)
    for row in range(5):
        for head in range(2):
            valid = [w for w in range(3) if math.isfinite(lses[w, row, head])]
            if not valid:
                assert lse[row, head] == float("-inf")
                assert torch.all(out[row, head] == 0)
                continue
            vals = torch.stack([lses[w, row, head] for w in valid]).double()
            ref_lse = torch.logsumexp(vals, 0)
            ref_out = sum(torch.exp(vals[i] - ref_lse) * outs[w, row, head].double()
                          for i, w in enumerate(valid))
            assert abs(lse[row, head] - ref_lse) < 1e-5
            torch.testing.assert_close(out[row, head].double(), ref_out,
                                       atol=1e-5, rtol=1e-5)


def test_merge_partials_base2_equals_base_e():
    gen = torch.Generator().manual_seed(1)
    outs = torch.randn(4, 6, 3, 8, generator=gen)
    lses = torch.randn(4, 6, 3, generator=gen) * 5
    lses[1, :2] = float("-inf")
    out_e, lse_e = merge_partials(outs, lses)
    out_2, lse_2 = merge_partials(outs, lses / math.log(2), lse_base_e=False)
    torch.testing.assert_close(out_2, out_e, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lse_2 * math.log(2), lse_e, atol=1e-5, rtol=1e-5)


def _batch_cases():
    """(seq_lens, query_lens) with short, long, empty-shard and padded requests."""
    yield [5, 700, 40, 1, 130], [4, 8, 1, 1, 3]
    yield [2, 3, 9, 17, 64], [2, 3, 8, 7, 5]
    yield [300, 6, 0, 0], [6, 6, 0, 0]  # trailing padded requests


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("interleave", INTERLEAVES)
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("causal", [True, False])
def test_sharded_merged_equals_full_attention(world_size, interleave, block_size,
                                              causal):
    for case, (seq_lens, query_lens) in enumerate(_batch_cases()):
        if not causal:  # a DSpark draft block is uniform
            query_lens = [min(q, 1) * 6 for q in query_lens]
            seq_lens = [max(s, q) for s, q in zip(seq_lens, query_lens)]
        batch = random_decode_batch(seq_lens, query_lens, block_size=block_size,
                                    seed=case)
        ref_out, ref_lse = full_attention(batch, causal=causal)
        padded_rows = int(batch.query_start_loc[-1]) + 3  # CUDA-graph padding
        q = torch.cat([batch.q, torch.randn(3, *batch.q.shape[1:])])

        def decode_rank(layout, cache, table):
            flat = build_flat_decode(batch.seq_lens, batch.query_start_loc, table,
                                     layout=layout,
                                     causal=causal,
                                     num_rows=padded_rows)
            out, lse = mla_decode_reference(q, cache, flat.block_table, flat.seq_lens,
                                            kv_lora_rank=KV_LORA_RANK,
                                            scale=batch.scale)
            assert torch.all(lse[flat.empty] == float("-inf"))
            return out, lse

        out, lse = decode_on_simulated_ranks(
            batch.kv_cache, batch.block_table, batch.seq_lens, decode_rank,
            layout=DCPLayout(world_size, interleave=interleave),
            generator=torch.Generator().manual_seed(case))
        real = ref_out.shape[0]
        torch.testing.assert_close(out[:real], ref_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse[:real], ref_lse, atol=1e-5, rtol=1e-5)
        assert torch.all(out[real:] == 0) and torch.all(lse[real:] == float("-inf"))


def test_some_rank_holds_no_kv():
    """Sequences shorter than W*I leave whole ranks without KV."""
    seq_lens = torch.tensor([3, 17], dtype=torch.int32)
    lens = DCPLayout(8, 0, 16).local_seq_lens(seq_lens, rank=torch.arange(8)[:, None])
    assert lens[:, 0].tolist() == [3, 0, 0, 0, 0, 0, 0, 0]
    assert lens[:, 1].tolist() == [16, 1, 0, 0, 0, 0, 0, 0]


def test_shard_paged_kv_places_every_token():
    batch = random_decode_batch([100, 7], [1, 1], block_size=16)
    for world_size, interleave in itertools.product([2, 4], [1, 16]):
        shards = shard_paged_kv(batch.kv_cache, batch.block_table, batch.seq_lens,
                                layout=DCPLayout(world_size, interleave=interleave))
        for req, seq_len in enumerate(batch.seq_lens.tolist()):
            owner, local = DCPLayout(world_size, 0, interleave).owner(
                torch.arange(seq_len))
            for p in range(seq_len):
                cache, table = shards[int(owner[p])]
                j = int(local[p])
                got = cache[table[req, j // 16], j % 16]
                want = batch.kv_cache[batch.block_table[req, p // 16], p % 16]
                assert torch.equal(got, want)
