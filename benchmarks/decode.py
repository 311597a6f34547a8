# SPDX-License-Identifier: Apache-2.0
"""Per-rank DCP MLA decode with FlashInfer's sm90 (FA3) MLA kernel.

For each point (heads H, batch, global context, mode, DCP size W) and for
ranks 0 and W-1 (rank 0 holds the most KV, so it bounds the step), times
  prefix   the backend's path: one non-causal FA3 segment per request over the
           request's first local bound, plus the Triton kernel that adds each
           token's <= q_len-1 tail keys and merges (its time includes that
           kernel, which also converts the LSE and masks empty rows),
  native   FlashInfer's own multi-token decode over the same local KV, one
           segment per request (causal for verify, non-causal for a draft);
           at W = 1 this is plain no-DCP decode. FlashInfer's FA3 planner
           refuses some causal shapes (96 heads: "causal tile boundary");
  native_nc  then the baseline is the same per-request segments unmasked
           (same KV reads, no mask): the baseline column says which.
Kimi-K3 shapes: latent 512 + rope 64, bf16, page 64. Reports achieved KV
bandwidth (unique local KV bytes / time) against a measured device copy rate,
the per-rank ratio prefix/native, and the time of a W-rank step (max over
ranks) against W = 1 native. Kernel time only (CUDA-graph replay of the run;
the native baseline is FlashInfer's bare run).

Example: python -m benchmarks.decode --out-dir benchmarks/results
"""

from __future__ import annotations

import argparse
import itertools
import math
import os

import torch
from tqdm import tqdm

from benchmarks._common import (copy_bandwidth_tbs, environment, print_table,
                                random_paged_tables, time_ms, write_csv)
from benchmarks.fa3_native import NativeFA3MLA, plan_prefix_tail_from_rows
from vllm.v1.attention.ops.dcp_decode import DCPLayout
from vllm.v1.attention.ops.flashinfer_sm90_mla import FlashInferSm90MLA
from vllm.v1.attention.ops.triton_dcp_metadata import build_flat_decode_triton

DV, DR, PAGE = 512, 64, 64
KV_BYTES_PER_TOKEN = (DV + DR) * 2


