# SPDX-License-Identifier: Apache-2.0
"""Decode-step benchmark of the sm90 path as the backend runs it (H200).

One rank's share of a decode step: L layers of FLASHINFER_MLA's sm90 path,
at rank-local shapes of W = 1/2/4/8 (each request's ``ctx / W`` local KV
tokens), batch B, causal q_len 4, H heads:

- fa3: FA3 prefix segments + Triton tails, planned once from host data by
  ``FlashInferSm90MLA.plan_rows`` (the builder's call), every layer ``run``; the
  prefixes are whole pages, as the backend plans them (every context here is
  a multiple of W pages, so each row's tail is the worst case: a page and
  the query's own keys); fa3-exact: prefixes at the exact bound (the tails
  are the query's keys only), for the cost of those tails; fa3:KxS: fa3 with
  the tail kernel at K keys per loop step and S pipelining stages.

For each point and path: the step eager (L runs) and as one CUDA-graph
replay, the KV bytes read per second in the replay, the launch overhead
removed (eager - graph), the sum of the step's kernel times (torch.profiler
over eager steps, fa3 with --profile), the host+device time of the
builder's per-forward work (rows + plan) when the lengths repeat (plan_ms:
FA3's schedule is reused) and when every forward's lengths differ by a page
(plan_miss_ms: FlashInfer plans), and FlashInfer's own no-DCP causal decode over the same local KV
(one layer). Layers cycle over enough distinct caches to keep every layer's
KV out of L2. (The split-KV Triton decode this benchmark also measured was
removed: at the deployed head counts FA3 was faster at every point,
benchmarks/RESULTS.md run 17.)

    python -m benchmarks.decode_step --out-dir DIR [--paths fa3 fa3-exact] [--heads 96]
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from benchmarks._common import cuda_event_median_ms as time_ms, write_csv
from tests.support.fa3_native import FlashInferSm90MLAGraphed, NativeFA3MLA
from vllm.v1.attention.ops.dcp_decode import DCPLayout, alloc_flat_decode
from vllm.v1.attention.ops.flashinfer_sm90_mla import (
    host_prefix_lens, plan_prefix_tail_host)
from vllm.v1.attention.ops.triton_dcp_metadata import build_flat_decode_triton

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


class Setup:
    """One point's rank-local KV (cycled over distinct caches), rows and
    queries: what both paths read."""

    def __init__(self, batch, ctx, world, layers, heads, q_len, args):
        dev = "cuda"
        self.batch, self.ctx, self.world, self.layers = batch, ctx, world, layers
        self.heads, self.q_len = heads, q_len
        self.local = int(DCPLayout(world).local_seq_lens(torch.tensor([ctx]))[0])
        pages = -(-self.local // PAGE)
        self.per_layer_bytes = batch * pages * PAGE * (DV + DR) * 2
        self.copies = max(1, min(layers, int(args.pool_gib * 2**30
                                             // self.per_layer_bytes)))
        gen = torch.Generator(device=dev).manual_seed(0)
        self.caches = [torch.randn(batch * pages + 1, PAGE, DV + DR, device=dev,
                                   dtype=torch.bfloat16, generator=gen)
                       for _ in range(self.copies)]
        self.table = (torch.randperm(batch * pages, device=dev, generator=gen)
                      + 1).int().view(batch, pages)
        self.seq = torch.full((batch,), ctx, dtype=torch.int32)
        # One page shorter on every rank: a forward whose FA3 schedule differs.
        self.seq_short = self.seq - world * PAGE
        self.qsl = torch.arange(batch + 1, dtype=torch.int32) * q_len
        self.rows = batch * q_len
        self.scale = 1.0 / math.sqrt(192)
        self.flat_buf = alloc_flat_decode(self.rows, pages, dev)
        self.qs = [torch.randn(self.rows, heads, DV + DR, device=dev,
                               dtype=torch.bfloat16, generator=gen)
                   for _ in range(min(layers, 4))]
        self.outs = [(torch.empty(self.rows, heads, DV, device=dev,
                                  dtype=torch.bfloat16),
                      torch.empty(self.rows, heads, device=dev))
                     for _ in range(layers)]
        self.bytes_step = layers * batch * self.local * (DV + DR) * 2

    def build_rows(self, seq):
        return build_flat_decode_triton(
            seq.to("cuda"), self.qsl.to("cuda"), self.table,
            layout=DCPLayout(self.world), causal=True,
            num_rows=self.rows, out=self.flat_buf)

    def step_fn(self, kernel, layers=None):
        layers = self.layers if layers is None else layers

        def step():
            for l in range(layers):
                out, lse = self.outs[l % len(self.outs)]
                kernel.run(self.qs[l % len(self.qs)], self.caches[l % self.copies],
                           out=out, lse=lse)
        return step


def plan_ms_per_forward(plan, lens):
    """Host + device time of ``plan(l)`` per call, over the lengths given."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for seq in lens:
        plan(seq)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / len(lens) * 1000


