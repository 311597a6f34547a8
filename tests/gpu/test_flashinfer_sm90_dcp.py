# SPDX-License-Identifier: Apache-2.0
"""FlashInfer's FA3 MLA under DCP on an sm90 GPU, merged ranks vs dense attention.

For W in {2, 4, 8} simulated ranks and I in {1, 16, 64}: shard a random paged
latent cache (``shard_paged_kv``), build each rank's rows
(``build_flat_decode_triton``), plan and run FA3 prefix segments + Triton
tails per rank as the backend does (``plan_prefix_tail_host`` +
``plan_prefix_tail``, prefixes at each request's first exact local bound),
merge the partials (``merge_partials``) and compare with float32 full
attention without DCP (``mla_decode_reference``). bf16 inputs, page 64.
Causal rows use per-request q_len 1..8, non-causal rows q_len 7; a q_len-0
request and 3 padding rows; sequences shorter than W*I leave some ranks
without KV for some rows. H = 16 at every (W, I), H = 96 at W = 8, I 1 / 64.

Two passes per case. "peaky": q ~ N(0, 1); output and LSE at atol = rtol =
2e-2. "flat": q scaled by 0.1, so that every key carries weight near 1/L;
there each LSE element must also be within a quarter of delta, the smallest
change one key more or one key less makes to it (delta = min_k exp(s_k - lse)
over the row's visible keys and the next one, from the float32 reference):
an off-by-one bound anywhere, on any rank, moves the merged LSE by at least
delta (float32 arithmetic on bf16-rounded inputs stays ~1e-5 from the
reference, delta is ~1e-4 at L = 4100). ``test_planted_off_by_one_is_caught``
makes every long-context causal token (bound >= 1000) see one key more and
asserts that the flat pass fails. ``test_lse_is_base_2`` checks FlashInfer's
MLA LSE base directly (no DCP).

Needs CUDA and flashinfer (skipped otherwise); imports torch, triton,
flashinfer and this project's ops layer only, no vLLM. On the device, from
the repository root::

    python3 -m pytest -q tests/gpu/test_flashinfer_sm90_dcp.py

``FA3_DCP_CSV=file.csv`` writes one row per checked case (errors, LSE error
over delta, pass/fail).
"""

from __future__ import annotations

import csv
import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (sm90)", allow_module_level=True)
pytest.importorskip("flashinfer.mla")

from tests.support.dense_reference import random_decode_batch  # noqa: E402
from tests.support.fa3_native import (  # noqa: E402
    FlashInferSm90MLAGraphed,
    NativeFA3MLA,
    plan_prefix_tail_from_rows,
)

from vllm.v1.attention.ops.dcp_decode import (  # noqa: E402
    DCPLayout, build_flat_decode, merge_partials, mla_decode_reference)
from tools.dcp_simulated_ranks import shard_paged_kv  # noqa: E402
from vllm.v1.attention.ops.triton_dcp_metadata import (  # noqa: E402
    build_flat_decode_triton)

pytestmark = pytest.mark.gpu

DV = 512
PAGE = 64
TOL = 2e-2            # atol = rtol on the merged output; atol on the LSE
FLAT_Q_SCALE = 0.1
DELTA_LIMIT = 0.25    # flat pass: LSE error per element / delta
SCALE = 1.0 / math.sqrt(192)
DTYPE = torch.bfloat16
DEV = "cuda"

_ROWS: list[dict] = []


@pytest.fixture(scope="module")
def workspace():
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=DEV)
    yield ws
    path = os.environ.get("FA3_DCP_CSV")
    if path and _ROWS:
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(_ROWS[0]))
            writer.writeheader()
            writer.writerows(_ROWS)


def _cases():
    for world in (2, 4, 8):
        for inter in (1, 16, 64):
            for causal in (True, False):
                yield 16, world, inter, causal
    for inter in (1, 64):
        for causal in (True, False):
            yield 96, 8, inter, causal


