# SPDX-License-Identifier: Apache-2.0
"""Decode-step benchmark of the sm90 path as the backend runs it (H200).

One rank's share of a decode step: L layers of FLASHINFER_MLA's sm90 path
(FA3 prefix segments + Triton tails, planned once from host data by
``plan_prefix_tail_host`` / ``plan_prefix_tail``, every layer ``run``), at
rank-local shapes of W = 1/2/4/8 (each request's ``ctx / W`` local KV
tokens), batch B, causal q_len 4, H heads. For each point: the step eager
(L runs) and as one CUDA-graph replay, the KV bytes read per second in the
replay, the launch overhead removed (eager - graph), the sum of the step's
kernel times (torch.profiler over eager steps), the host+device plan time,
and FlashInfer's own no-DCP causal decode over the same local KV (one layer).
Layers cycle over enough distinct caches to keep every layer's KV out of L2.

    python -m benchmarks.decode_step --out-dir DIR
"""

from __future__ import annotations

import argparse
import csv
import math
import time

import torch

from benchmarks._common import cuda_event_median_ms as time_ms
from vllm.v1.attention.ops.dcp_decode import DCPLayout, alloc_flat_decode
from vllm.v1.attention.ops.flashinfer_sm90_mla import (
    FlashInferSm90MLA, host_prefix_lens, plan_prefix_tail_host)
from vllm.v1.attention.ops.triton_dcp_metadata import build_flat_decode_triton
from benchmarks.fa3_native import NativeFA3MLA

DV, DR, PAGE = 512, 64, 64
HBM_TBPS = 4.25  # measured copy bandwidth here