def measure_path(setup, kernel, plan, args):
    """Plan time per forward (repeated and changing lengths), eager and graph
    step, one layer, KV TB/s. The step runs the plan of ``setup.seq``."""
    plan(setup.seq)  # first-use costs (FlashInfer's graph wrapper, compiles)
    plan_miss_ms = plan_ms_per_forward(plan, [setup.seq_short, setup.seq] * 3)
    plan_ms = plan_ms_per_forward(plan, [setup.seq] * 6)
    step = setup.step_fn(kernel)
    step()
    reps = max(3, min(20, int(200 / max(setup.layers * setup.per_layer_bytes / 4e9,
                                        0.05))))
    eager = time_ms(step, reps)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    replay = time_ms(graph.replay, reps)
    kern = (kernel_ms(step, iters=1) if args.profile and setup.batch == 1
            else float("nan"))
    layer_ms = time_ms(setup.step_fn(kernel, layers=1), 20)
    del graph
    return dict(eager_ms=eager, graph_ms=replay,
                launch_overhead_removed_ms=eager - replay, kernel_sum_ms=kern,
                graph_over_kernels=replay / kern if kern == kern else float("nan"),
                layer_ms=layer_ms, plan_ms=plan_ms, plan_over_layer=plan_ms / layer_ms,
                plan_miss_ms=plan_miss_ms,
                kv_tbps=setup.bytes_step / replay / 1e9,
                roofline_frac=setup.bytes_step / replay / 1e9 / HBM_TBPS)


