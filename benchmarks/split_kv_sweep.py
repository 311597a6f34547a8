# SPDX-License-Identifier: Apache-2.0
"""Split-KV Triton MLA decode against FA3 prefix+tail, per layer (H200).

One rank's share of a decode forward: B requests of ``ctx / W`` local KV
tokens, causal q_len 4, H heads, page 64. Every timed run is one CUDA-graph
replay of C layers over C distinct caches (enough of them that the KV comes
from HBM, not L2), divided by C. For each point:

- FA3 prefix+tail (``FlashInferSm90MLA``, what the backend runs today) and
  FlashInfer's native no-DCP decode on the same local KV;
- every knob set of ``TritonMLASplitKV`` (key block, MMA rows, warps,
  pipeline stages), then the split-count knobs of the best one;
- per knob set: stage-1 registers and spills, whether the MMA is Hopper's
  wgmma, and the largest difference from FA3's output (the check that the
  fast configuration is also right);
- the FA3 layer's kernels one by one (torch.profiler): what its fixed cost is.

    python -m benchmarks.split_kv_sweep --out-dir DIR
"""

from __future__ import annotations

import argparse
import math
import traceback

import torch

from benchmarks._common import cuda_event_median_ms, write_csv
from benchmarks.fa3_native import NativeFA3MLA
from vllm.v1.attention.ops.dcp_decode import DCPLayout, alloc_flat_decode
from vllm.v1.attention.ops.flashinfer_sm90_mla import FlashInferSm90MLA
from vllm.v1.attention.ops.triton_dcp_metadata import build_flat_decode_triton
from vllm.v1.attention.ops.triton_mla_split_kv import TritonMLASplitKV

DV, DR, PAGE, Q_LEN = 512, 64, 64, 4

# (block_n, block_m, num_warps, num_stages)
KERNEL_KNOBS = [(32, 64, 8, 2), (64, 64, 8, 2), (32, 64, 8, 3), (64, 64, 8, 1),
                (32, 32, 4, 2), (64, 32, 4, 2), (32, 32, 8, 2), (64, 32, 8, 3),
                (32, 16, 4, 3), (64, 16, 4, 2)]
# (programs_per_sm, min_chunk)
SPLIT_KNOBS = [(1, 256), (2, 256), (4, 256), (2, 128), (2, 512), (4, 128)]