def _plant_off_by_one(flat, num_rows, bounds):
    """Long-context causal tokens (global bound >= 1000) but a request's last
    see their successor too: the subtle off-by-one (one key in 1000+).
    ``bounds``: int32 [>= num_rows] the rows' global bounds."""
    lens = flat.seq_lens[:num_rows]
    bounds = bounds[:num_rows]
    successor = (flat.row_to_req[1:num_rows] == flat.row_to_req[:num_rows - 1]) & (
        bounds[1:] == bounds[:-1] + 1)
    long_ctx = bounds[:-1] >= 1000
    lens[:-1] = torch.where(successor & long_ctx, lens[1:], lens[:-1])
    flat.empty[:num_rows] = lens == 0


def _min_key_weight(q, cache, table, seq, qsl, full, ref_lse):
    """delta [T, H]: min over the row's visible keys and the next one of
    exp(s_k - lse), the least one key more or less changes the row's LSE."""
    delta = torch.full_like(ref_lse, float("inf"))
    bounds = full.seq_lens.to(q.device).long()
    for i in range(seq.shape[0]):
        start, end = int(qsl[i]), int(qsl[i + 1])
        n = int(seq[i])
        if end == start or n == 0:
            continue
        pages = table[i, : -(-n // PAGE)].long()
        keys = cache[pages].reshape(-1, cache.shape[-1])[:n].float()
        scores = torch.einsum("thd,kd->thk", q[start:end].float(), keys) * SCALE
        window = (torch.arange(n, device=q.device)[None, :]
                  < (bounds[start:end, None] + 1).clamp(max=n))
        scores = scores.masked_fill(~window[:, None, :], float("inf"))
        delta[start:end] = torch.exp(scores.min(dim=-1).values - ref_lse[start:end])
    return delta


def _run_case(ws, heads, world, inter, causal, qpass, *, plant=False) -> dict:
    """One case's merged result against the dense reference: a result row."""
    lens = [1 + i for i in range(8)] + [63, 200, 1025, 4100]
    if causal:
        q_lens = [min(1 + i % 8, n) for i, n in enumerate(lens)]
    else:
        q_lens = [min(7, n) for n in lens]
    q_lens[3] = 0  # a zero-length request
    seed = 1000 * heads + 100 * world + inter + (7 if causal else 0)
    batch = random_decode_batch(lens, q_lens, block_size=PAGE, num_heads=heads,
                                seed=seed, extra_blocks=0)
    seq, qsl, table = batch.seq_lens, batch.query_start_loc, batch.block_table
    rows = int(qsl[-1]) + 3  # 3 padding rows
    gen = torch.Generator().manual_seed(seed)
    q = torch.cat([batch.q, torch.randn(3, heads, batch.q.shape[-1], generator=gen)])
    if qpass == "flat":
        q = q * FLAT_Q_SCALE
    q = q.to(DTYPE).to(DEV)
    cache = batch.kv_cache.to(DTYPE)
    full = build_flat_decode(seq, qsl, table, layout=DCPLayout(),
                             causal=causal, num_rows=rows)
    ref_out, ref_lse = mla_decode_reference(
        q.float(), cache.to(DEV).float(), full.block_table.to(DEV),
        full.seq_lens.to(DEV), kv_lora_rank=DV, scale=SCALE)
    delta = _min_key_weight(q, cache.to(DEV), table.to(DEV), seq, qsl, full, ref_lse)
    outs, lses = [], []
    for rank, (local_cache, local_table) in enumerate(
            shard_paged_kv(cache, table, seq, layout=DCPLayout(world, 0, inter),
                           generator=gen)):
        flat = build_flat_decode_triton(
            seq.to(DEV), qsl.to(DEV), local_table.to(DEV),
            layout=DCPLayout(world, rank, inter), causal=causal, num_rows=rows)
        if plant:
            _plant_off_by_one(flat, rows, full.seq_lens.to(DEV))
        mla = FlashInferSm90MLAGraphed(ws, num_heads=heads, page_size=PAGE,
                                       sm_scale=SCALE, dtype=DTYPE, max_rows=rows,
                                       max_cols=local_table.shape[1])
        plan_prefix_tail_from_rows(mla, flat, qsl.to(DEV))
        out = torch.full((rows, heads, DV), float("nan"), dtype=DTYPE, device=DEV)
        lse = torch.full((rows, heads), float("nan"), device=DEV)
        mla.run(q, local_cache.to(DEV), out=out, lse=lse)
        outs.append(out)
        lses.append(lse)
    out, lse = merge_partials(torch.stack(outs), torch.stack(lses))
    has_kv = full.seq_lens.to(DEV) > 0
    lse_err = (lse[has_kv] - ref_lse[has_kv]).abs()
    row = dict(
        q=qpass, heads=heads, W=world, I=inter, causal=causal, rows=rows,
        planted=plant,
        max_abs_err=(out.float() - ref_out).abs().max().item(),
        rel_err=((out.float() - ref_out).norm() / ref_out.norm()).item(),
        lse_err=lse_err.max().item(),
        lse_err_over_delta=(lse_err / delta[has_kv]).max().item(),
        empty_rows_ok=bool((lse[~has_kv] == float("-inf")).all()
                           and (out[~has_kv] == 0).all()),
        finite=bool(torch.isfinite(out).all()),
        close=bool(torch.allclose(out.float(), ref_out, atol=TOL, rtol=TOL)))
    _ROWS.append(row)
    return row


@pytest.mark.parametrize("qpass", ["peaky", "flat"])
@pytest.mark.parametrize("heads,world,inter,causal", list(_cases()))
def test_merged_ranks_match_dense_attention(workspace, heads, world, inter, causal,
                                            qpass):
    row = _run_case(workspace, heads, world, inter, causal, qpass)
    assert row["finite"] and row["empty_rows_ok"], row
    assert row["close"] and row["lse_err"] < TOL, row
    if qpass == "flat":
        assert row["lse_err_over_delta"] < DELTA_LIMIT, row


@pytest.mark.parametrize("world,inter", [(2, 1), (2, 16), (4, 1), (4, 16)])
def test_planted_off_by_one_is_caught(workspace, world, inter):
    """The flat pass must see one key too many in 1000+ (the check's teeth)."""
    row = _run_case(workspace, 16, world, inter, True, "flat", plant=True)
    assert row["lse_err_over_delta"] >= DELTA_LIMIT, row


def test_lse_is_base_2(workspace):
    """FlashInfer's MLA LSE is base 2 (the adapter and tail kernel rely on
    it): FlashInfer's own decode at W = 1 against the dense reference."""
    batch = random_decode_batch([700, 64, 3000], [1, 1, 1], block_size=PAGE,
                                num_heads=16, seed=7, extra_blocks=0)
    q = batch.q.to(DTYPE).to(DEV)
    cache = batch.kv_cache.to(DTYPE).to(DEV)
    table, seq = batch.block_table.to(DEV), batch.seq_lens.to(DEV)
    _, ref_lse = mla_decode_reference(q.float(), cache.float(), table, seq,
                                      kv_lora_rank=DV, scale=SCALE)
    native = NativeFA3MLA(workspace, num_heads=16, page_size=PAGE, sm_scale=SCALE,
                          dtype=DTYPE)
    native.plan(batch.query_start_loc, batch.seq_lens, table, causal=False)
    _, raw_lse = native.run(q, cache)
    err_base2 = (raw_lse * math.log(2.0) - ref_lse).abs().max().item()
    err_base_e = (raw_lse - ref_lse).abs().max().item()
    assert err_base2 < 1e-2 and err_base2 < err_base_e, (err_base2, err_base_e)