def point(setup, ws, args):
    """Every path at one point; returns one CSV row per path."""
    results = []
    base = dict(batch=setup.batch, ctx=setup.ctx, W=setup.world, layers=setup.layers,
                heads=setup.heads, local_tokens=setup.local)
    # FlashInfer's own causal multi-token decode (no DCP) on the same local KV.
    try:
        native = NativeFA3MLA(ws, num_heads=setup.heads, page_size=PAGE,
                                   sm_scale=setup.scale, dtype=torch.bfloat16)
    except ImportError:
        raise SystemExit("decode_step needs FlashInfer")
    native.plan(setup.qsl.to("cuda"),
                torch.full((setup.batch,), setup.local, dtype=torch.int32,
                           device="cuda"), setup.table, causal=True)
    native_ms = time_ms(lambda: native.run(setup.qs[0], setup.caches[0]), 20)
    for path in args.paths:
        tail = {}
        if ":" in path:
            keys, stages = (int(v) for v in path.partition(":")[2].split("x"))
            tail = dict(tail_keys_per_step=keys, tail_num_stages=stages)
        kernel = FlashInferSm90MLAGraphed(ws, num_heads=setup.heads, page_size=PAGE,
                                          sm_scale=setup.scale, dtype=torch.bfloat16,
                                          max_rows=setup.rows,
                                          max_cols=setup.table.shape[1], **tail)

        def plan(seq, kernel=kernel, exact=path == "fa3-exact"):
            flat = setup.build_rows(seq)
            layout = DCPLayout(setup.world)
            if not exact:  # the backend's plan
                kernel.plan_rows(setup.qsl, seq, setup.table, flat,
                                 num_rows=setup.rows, causal=True,
                                 slack=setup.q_len - 1, layout=layout)
                return
            # Exact prefixes, not whole pages: what whole-page tails cost.
            prefix = host_prefix_lens(seq, setup.qsl, causal=True,
                                      slack=setup.q_len - 1, layout=layout)
            host = plan_prefix_tail_host(setup.qsl, prefix, num_rows=setup.rows,
                                         page_size=PAGE, whole_pages=False)
            kernel.plan_prefix_tail(host, setup.table, flat.seq_lens,
                                    flat.block_table)
        r = dict(base, path=path, **measure_path(setup, kernel, plan, args))
        r.update(native_layer_ms=native_ms, layer_over_native=r["layer_ms"] / native_ms)
        results.append(r)
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--ctx", type=int, nargs="+", default=[32768, 131072, 262144])
    ap.add_argument("--world", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--layers", type=int, nargs="+", default=[24, 61])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--q-len", type=int, default=4)
    ap.add_argument("--paths", nargs="+", default=["fa3"],
                    help="fa3, fa3-exact, or fa3:KxS (the tail kernel at K "
                         "keys per step and S pipelining stages)")
    ap.add_argument("--pool-gib", type=float, default=12.0)
    ap.add_argument("--max-gib", type=float, default=40.0,
                    help="skip points whose one-copy KV exceeds this")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out-dir", default=".")
    args = ap.parse_args()
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    results = []
    print(f"{'B':>3}{'ctx':>8}{'W':>3}{'L':>4}{'path':>10}{'eager':>9}"
          f"{'graph':>9}{'removed':>9}{'kern':>8}{'TB/s':>6}{'layer':>8}{'native':>8}"
          f"{'l/n':>6}{'plan':>7}{'miss':>7}")
    for layers in args.layers:
        for batch in args.batch:
            for ctx in args.ctx:
                for world in args.world:
                    if batch * ctx / world * (DV + DR) * 2 > args.max_gib * 2**30:
                        continue
                    setup = Setup(batch, ctx, world, layers, args.heads, args.q_len,
                                  args)
                    for r in point(setup, ws, args):
                        results.append(r)
                        print(f"{batch:3}{ctx // 1024:7}K{world:3}{layers:4}"
                              f"{r['path']:>10}"
                              f"{r['eager_ms']:9.3f}{r['graph_ms']:9.3f}"
                              f"{r['launch_overhead_removed_ms']:9.3f}"
                              f"{r['kernel_sum_ms']:8.3f}{r['kv_tbps']:6.2f}"
                              f"{r['layer_ms']:8.3f}{r['native_layer_ms']:8.3f}"
                              f"{r['layer_over_native']:6.2f}{r['plan_ms']:7.3f}"
                              f"{r['plan_miss_ms']:7.3f}",
                              flush=True)
                    del setup
                    torch.cuda.empty_cache()
    if results:
        write_csv(f"{args.out_dir}/decode_step.csv", results)
    # W-rank step against 1.2/W of the W=1 step (graph replay) of the faster
    # path there.
    base = {}
    for r in results:
        if r["W"] == 1:
            key = (r["batch"], r["ctx"], r["layers"])
            base[key] = min(base.get(key, float("inf")), r["graph_ms"])
    print("W-rank step / best W=1 step (target <= 1.2/W):")
    for r in results:
        b = base.get((r["batch"], r["ctx"], r["layers"]))
        if b and r["W"] > 1:
            ratio = r["graph_ms"] / b
            print(f"  {r['path']:>10} B={r['batch']} ctx={r['ctx'] // 1024}K "
                  f"L={r['layers']} W={r['W']}: {ratio:.3f} (target "
                  f"{1.2 / r['W']:.3f}) {'met' if ratio <= 1.2 / r['W'] else 'missed'}")


if __name__ == "__main__":
    main()