def kernel_ms(fn, iters=3):
    """Sum of CUDA kernel times of one call of fn (profiler, eager)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    try:
        total_us = sum(e.self_device_time_total for e in prof.key_averages()
                       if "CUDA" in str(getattr(e, "device_type", "")))
    except Exception as exc:  # profiler API drift: report, do not stop
        print("profiler:", exc)
        return float("nan")
    return total_us / 1000.0 / iters


def point(batch, ctx, world, layers, heads, q_len, ws, args):
    dev = "cuda"
    local = int(DCPLayout(world).local_seq_lens(torch.tensor([ctx]))[0])
    pages = -(-local // PAGE)
    per_layer_bytes = batch * pages * PAGE * (DV + DR) * 2
    copies = max(1, min(layers, int(args.pool_gib * 2**30 // per_layer_bytes)))
    gen = torch.Generator(device=dev).manual_seed(0)
    caches = [torch.randn(batch * pages + 1, PAGE, DV + DR, device=dev,
                          dtype=torch.bfloat16, generator=gen) for _ in range(copies)]
    table = (torch.randperm(batch * pages, device=dev, generator=gen) + 1).int().view(
        batch, pages)
    seq = torch.full((batch,), ctx, dtype=torch.int32)
    qsl = torch.arange(batch + 1, dtype=torch.int32) * q_len
    rows = batch * q_len
    scale = 1.0 / math.sqrt(192)
    kernel = FlashInferSm90MLA(ws, num_heads=heads, page_size=PAGE, sm_scale=scale,
                               dtype=torch.bfloat16, max_rows=rows, max_cols=pages)
    flat_buf = alloc_flat_decode(rows, pages, dev)
    qs = [torch.randn(rows, heads, DV + DR, device=dev, dtype=torch.bfloat16,
                      generator=gen) for _ in range(min(layers, 4))]

    def plan():
        flat = build_flat_decode_triton(seq.to(dev), qsl.to(dev), table,
                                        layout=DCPLayout(world, 0, 1), causal=True,
                                        num_rows=rows, out=flat_buf)
        prefix = host_prefix_lens(seq, qsl, causal=True, slack=q_len - 1,
                                  layout=DCPLayout(world, 0, 1))
        host = plan_prefix_tail_host(qsl, prefix, num_rows=rows, page_size=PAGE)
        kernel.plan_prefix_tail(host, table, flat.seq_lens, flat.block_table)

    outs = [(torch.empty(rows, heads, DV, device=dev, dtype=torch.bfloat16),
             torch.empty(rows, heads, device=dev)) for _ in range(layers)]

    def step():
        for l in range(layers):
            kernel.run(qs[l % len(qs)], caches[l % copies], out=outs[l][0],
                       lse=outs[l][1])

    plan()
    step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        plan()
    torch.cuda.synchronize()
    plan_ms = (time.perf_counter() - t0) / 5 * 1000
    reps = max(3, min(20, int(200 / max(layers * per_layer_bytes / 4e9, 0.05))))
    eager = time_ms(step, reps)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    replay = time_ms(graph.replay, reps)
    kern = kernel_ms(step, iters=1) if args.profile and batch == 1 else float("nan")

    def one_layer():
        kernel.run(qs[0], caches[0], out=outs[0][0], lse=outs[0][1])
    layer_ms = time_ms(one_layer, 20)
    # FlashInfer's own causal multi-token decode (no DCP) on the same local KV.
    native = NativeFA3MLA(ws, num_heads=heads, page_size=PAGE, sm_scale=scale,
                          dtype=torch.bfloat16)
    native.plan(qsl.to(dev), torch.full((batch,), local, dtype=torch.int32,
                                        device=dev), table, causal=True)
    native_ms = time_ms(lambda: native.run(qs[0], caches[0]), 20)
    del caches
    bytes_step = layers * batch * local * (DV + DR) * 2
    return dict(batch=batch, ctx=ctx, W=world, layers=layers, heads=heads,
                local_tokens=local, eager_ms=eager, graph_ms=replay,
                launch_overhead_removed_ms=eager - replay, kernel_sum_ms=kern,
                graph_over_kernels=replay / kern if kern == kern else float("nan"),
                layer_ms=layer_ms, native_layer_ms=native_ms,
                layer_over_native=layer_ms / native_ms,
                plan_ms=plan_ms, plan_over_layer=plan_ms / layer_ms,
                kv_tbps=bytes_step / replay / 1e9,
                roofline_frac=bytes_step / replay / 1e9 / HBM_TBPS)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--ctx", type=int, nargs="+", default=[32768, 131072, 262144])
    ap.add_argument("--world", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--layers", type=int, nargs="+", default=[24, 61])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--q-len", type=int, default=4)
    ap.add_argument("--pool-gib", type=float, default=12.0)
    ap.add_argument("--max-gib", type=float, default=40.0,
                    help="skip points whose one-copy KV exceeds this")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out-dir", default=".")
    args = ap.parse_args()
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    results = []
    print(f"{'B':>3}{'ctx':>8}{'W':>3}{'L':>4}{'eager':>9}{'graph':>9}{'removed':>9}"
          f"{'kern':>8}{'g/k':>6}{'TB/s':>6}{'layer':>8}{'native':>8}{'l/n':>6}{'plan':>7}")
    for layers in args.layers:
        for batch in args.batch:
            for ctx in args.ctx:
                for world in args.world:
                    if batch * ctx / world * (DV + DR) * 2 > args.max_gib * 2**30:
                        continue
                    r = point(batch, ctx, world, layers, args.heads, args.q_len, ws, args)
                    results.append(r)
                    print(f"{batch:3}{ctx // 1024:7}K{world:3}{layers:4}"
                          f"{r['eager_ms']:9.3f}{r['graph_ms']:9.3f}"
                          f"{r['launch_overhead_removed_ms']:9.3f}{r['kernel_sum_ms']:8.3f}"
                          f"{r['graph_over_kernels']:6.2f}{r['kv_tbps']:6.2f}"
                          f"{r['layer_ms']:8.3f}{r['native_layer_ms']:8.3f}"
                          f"{r['layer_over_native']:6.2f}{r['plan_ms']:7.3f}", flush=True)
                    torch.cuda.empty_cache()
    with open(f"{args.out_dir}/decode_step.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(results[0]))
        w.writeheader()
        w.writerows(results)
    # W-rank step against 1.2/W of W=1 (graph replay).
    base = {(r["batch"], r["ctx"], r["layers"]): r["graph_ms"] for r in results
            if r["W"] == 1}
    print("W-rank step / W=1 step (target <= 1.2/W):")
    for r in results:
        b = base.get((r["batch"], r["ctx"], r["layers"]))
        if b and r["W"] > 1:
            ratio = r["graph_ms"] / b
            print(f"  B={r['batch']} ctx={r['ctx'] // 1024}K L={r['layers']} W={r['W']}: "
                  f"{ratio:.3f} (target {1.2 / r['W']:.3f}) "
                  f"{'met' if ratio <= 1.2 / r['W'] else 'missed'}")


if __name__ == "__main__":
    main()
