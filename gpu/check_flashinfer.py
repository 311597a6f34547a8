# SPDX-License-Identifier: Apache-2.0
"""Device check: FlashInfer sm90 MLA on DCP-flattened / grouped rows.

For W in {2, 4, 8} simulated ranks and I in {1, 16, 64}: shard a random paged
latent cache (shard_paged_kv), build each rank's rows (Triton builders), run
FlashInfer FA3 MLA per rank, merge the partials (merge_partials) and compare
with float32 full attention without DCP (mla_decode_reference). Causal rows
use per-request q_len 1..8; non-causal rows q_len 7. Sequences include ones
shorter than W*I, so some ranks hold no KV for some rows. Also checks the LSE
base of FlashInfer's MLA directly. Prints a table; exits 1 on failure.

Two passes per case. "peaky": q ~ N(0, 1) (scores spread ~1.7), output and
LSE at atol = rtol = --tol. "flat": q scaled by --flat-q-scale, so that every
key carries weight near 1/L; there each LSE element must be within a quarter
of delta, the smallest change one key more or one key less makes to that
element (delta = min_k exp(s_k - lse) over the row's visible keys and the
next one, from the float32 reference): an off-by-one bound anywhere, on any
rank, moves the merged LSE by at least delta, so it always fails. Float32
arithmetic on the bf16-rounded inputs leaves the LSE within ~1e-5 of the
reference, against delta ~1e-4 at L = 4100. --plant-off-by-one makes every
long-context causal token (bound >= 1000) see one key more (its successor),
on whichever rank holds it: the flat pass must then fail every causal case.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import math
import sys

import torch

from vllm.v1.attention.ops.dcp_decode import build_flat_decode, mla_decode_reference
from vllm.v1.attention.ops.dcp_simulated_ranks import (decode_on_simulated_ranks,
                                                       random_paged_kv)
from vllm.v1.attention.ops.flashinfer_sm90_mla import FlashInferSm90MLA
from vllm.v1.attention.ops.triton_dcp_metadata import (
    build_flat_decode_triton, build_grouped_decode)

DV, DR = 512, 64


def plant_off_by_one(flat, num_rows):
    """Long-context causal tokens (global bound >= 1000) but a request's last
    see their successor too: the subtle off-by-one (one key in 1000+)."""
    lens = flat.seq_lens[:num_rows]
    bounds = flat.global_seq_lens[:num_rows]
    same_req = (flat.row_to_req[1:num_rows] == flat.row_to_req[:num_rows - 1]) & (
        bounds[1:] == bounds[:-1] + 1)  # the next row is this token's successor
    long_ctx = bounds[:-1] >= 1000
    lens[:-1] = torch.where(same_req & long_ctx, lens[1:], lens[:-1])
    flat.empty[:num_rows] = lens == 0


def min_key_weight(q, cache, table, seq, qsl, full, ref_lse, scale):
    """delta [rows, H]: min over the row's visible keys and the next one of
    exp(s_k - lse), the least one key more or less changes the row's LSE."""
    page = cache.shape[1]
    delta = torch.full_like(ref_lse, float("inf"))
    bounds = full.seq_lens.to(q.device).long()
    for i in range(seq.shape[0]):
        start, end = int(qsl[i]), int(qsl[i + 1])
        n = int(seq[i])
        if end == start or n == 0:
            continue
        keys = cache[table[i, : -(-n // page)].long()].reshape(-1, cache.shape[-1])[:n]
        scores = torch.einsum("thd,kd->thk", q[start:end].float(), keys.float()) * scale
        idx = torch.arange(n, device=q.device)
        window = idx[None, :] < (bounds[start:end, None] + 1).clamp(max=n)
        scores = scores.masked_fill(~window[:, None, :], float("inf"))
        delta[start:end] = torch.exp(scores.min(dim=-1).values - ref_lse[start:end])
    return delta


def run_case(heads, world, inter, causal, qpass, args, ws, scale, dtype, dev,
             results):
    gen = torch.Generator().manual_seed(hash((heads, world, inter, causal)) & 0xFFFF)
    short = [1 + i for i in range(8)]          # shorter than W*I mostly
    lens = short + [63, 200, 1025, 4100]
    num_reqs = len(lens)
    if causal:
        q_lens = [min(1 + i % 8, n) for i, n in enumerate(lens)]
    else:
        q_lens = [min(7, n) for n in lens]
    q_lens[3] = 0                               # a zero-length request
    qsl = torch.zeros(num_reqs + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    rows = int(qsl[-1]) + 3                     # 3 padding rows
    cache, table, seq = random_paged_kv(lens, args.page, generator=gen)
    cache = cache.to(dtype)
    q = torch.randn(rows, heads, DV + DR, generator=gen)
    if qpass == "flat":
        q = q * args.flat_q_scale
    q = q.to(dtype)
    qd = q.to(dev)
    full = build_flat_decode(seq, qsl, table, world_size=1, rank=0,
                             interleave=1, causal=causal, num_rows=rows)
    ref_out, ref_lse = mla_decode_reference(
        qd.float(), cache.to(dev).float(), full.block_table.to(dev),
        full.seq_lens.to(dev), kv_lora_rank=DV, scale=scale)
    delta = min_key_weight(qd, cache.to(dev), table.to(dev), seq, qsl, full,
                           ref_lse, scale)
    shard_rng = gen.get_state()  # every mode gets the same local block ids
    ok = True
    for mode in ("flat", "grouped", "prefix"):
        def decode_rank(rank, lc, lt):
            lt = lt.to(dev)
            flat = build_flat_decode_triton(
                seq.to(dev), qsl.to(dev), lt, world_size=world, rank=rank,
                interleave=inter, causal=causal, num_rows=rows)
            if args.plant_off_by_one and causal:
                plant_off_by_one(flat, rows)
            mla = FlashInferSm90MLA(ws, num_heads=heads, page_size=args.page,
                                    sm_scale=scale, dtype=dtype)
            if mode == "flat":
                mla.plan_flat(flat)
            elif mode == "prefix":
                mla.plan_causal_prefix(flat, qsl.to(dev))
            else:
                mla.plan_grouped(build_grouped_decode(flat, qsl.to(dev), lt),
                                 num_tokens=rows)
            out = torch.full((rows, heads, DV), float("nan"), dtype=dtype, device=dev)
            lse = torch.full((rows, heads), float("nan"), device=dev)
            mla.run(qd, lc.to(dev), out=out, lse=lse)
            return out, lse

        shard_gen = torch.Generator()
        shard_gen.set_state(shard_rng)
        o, l = decode_on_simulated_ranks(cache, table, seq, decode_rank,
                                         world_size=world, interleave=inter,
                                         generator=shard_gen)
        has = full.seq_lens.to(dev) > 0
        err = (o.float() - ref_out.float()).abs().max().item()
        rel = ((o.float() - ref_out.float()).norm() / ref_out.float().norm()).item()
        lerr = (l[has] - ref_lse[has]).abs().max().item()
        ratio = ((l[has] - ref_lse[has]).abs() / delta[has]).max().item()
        pad_ok = bool((l[~has] == float("-inf")).all() and (o[~has] == 0).all())
        finite = bool(torch.isfinite(o).all())
        close = bool(torch.allclose(o.float(), ref_out.float(),
                                    atol=args.tol, rtol=args.tol))
        good = close and lerr < args.tol and pad_ok and finite
        if qpass == "flat":
            good &= ratio < 0.25
        ok &= good
        results.append(dict(mode=mode, q=qpass, heads=heads, W=world, I=inter,
                            causal=causal, rows=rows, max_abs_err=err,
                            rel_err=rel, lse_err=lerr, lse_err_over_delta=ratio,
                            pad_ok=pad_ok, passed=good))
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--heads", type=int, nargs="+", default=[16, 96])
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--csv", default=None)
    ap.add_argument("--tol", type=float, default=2e-2,
                    help="atol = rtol on the merged output; atol on the LSE")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--world", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--interleave", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--flat-q-scale", type=float, default=0.1)
    ap.add_argument("--plant-off-by-one", action="store_true",
                    help="causal rows see one key too many (must fail)")
    args = ap.parse_args()
    dev = args.device
    dtype = torch.bfloat16
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    results, ok = [], True
    scale = 1.0 / math.sqrt(192)

    # LSE base, straight from FlashInfer (W = 1, no masking differences).
    gen = torch.Generator().manual_seed(7)
    cache, table, seq = random_paged_kv([700, 64, 3000], args.page, generator=gen)
    qsl = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    q = torch.randn(3, 16, DV + DR, generator=gen)
    ref_out, ref_lse = mla_decode_reference(q.to(dev).to(dtype).float(),
                                            cache.to(dev).to(dtype).float(),
                                            table.to(dev), seq.to(dev),
                                            kv_lora_rank=DV, scale=scale)
    mla = FlashInferSm90MLA(ws, num_heads=16, page_size=args.page,
                            sm_scale=scale, dtype=dtype)
    mla.plan_requests(qsl.to(dev), seq.to(dev), table.to(dev), causal=False)
    out, lse = mla.run(q.to(dev).to(dtype), cache.to(dev).to(dtype))
    raw_log2 = lse / math.log(2.0)  # what FlashInfer returned
    err_base2 = (raw_log2 * math.log(2.0) - ref_lse).abs().max().item()
    err_basee = (raw_log2 - ref_lse).abs().max().item()
    print(f"LSE base check: |raw*ln2 - ref| = {err_base2:.2e}, "
          f"|raw - ref| = {err_basee:.2e} -> FlashInfer MLA LSE is "
          f"{'base 2' if err_base2 < err_basee else 'natural'}")
    ok &= err_base2 < 1e-2

    cases = []
    for heads in args.heads:
        for world, inter in itertools.product(args.world, args.interleave):
            for causal in (True, False):
                if heads != 16 and not (world == 8 and inter in (1, 64)):
                    continue
                cases.append((heads, world, inter, causal))
    for heads, world, inter, causal in cases:
        for qpass in ("peaky", "flat"):
            ok &= run_case(heads, world, inter, causal, qpass, args, ws, scale,
                           dtype, dev, results)
    print(f"{'mode':8}{'q':>6}{'H':>4}{'W':>3}{'I':>4}{'causal':>7}{'rows':>6}"
          f"{'max|err|':>11}{'rel':>10}{'lse err':>10}{'err/dlt':>9}{'pad':>5}{'ok':>4}")
    for r in results:
        print(f"{r['mode']:8}{r['q']:>6}{r['heads']:4}{r['W']:3}{r['I']:4}"
              f"{str(r['causal']):>7}{r['rows']:6}{r['max_abs_err']:11.2e}"
              f"{r['rel_err']:10.2e}{r['lse_err']:10.2e}{r['lse_err_over_delta']:9.3f}"
              f"{str(r['pad_ok'])[0]:>5}{str(r['passed'])[0]:>4}")
    worst = max(r["max_abs_err"] for r in results)
    worst_ratio = max(r["lse_err_over_delta"] for r in results if r["q"] == "flat")
    failed = sum(not r["passed"] for r in results)
    print(f"worst max|err| = {worst:.3e}; worst flat LSE err/delta = {worst_ratio:.3f} "
          f"(limit 0.25); failed {failed} of {len(results)}; all passed: {ok}")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(results[0]))
            w.writeheader()
            w.writerows(results)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