def parse_points(text):
    pts = []
    for item in text.split(","):
        b, c = item.split("x")
        pts.append((int(b), int(c.rstrip("kK")) * (1024 if c[-1] in "kK" else 1)))
    return pts


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, nargs="+", default=[16, 96])
    ap.add_argument("--points", default="1x256k,64x32k,256x4k",
                    help="batch x global context, comma separated")
    ap.add_argument("--world", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--modes", nargs="+", default=["causal4", "noncausal7"],
                    help="causal<q_len> or noncausal<q_len>")
    ap.add_argument("--interleave", type=int, default=1)
    ap.add_argument("--pool-gib", type=float, default=3.0,
                    help="size of the shared random KV page pool")
    ap.add_argument("--rep", type=int, default=15, help="ms per timing")
    ap.add_argument("--out-dir", default="benchmarks/results")
    args = ap.parse_args()
    env = environment()
    copy_tbs = copy_bandwidth_tbs()
    env["copy_TBps"] = round(copy_tbs, 3)
    print(env)
    points = parse_points(args.points)
    pool_pages = int(args.pool_gib * (1 << 30) / (PAGE * KV_BYTES_PER_TOKEN))
    cache = torch.randn(pool_pages, PAGE, DV + DR, device="cuda",
                        dtype=torch.bfloat16)
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    scale = 1 / math.sqrt(192)
    rows = []
    errors = set()
    os.makedirs(args.out_dir, exist_ok=True)
    grid = list(itertools.product(args.heads, points, args.modes, args.world))
    for heads, (batch, ctx), mode, world in tqdm(grid, desc="decode"):
        causal = mode.startswith("causal")
        q_len = int(mode.replace("noncausal", "").replace("causal", ""))
        gen = torch.Generator().manual_seed(batch + ctx + world)
        # Slightly ragged lengths around ctx.
        seq = (ctx - torch.randint(0, 64, (batch,), generator=gen)).int()
        qsl = (torch.arange(batch + 1) * q_len).int().cuda()
        n = batch * q_len
        q = torch.randn(n, heads, DV + DR, device="cuda", dtype=torch.bfloat16)
        out = q.new_empty(n, heads, DV)
        lse = torch.empty(n, heads, device="cuda")
        ranks = sorted({0, world - 1})
        for rank in ranks:
            local = DCPLayout(world, rank, args.interleave).local_seq_lens(seq)
            table = random_paged_tables(batch, local, PAGE, pool_pages, gen).cuda()
            seq_d, local_d = seq.cuda(), local.cuda()
            flat = build_flat_decode_triton(
                seq_d, qsl, table, layout=DCPLayout(world, rank, args.interleave),
                causal=causal, num_rows=n)
            times = {}
            mla = FlashInferSm90MLA(ws, num_heads=heads, page_size=PAGE,
                                    sm_scale=scale)
            native = NativeFA3MLA(ws, num_heads=heads, page_size=PAGE,
                                  sm_scale=scale)
            variants = ["prefix", "native"]
            if causal:
                variants.append("native_nc")
            for variant in variants:
                try:
                    if variant == "prefix":
                        plan_prefix_tail_from_rows(mla, flat, qsl)
                        run = lambda: mla.run(q, cache, out=out, lse=lse)
                    else:
                        native.plan(qsl, local_d, table,
                                    causal=variant == "native" and causal)
                        run = lambda: native.run(q, cache, out=out, lse=lse)
                    times[variant] = time_ms(run, rep=args.rep)
                except Exception as e:  # noqa: BLE001 - e.g. unsupported plan
                    msg = str(e).splitlines()[0][:200]
                    key = (variant, heads, batch, ctx, world)
                    if key not in errors:
                        print(f"  {variant} H={heads} b={batch} ctx={ctx} "
                              f"W={world} r={rank}: {type(e).__name__}: {msg}")
                    errors.add(key)
                    times[variant] = float("nan")
            if not causal:
                times["native_nc"] = times["native"]
            # Baseline: FlashInfer's own causal decode where its planner takes
            # the shape, else the same segments without the mask.
            base = times["native"]
            if base != base:
                base = times["native_nc"]
            kv_bytes = int(local.sum()) * KV_BYTES_PER_TOKEN
            row = dict(heads=heads, batch=batch, ctx=ctx, mode=mode, W=world,
                       rank=rank, rows=n,
                       prefix_us=times["prefix"] * 1e3,
                       native_us=times["native"] * 1e3,
                       native_nc_us=times["native_nc"] * 1e3,
                       baseline="native" if times["native"] == times["native"]
                       else "native_nc",
                       baseline_us=base * 1e3,
                       prefix_over_base=times["prefix"] / base,
                       base_TBps=kv_bytes / (base * 1e-3) / 1e12,
                       prefix_TBps=kv_bytes / (times["prefix"] * 1e-3) / 1e12)
            row["prefix_bw_frac"] = row["prefix_TBps"] / copy_tbs
            rows.append(row)
            write_csv(os.path.join(args.out_dir, "decode.csv"), rows)
    del cache
    os.makedirs(args.out_dir, exist_ok=True)
    write_csv(os.path.join(args.out_dir, "decode.csv"), rows)
    print(f"copy rate (read+write): {copy_tbs:.2f} TB/s")
    print_table(rows, ["heads", "batch", "ctx", "mode", "W", "rank",
                       "prefix_us", "native_us", "native_nc_us", "baseline",
                       "prefix_over_base", "base_TBps", "prefix_TBps"])

    # W-rank step: max over the timed ranks vs W = 1 native.
    steps = []
    for heads, (batch, ctx), mode in itertools.product(args.heads, points,
                                                       args.modes):
        sel = [r for r in rows if (r["heads"], r["batch"], r["ctx"], r["mode"])
               == (heads, batch, ctx, mode)]
        base = next(r["baseline_us"] for r in sel if r["W"] == 1)
        for world in args.world:
            ws_ = [r for r in sel if r["W"] == world]
            step = dict(heads=heads, batch=batch, ctx=ctx, mode=mode, W=world,
                        step_prefix_us=max(r["prefix_us"] for r in ws_),
                        w1_base_us=base)
            step["prefix_vs_w1"] = step["step_prefix_us"] / base
            steps.append(step)
    write_csv(os.path.join(args.out_dir, "decode_step.csv"), steps)
    print("\nW-rank step (max over ranks 0 and W-1) vs W=1 native:")
    print_table(steps, ["heads", "batch", "ctx", "mode", "W", "step_prefix_us",
                        "w1_base_us", "prefix_vs_w1"])

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(args.heads), len(args.modes),
                             figsize=(6 * len(args.modes), 4 * len(args.heads)),
                             squeeze=False)
    for (i, heads), (j, mode) in itertools.product(enumerate(args.heads),
                                                   enumerate(args.modes)):
        ax = axes[i][j]
        labels = [f"{b}x{c // 1024}k" for b, c in points]
        x = range(len(points))
        for k, world in enumerate(args.world):
            sel = [next(s for s in steps if (s["heads"], s["batch"], s["ctx"],
                        s["mode"], s["W"]) == (heads, b, c, mode, world))
                   for b, c in points]
            ax.plot(x, [s["step_prefix_us"] for s in sel], "^-", color=f"C{k}",
                    label=f"prefix+tail W={world}")
        ax.plot(x, [next(s["w1_base_us"] for s in steps
                         if (s["heads"], s["batch"], s["ctx"], s["mode"]) ==
                         (heads, b, c, mode)) for b, c in points],
                "k:", label="FlashInfer native W=1")
        ax.set_xticks(list(x), labels)
        ax.set_yscale("log")
        ax.set_title(f"H={heads} {mode}")
        ax.set_ylabel("us per layer step (max over ranks)")
        ax.legend(fontsize=6)
    fig.suptitle(f"FlashInfer sm90 MLA under DCP, {env['device']}")
    fig.tight_layout()
    fig.savefig(os.path.join(args.out_dir, "decode.png"), dpi=110)


if __name__ == "__main__":
    main()