class Point:
    """Caches, rows and both kernels' inputs of one benchmark point."""

    def __init__(self, batch, ctx, world, heads, pool_gib, max_model_len):
        dev = "cuda"
        self.batch, self.ctx, self.world, self.heads = batch, ctx, world, heads
        self.local = int(DCPLayout(world).local_seq_lens(torch.tensor([ctx]))[0])
        # The rank's share of the longest sequence the deployment allows.
        self.max_local = int(DCPLayout(world).local_seq_lens(
            torch.tensor([max(max_model_len, ctx)]))[0])
        pages = -(-self.local // PAGE)
        self.layer_bytes = batch * self.local * (DV + DR) * 2
        cache_bytes = batch * pages * PAGE * (DV + DR) * 2
        self.copies = max(2, min(64, int(max(400e6, 8 * cache_bytes) // cache_bytes)))
        self.copies = min(self.copies, max(1, int(pool_gib * 2**30 // cache_bytes)))
        gen = torch.Generator(device=dev).manual_seed(0)
        self.caches = [torch.randn(batch * pages + 1, PAGE, DV + DR, device=dev,
                                   dtype=torch.bfloat16, generator=gen)
                       for _ in range(self.copies)]
        self.table = (torch.randperm(batch * pages, device=dev, generator=gen)
                      + 1).int().view(batch, pages)
        self.seq = torch.full((batch,), ctx, dtype=torch.int32)
        self.qsl = torch.arange(batch + 1, dtype=torch.int32) * Q_LEN
        self.rows = batch * Q_LEN
        self.scale = 1.0 / math.sqrt(192)
        self.layout = DCPLayout(world, 0, 1)
        self.flat = build_flat_decode_triton(
            self.seq.to(dev), self.qsl.to(dev), self.table, layout=self.layout,
            causal=True, num_rows=self.rows,
            out=alloc_flat_decode(self.rows, pages, dev))
        self.q = torch.randn(self.rows, heads, DV + DR, device=dev,
                             dtype=torch.bfloat16, generator=gen)
        self.out = torch.empty(self.rows, heads, DV, device=dev, dtype=torch.bfloat16)
        self.lse = torch.empty(self.rows, heads, device=dev)

    def layer_ms(self, run_layer) -> float:
        """Per-layer time of one graph replay of ``copies`` layers."""
        def step():
            for cache in self.caches:
                run_layer(cache)
        step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        ms = cuda_event_median_ms(graph.replay, 15)
        del graph
        return ms / self.copies

    def tbps(self, ms: float) -> float:
        return self.layer_bytes / (ms * 1e-3) / 1e12


def fa3(point, ws):
    kernel = FlashInferSm90MLA(ws, num_heads=point.heads, page_size=PAGE,
                               sm_scale=point.scale, dtype=torch.bfloat16,
                               max_rows=point.rows, max_cols=point.table.shape[1])
    fa3_plan(kernel, point)
    return kernel


def fa3_plan(kernel, point):
    """The backend's per-forward FA3 plan, from host lengths."""
    kernel.plan_rows(point.qsl, point.seq, point.table, point.flat,
                     num_rows=point.rows, causal=True, slack=Q_LEN - 1,
                     layout=point.layout)


def fa3_kernels(kernel, point):
    """The FA3 layer's CUDA kernels and their times (us), eager, one layer."""
    from torch.profiler import ProfilerActivity, profile

    run = lambda: kernel.run(point.q, point.caches[0], out=point.out, lse=point.lse)
    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            run()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", 0) or 0
        if us > 0:
            rows.append((e.key[:70], us / 5))
    return sorted(rows, key=lambda r: -r[1])


def plan_profile(make_plan, label, reps=10):
    """Host time of a plan (ms, synced) and its top host functions."""
    import cProfile
    import io
    import pstats
    import time

    make_plan()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        make_plan()
    torch.cuda.synchronize()
    print(f"    {label}: {(time.perf_counter() - start) / reps * 1e3:.3f} ms")
    prof = cProfile.Profile()
    prof.enable()
    make_plan()
    torch.cuda.synchronize()
    prof.disable()
    for order, count in (("tottime", 8), ("cumulative", 25)):
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats(order).print_stats(count)
        print(f"      by {order}:")
        for line in text.getvalue().splitlines():
            if line.strip() and line.strip()[0].isdigit():
                print("      " + line.strip()[:160])


def split_kernel(point, knobs, split_knobs):
    block_n, block_m, warps, stages = knobs
    ppsm, min_chunk = split_knobs
    kernel = TritonMLASplitKV(
        num_heads=point.heads, sm_scale=point.scale, dtype=torch.bfloat16,
        max_rows=point.rows, max_local_len=point.local, device="cuda",
        max_rows_per_program=Q_LEN, block_n=block_n, block_m=block_m,
        num_warps=warps, num_stages=stages, programs_per_sm=ppsm,
        min_chunk=min_chunk)
    kernel.plan(point.flat.seq_lens, point.flat.block_table, num_rows=point.rows,
                rows_per_program=Q_LEN, row_to_req=point.flat.row_to_req)
    return kernel


def compiled_report(kernel, point) -> dict:
    """Stage-1 registers / spills / wgmma of the kernel's launch."""
    from vllm.v1.attention.ops import triton_mla_split_kv as sk

    args = dict(kernel.kernel_args)
    row_lens, table, row_to_req = kernel._rows
    compiled = sk.split_kv_decode(
        point.q, point.caches[0], table, row_lens, kernel._part_out, kernel._part_lse,
        point.out, point.lse, num_splits=kernel.num_splits, sm_scale=point.scale,
        rows_per_program=kernel.rows_per_program, row_to_req=row_to_req, **args)
    if compiled is None:
        return {}
    ptx = getattr(compiled, "asm", {}).get("ptx", "")
    return dict(regs=getattr(compiled, "n_regs", -1),
                spills=getattr(compiled, "n_spills", -1),
                wgmma="wgmma.mma_async" in ptx, cp_async="cp.async" in ptx)


def deployed(point, min_split_keys, fa3_ms, fa3_out, base, results):
    """``TritonMLASplitKV`` with its default knobs but ``min_split_keys``."""
    kernel = TritonMLASplitKV(
        num_heads=point.heads, sm_scale=point.scale, dtype=torch.bfloat16,
        max_rows=point.rows, max_local_len=point.max_local, device="cuda",
        max_rows_per_program=Q_LEN, min_split_keys=min_split_keys)
    kernel.plan(point.flat.seq_lens, point.flat.block_table, num_rows=point.rows,
                rows_per_program=Q_LEN, row_to_req=point.flat.row_to_req)
    ms = point.layer_ms(lambda c: kernel.run(point.q, c, out=point.out, lse=point.lse))
    kernel.run(point.q, point.caches[0], out=point.out, lse=point.lse)  # FA3's cache
    err = float((point.out.float() - fa3_out).abs().max())
    print(f"  defaults, min_split_keys={min_split_keys:4} S={kernel.num_splits:4}: "
          f"{ms * 1e3:7.1f} us {point.tbps(ms):5.2f} TB/s x{ms / fa3_ms:5.2f} of FA3 "
          f"diff={err:.2e}", flush=True)
    results.append(dict(base, path="split_defaults", min_split_keys=min_split_keys,
                        splits=kernel.num_splits, layer_us=ms * 1e3,
                        tbps=point.tbps(ms), over_fa3=ms / fa3_ms,
                        max_diff_vs_fa3=err))


def run_point(point, ws, args):
    results = []
    base = dict(batch=point.batch, ctx=point.ctx, W=point.world, heads=point.heads,
                local_tokens=point.local, copies=point.copies)
    kernel = fa3(point, ws)
    fa3_ms = point.layer_ms(lambda c: kernel.run(point.q, c, out=point.out,
                                                 lse=point.lse))
    kernel.run(point.q, point.caches[0], out=point.out, lse=point.lse)
    fa3_out = point.out.float().clone()
    native = NativeFA3MLA(ws, num_heads=point.heads, page_size=PAGE,
                          sm_scale=point.scale, dtype=torch.bfloat16)
    native.plan(point.qsl.cuda(), torch.full((point.batch,), point.local,
                                             dtype=torch.int32, device="cuda"),
                point.table, causal=True)
    native_ms = point.layer_ms(lambda c: native.run(point.q, c))
    print(f"B={point.batch} ctx={point.ctx // 1024}K W={point.world} H={point.heads} "
          f"local={point.local} copies={point.copies}: FA3 prefix+tail "
          f"{fa3_ms * 1e3:.1f} us ({point.tbps(fa3_ms):.2f} TB/s), native "
          f"{native_ms * 1e3:.1f} us ({point.tbps(native_ms):.2f} TB/s)", flush=True)
    if args.profile:
        for name, us in fa3_kernels(kernel, point):
            print(f"    FA3 layer kernel {us:8.1f} us  {name}")
        plan_profile(lambda: fa3_plan(kernel, point), "FA3 prefix+tail plan")
        split = split_kernel(point, KERNEL_KNOBS[0], (2, 256))
        plan_profile(lambda: split.plan(
            point.flat.seq_lens, point.flat.block_table, num_rows=point.rows,
            rows_per_program=Q_LEN, row_to_req=point.flat.row_to_req),
            "split-KV plan")
    results.append(dict(base, path="fa3", layer_us=fa3_ms * 1e3,
                        tbps=point.tbps(fa3_ms), native_us=native_ms * 1e3))

    def measure(knobs, split_knobs):
        try:
            kernel = split_kernel(point, knobs, split_knobs)
            ms = point.layer_ms(lambda c: kernel.run(point.q, c, out=point.out,
                                                     lse=point.lse))
            report = compiled_report(kernel, point)
            err = float((point.out.float() - fa3_out).abs().max())
        except Exception as exc:  # noqa: BLE001 - a knob set may not compile
            print(f"  {knobs} {split_knobs}: {type(exc).__name__}: {str(exc)[:120]}")
            return None
        row = dict(base, path="split", block_n=knobs[0], block_m=knobs[1],
                   warps=knobs[2], stages=knobs[3], programs_per_sm=split_knobs[0],
                   min_chunk=split_knobs[1], splits=kernel.num_splits,
                   layer_us=ms * 1e3, tbps=point.tbps(ms), over_fa3=ms / fa3_ms,
                   native_us=native_ms * 1e3, max_diff_vs_fa3=err, **report)
        print(f"  bn={knobs[0]:3} bm={knobs[1]:3} w={knobs[2]} st={knobs[3]} "
              f"ppsm={split_knobs[0]} chunk>={split_knobs[1]:4} S={kernel.num_splits:4}: "
              f"{ms * 1e3:7.1f} us {point.tbps(ms):5.2f} TB/s x{ms / fa3_ms:5.2f} of FA3 "
              f"regs={report.get('regs')} spills={report.get('spills')} "
              f"wgmma={report.get('wgmma')} diff={err:.2e}", flush=True)
        results.append(row)
        return row

    for min_keys in args.min_split_keys:
        deployed(point, min_keys, fa3_ms, fa3_out, base, results)
    rows = [r for r in (measure(k, (2, 256)) for k in args.kernel_knobs) if r]
    if rows and args.split_knobs:
        best = min(rows, key=lambda r: r["layer_us"])
        knobs = (best["block_n"], best["block_m"], best["warps"], best["stages"])
        for split_knobs in args.split_knobs:
            if split_knobs != (2, 256):
                measure(knobs, split_knobs)
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", nargs="+", default=[
        "1,262144,1,16", "1,262144,2,16", "1,262144,4,16", "1,262144,8,16",
        "1,32768,8,16", "8,262144,8,16", "1,262144,1,96", "1,262144,8,96"],
        help="batch,ctx,W,heads")
    ap.add_argument("--quick", action="store_true",
                    help="first 4 kernel knob sets, no split-count sweep")
    ap.add_argument("--min-split-keys", type=int, nargs="*", default=[],
                    help="also time TritonMLASplitKV's defaults with each of these "
                         "min_split_keys (split count from --max-model-len)")
    ap.add_argument("--no-knobs", action="store_true",
                    help="skip the kernel and split-count knob sweep")
    ap.add_argument("--max-model-len", type=int, default=262144)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--pool-gib", type=float, default=16.0)
    ap.add_argument("--out-dir", default=".")
    args = ap.parse_args()
    args.kernel_knobs = ([] if args.no_knobs else
                         KERNEL_KNOBS[:4] if args.quick else KERNEL_KNOBS)
    args.split_knobs = [] if args.quick or args.no_knobs else SPLIT_KNOBS
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    results = []
    for spec in args.points:
        batch, ctx, world, heads = map(int, spec.split(","))
        try:
            point = Point(batch, ctx, world, heads, args.pool_gib, args.max_model_len)
            results += run_point(point, ws, args)
        except Exception:  # noqa: BLE001 - report, go on with the next point
            traceback.print_exc()
        point = None
        torch.cuda.empty_cache()
        write_csv(f"{args.out_dir}/split_kv_sweep.csv", results)


if __name__ == "__main__":
    main()
