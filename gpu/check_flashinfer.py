# SPDX-License-Identifier: Apache-2.0
"""Device check: FlashInfer sm90 MLA on DCP-flattened / grouped rows.

For W in {2, 4, 8} simulated ranks and I in {1, 16, 64}: shard a random paged
latent cache (shard_paged_kv), build each rank's rows (Triton builders), run
FlashInfer FA3 MLA per rank, merge the partials (merge_partials) and compare
with float32 full attention without DCP (mla_decode_reference). Causal rows
use per-request q_len 1..8; non-causal rows q_len 7. Sequences include ones
shorter than W*I, so some ranks hold no KV for some rows. Also checks the LSE
base of FlashInfer's MLA directly. Prints a table; exits 1 on failure.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import math
import sys

import torch

from vllm.v1.attention.ops.dcp_decode import (
    build_flat_decode, merge_partials, mla_decode_reference, shard_paged_kv)
from vllm.v1.attention.ops.flashinfer_sm90_mla import FlashInferSm90MLA
from vllm.v1.attention.ops.triton_dcp_metadata import (
    build_flat_decode_triton, build_grouped_decode)

DV, DR = 512, 64


def make_batch(lens, page, gen):
    blocks = [-(-n // page) for n in lens]
    cache = torch.randn(sum(blocks) + 1, page, DV + DR, generator=gen)
    cache[0] = float("nan")
    ids = torch.randperm(sum(blocks), generator=gen) + 1
    table = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    s = 0
    for i, n in enumerate(blocks):
        table[i, :n] = ids[s:s + n]
        s += n
    return cache, table, torch.tensor(lens, dtype=torch.int32)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--heads", type=int, nargs="+", default=[16, 96])
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--csv", default=None)
    ap.add_argument("--tol", type=float, default=2e-2,
                    help="atol = rtol on the merged output; atol on the LSE")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    dev = args.device
    dtype = torch.bfloat16
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    results, ok = [], True
    scale = 1.0 / math.sqrt(192)

    # LSE base, straight from FlashInfer (W = 1, no masking differences).
    gen = torch.Generator().manual_seed(7)
    cache, table, seq = make_batch([700, 64, 3000], args.page, gen)
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
        for world, inter in itertools.product([2, 4, 8], [1, 16, 64]):
            for causal in (True, False):
                if heads != 16 and not (world == 8 and inter in (1, 64)):
                    continue
                cases.append((heads, world, inter, causal))
    for heads, world, inter, causal in cases:
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
        cache, table, seq = make_batch(lens, args.page, gen)
        cache = cache.to(dtype)
        q = torch.randn(rows, heads, DV + DR, generator=gen).to(dtype)
        qd = q.to(dev)
        full = build_flat_decode(seq, qsl, table, world_size=1, rank=0,
                                 interleave=1, causal=causal, num_rows=rows)
        ref_out, ref_lse = mla_decode_reference(
            qd.float(), cache.to(dev).float(), full.block_table.to(dev),
            full.seq_lens.to(dev), kv_lora_rank=DV, scale=scale)
        shards = shard_paged_kv(cache, table, seq, world_size=world,
                                interleave=inter, generator=gen)
        merged = {}
        for mode in ("flat", "grouped", "prefix"):
            outs, lses = [], []
            for rank, (lc, lt) in enumerate(shards):
                lt = lt.to(dev)
                flat = build_flat_decode_triton(
                    seq.to(dev), qsl.to(dev), lt, world_size=world, rank=rank,
                    interleave=inter, causal=causal, num_rows=rows)
                mla = FlashInferSm90MLA(ws, num_heads=heads,
                                        page_size=args.page, sm_scale=scale,
                                        dtype=dtype)
                if mode == "flat":
                    mla.plan_flat(flat)
                elif mode == "prefix":
                    mla.plan_causal_prefix(flat, qsl.to(dev))
                else:
                    mla.plan_grouped(build_grouped_decode(flat, qsl.to(dev), lt),
                                     num_tokens=rows)
                out = torch.full((rows, heads, DV), float("nan"), dtype=dtype,
                                 device=dev)
                lse = torch.full((rows, heads), float("nan"), device=dev)
                mla.run(qd, lc.to(dev), out=out, lse=lse)
                outs.append(out)
                lses.append(lse)
            o, l = merge_partials(torch.stack(outs), torch.stack(lses))
            merged[mode] = (o, l)
            has = full.seq_lens.to(dev) > 0
            err = (o.float() - ref_out.float()).abs().max().item()
            rel = ((o.float() - ref_out.float()).norm() / ref_out.float().norm()).item()
            lerr = (l[has] - ref_lse[has]).abs().max().item()
            pad_ok = bool((l[~has] == float("-inf")).all() and (o[~has] == 0).all())
            finite = bool(torch.isfinite(o).all())
            close = bool(torch.allclose(o.float(), ref_out.float(),
                                        atol=args.tol, rtol=args.tol))
            good = close and lerr < args.tol and pad_ok and finite
            ok &= good
            results.append(dict(mode=mode, heads=heads, W=world, I=inter,
                                causal=causal, rows=rows, max_abs_err=err,
                                rel_err=rel, lse_err=lerr, pad_ok=pad_ok,
                                passed=good))
    print(f"{'mode':8}{'H':>4}{'W':>3}{'I':>4}{'causal':>7}{'rows':>6}"
          f"{'max|err|':>11}{'rel':>10}{'lse err':>10}{'pad':>5}{'ok':>4}")
    for r in results:
        print(f"{r['mode']:8}{r['heads']:4}{r['W']:3}{r['I']:4}{str(r['causal']):>7}"
              f"{r['rows']:6}{r['max_abs_err']:11.2e}{r['rel_err']:10.2e}"
              f"{r['lse_err']:10.2e}{str(r['pad_ok'])[0]:>5}{str(r['passed'])[0]:>4}")
    worst = max(r["max_abs_err"] for r in results)
    print(f"worst max|err| = {worst:.3e}; all passed: {ok}")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(results[0]))
            w.writeheader()
            w.writerows(results)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
