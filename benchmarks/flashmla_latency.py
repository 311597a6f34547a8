# SPDX-License-Identifier: Apache-2.0
"""Where FLASHMLA's time goes at small batches per rank (issue 35).

The deployed shape as in ``benchmarks/flashmla_rows.py`` (q_len 4, rank 0
of W 8, interleave 1, 96 or 128 heads after DCP's query gather), at batch
1, 2, 4 x 16K / 32K / 64K local keys, verify and DSpark block, bf16 and fp8.

``profile``: torch.profiler over CUDA-graph replays (and eager calls) of the
DCP rows and of FlashMLA alone: per call, the device time of FlashMLA's main
kernel, its split combine, its scheduler-metadata kernel and the finishing
``tail_merge`` launch, against the replay's wall time (the rest is launch
gaps); FlashMLA's SM partitions, each request's splits and the bytes of the
split partials.

``finish``: the layer (graph replay median, us) with FlashMLA only (no
finishing launch: the floor of any fusion), with the finishing launch as
before issue 40 (one program per row and 16 heads, ``column_blocks=1``), and
as now (``column_blocks_for`` the grid: 4 programs along Dv on a small
batch); the outputs of the two launches compared bitwise.

``vsplit``: FlashMLA over each request cut into N pieces (N virtual requests
of local / N keys, q repeated): what a planner-side split of small batches
would give FlashMLA's main kernel and combine.

``fp8parts``: vLLM's fp8 FlashMLA with scheduler metadata made for other
partition counts (the fp8 kernel takes tile metadata as an input).

Needs an sm90 GPU and vLLM's Python with its FlashMLA extensions
(gpu/README.md)::

    python3 -m benchmarks.flashmla_latency --out-dir DIR [--parts ...]
"""

from __future__ import annotations

import argparse
import collections
import functools
import statistics

import torch

from benchmarks._common import run_parts, time_ms
from benchmarks.flashmla_rows import DR, DV, WORLD, Point, roofline_us

REP = 20  # ms of replays per timing (triton's do_bench_cudagraph)
# Checked in order: fp8's combine is named flash_fwd_splitkv_mla_combine_kernel
# (run 20 counted it with the main kernel, as "main (2)").
KINDS = {"combine": "combine", "main": "splitkv_mla", "sched": "sched_meta",
         "finish": "tail_merge"}


def _classify(name: str) -> str:
    lowered = name.lower()
    for kind, key in KINDS.items():
        if key in lowered:
            return kind
    if "metadata" in lowered:
        return "sched"
    return "other"


def _plan(point):
    from vllm.utils.platform_utils import num_compute_units
    from vllm.v1.attention.ops.flashmla_dcp_rows import FlashMLARowPlanner

    planner = FlashMLARowPlanner(
        max_reqs=point.batch, max_rows=point.num_rows, num_heads=point.heads,
        kv_lora_rank=DV, fp8=point.fp8, num_sms=num_compute_units(0),
        device=point.q.device)
    return planner.plan(point.flat, point.table, query_start_loc=point.qsl,
                        query_start_loc_cpu=point.qsl.cpu(), num_rows=point.num_rows,
                        causal=point.causal, forward_id=1)


def _run_fn(point, finish):
    """The plan's ``run`` with the finishing launch replaced by ``finish``
    (None: FlashMLA only)."""
    from vllm.v1.attention.ops import flashmla_dcp_rows as rows

    plan = _plan(point)
    layer = point.layer
    kwargs = dict(sm_scale=point.scale,
                  q_scale=layer._q_scale if point.fp8 else None,
                  k_scale=layer._k_scale if point.fp8 else None)

    def fn():
        saved = rows.tail_merge
        rows.tail_merge = finish or (lambda *a, **k: None)
        try:
            return plan.run(point.q, point.caches[0], **kwargs)
        finally:
            rows.tail_merge = saved
    return fn, plan


def _old_finish(*args, **kwargs):
    from vllm.v1.attention.ops.mla_tail_merge import tail_merge

    kwargs.update(column_blocks=1)
    return tail_merge(*args, **kwargs)


def _blocks_finish(column_blocks):
    def finish(*args, **kwargs):
        from vllm.v1.attention.ops.mla_tail_merge import tail_merge

        kwargs.update(column_blocks=column_blocks)
        return tail_merge(*args, **kwargs)
    return finish


def _new_finish(*args, **kwargs):
    from vllm.v1.attention.ops.mla_tail_merge import tail_merge

    return tail_merge(*args, **kwargs)


def _splits(plan, point):
    """(SM partitions, splits per request, bytes of split partials written)."""
    if point.fp8:
        tile, splits = plan.sched_meta
    else:
        tile, splits = plan.sched_meta.tile_scheduler_metadata, plan.sched_meta.num_splits
    per_req = (splits[1:] - splits[:-1]).tolist()
    rows = point.q_len * point.heads
    written = sum(n for n in per_req if n > 1) * rows * (DV + 1) * 4
    return tile.shape[0], per_req, written


def _profile(fn, calls=10):
    """Per-call device time by kernel kind over graph replays, and the
    replay's wall time per call."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    walls = []
    for _ in range(20):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        walls.append(start.elapsed_time(end) * 1e3 / calls)
    walls.sort()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize()
    per_kind = collections.defaultdict(float)
    counts = collections.Counter()
    names = {}
    for event in prof.events():
        device_us = getattr(event, "device_time", None)
        if device_us is None:
            device_us = getattr(event, "cuda_time", 0.0)
        if not device_us or getattr(event, "device_type", None) is None:
            continue
        if "cuda" not in str(event.device_type).lower():
            continue
        kind = _classify(event.name)
        per_kind[kind] += device_us / (5 * calls)
        counts[kind] += 1
        names.setdefault(kind, event.name[:60])
    del graph
    return walls[len(walls) // 2], dict(per_kind), {k: v / (5 * calls) for k, v in counts.items()}, names


def profile_part(args, gen):
    rows = []
    print("profile: per call, device us of each kernel kind (count per call), graph "
          "replay wall us; parts = FlashMLA's SM partitions, splits per request, "
          "split partials written (MB)")
    for heads in args.heads:
        for causal in (True, False):
            for fp8 in (False, True):
                for batch in args.profile_batch:
                    for local in args.profile_local:
                        point = Point(batch, local, args.q_len, heads, causal, fp8, WORLD, gen)
                        for path in ("dcp", "alone"):
                            fn = point.dcp_fn() if path == "dcp" else point.alone_fn()
                            extra = ""
                            if path == "dcp":
                                plan_fn, plan = _run_fn(point, _new_finish)
                                plan_fn()
                                parts, per_req, written = _splits(plan, point)
                                extra = (f" parts {parts} splits {per_req} "
                                         f"partials {written / 1e6:.1f} MB")
                            try:
                                wall, kinds, counts, names = _profile(fn)
                            except Exception as error:  # noqa: BLE001 - report it
                                print(f"  profile {path}: {type(error).__name__}: {error}")
                                continue
                            desc = " ".join(f"{k} {v:.1f}({counts[k]:.0f})"
                                            for k, v in sorted(kinds.items()))
                            gap = wall - sum(kinds.values())
                            print(f"{heads:4} {'verify' if causal else 'draft':>6} "
                                  f"{'fp8' if fp8 else 'bf16':>4} B{batch} {local // 1024}K "
                                  f"{path:>5}: wall {wall:.1f} | {desc} | gap {gap:.1f}{extra}",
                                  flush=True)
                            rows.append(dict(part="profile", heads=heads,
                                             kind="verify" if causal else "draft",
                                             kv="fp8" if fp8 else "bf16", batch=batch,
                                             local=local, path=path, wall_us=round(wall, 2),
                                             **{f"{k}_us": round(v, 2) for k, v in kinds.items()},
                                             gap_us=round(gap, 2)))
                            if extra:
                                rows[-1].update(parts=parts, splits=str(per_req),
                                                partial_mb=round(written / 1e6, 2))
                        print("   kernels:", names, flush=True)
                        del point
                        torch.cuda.empty_cache()
    return rows


def finish_part(args, gen):
    rows = []
    print(f"{'H':>4}{'kind':>7}{'kv':>5}{'B':>3}{'local':>6}  {'roof':>5} {'alone':>6} "
          f"{'bare':>6} {'old':>6} {'new':>6}  old/alone new/alone bare/alone  same")
    for heads in args.heads:
        for causal in (True, False):
            for fp8 in (False, True):
                for batch in args.batch:
                    for local in args.local:
                        point = Point(batch, local, args.q_len, heads, causal, fp8, WORLD, gen)
                        outs = {}
                        variants = [("bare", None), ("old", _old_finish),
                                    ("new", _new_finish)]
                        variants += [(f"cb{n}", _blocks_finish(n)) for n in args.column_blocks]
                        fns = {"alone": point.alone_fn()}
                        for name, finish in variants:
                            fns[name], _ = _run_fn(point, finish)
                            if finish is not None:
                                out, lse = fns[name]()
                                outs[name] = (out.clone(), lse.clone())
                        # Each path timed --repeats times, the paths interleaved: the
                        # median of the repeats (one timing drifts by a few %).
                        samples = {name: [] for name in fns}
                        for _ in range(args.repeats):
                            for name, fn in fns.items():
                                samples[name].append(time_ms(fn, rep=REP) * 1e3)
                        times = {name: statistics.median(v) for name, v in samples.items()}
                        same = (torch.equal(outs["old"][0], outs["new"][0])
                                and torch.equal(outs["old"][1], outs["new"][1]))
                        roof = roofline_us(batch, local, args.q_len, heads)
                        a = times["alone"]
                        print(f"{heads:4}{'verify' if causal else 'draft':>7}"
                              f"{'fp8' if fp8 else 'bf16':>5}{batch:3}{local // 1024:5}K  "
                              f"{roof:5.0f} " + " ".join(f"{times[k]:6.1f}" for k in
                                                         ("alone", "bare", "old", "new"))
                              + f"  {times['old'] / a:9.3f} {times['new'] / a:9.3f} "
                                f"{times['bare'] / a:10.3f}  {same}"
                              + "".join(f"  cb{n} {times[f'cb{n}']:6.1f}"
                                        for n in args.column_blocks), flush=True)
                        rows.append(dict(part="finish", heads=heads,
                                         kind="verify" if causal else "draft",
                                         kv="fp8" if fp8 else "bf16", batch=batch, local=local,
                                         roofline_us=round(roof, 1), same=same,
                                         **{f"{k}_us": round(v, 2) for k, v in times.items()}))
                        del point
                        torch.cuda.empty_cache()
    return rows


def vsplit_part(args, gen):
    """FlashMLA (non-causal) over each request cut into N pieces."""
    from vllm.v1.attention.ops import flashmla

    rows = []
    print("vsplit: FlashMLA causal=False, each request cut into N virtual requests "
          "(us: kernel only / with the q copy)")
    for fp8 in (False, True):
        for heads in args.heads[:1]:
            for batch in args.batch:
                for local in [x for x in args.local if x >= 32768]:
                    point = Point(batch, local, args.q_len, heads, False, fp8, WORLD, gen)
                    pages = point.table.shape[1]
                    line = []
                    for pieces in (1, 2, 4, 8):
                        if pages % pieces:
                            continue
                        sub = pages // pieces
                        table = point.table.view(batch, pieces, sub).reshape(batch * pieces, sub)
                        lens = torch.full((batch * pieces,), local // pieces,
                                          dtype=torch.int32, device="cuda")
                        shape = (batch, pieces, args.q_len, heads, DV + DR)
                        q_src = point.q.view(batch, 1, args.q_len, heads, DV + DR)
                        q_rep = q_src.expand(shape).reshape(batch * pieces, args.q_len,
                                                            heads, DV + DR).contiguous()
                        cache = point.caches[0].unsqueeze(-2)
                        if fp8:
                            tile, splits = flashmla.get_mla_metadata_dense_fp8(
                                lens, args.q_len * heads, 1)

                            def call(q=q_rep, table=table, lens=lens, tile=tile,
                                     splits=splits):
                                return flashmla.flash_mla_with_kvcache_fp8(
                                    q=q, k_cache=cache, block_table=table,
                                    cache_seqlens=lens, head_dim_v=DV,
                                    tile_scheduler_metadata=tile, num_splits=splits,
                                    softmax_scale=point.scale, causal=False,
                                    descale_q=point.layer._q_scale,
                                    descale_k=point.layer._k_scale)
                        else:
                            sched = flashmla.get_mla_metadata()[0]

                            def call(q=q_rep, table=table, lens=lens, sched=sched):
                                return flashmla.flash_mla_with_kvcache(
                                    q=q, k_cache=cache, block_table=table,
                                    cache_seqlens=lens, head_dim_v=DV,
                                    tile_scheduler_metadata=sched,
                                    softmax_scale=point.scale, causal=False)

                        def with_copy(call=call, q_rep=q_rep, q_src=q_src, shape=shape):
                            q_rep.view(shape).copy_(q_src.expand(shape))
                            return call()
                        try:
                            bare = time_ms(call, rep=REP) * 1e3
                            copied = time_ms(with_copy, rep=REP) * 1e3 if pieces > 1 else bare
                        except Exception as error:  # noqa: BLE001 - report it
                            print(f"  N={pieces}: {type(error).__name__}: {str(error)[:200]}")
                            continue
                        line.append(f"N{pieces} {bare:6.1f}/{copied:6.1f}")
                        rows.append(dict(part="vsplit", kv="fp8" if fp8 else "bf16",
                                         heads=heads, batch=batch, local=local,
                                         pieces=pieces, us=round(bare, 2),
                                         us_with_copy=round(copied, 2)))
                    print(f"{heads:4} {'fp8' if fp8 else 'bf16':>4} B{batch} "
                          f"{local // 1024}K: " + "  ".join(line), flush=True)
                    del point
                    torch.cuda.empty_cache()
    return rows


def fp8parts_part(args, gen):
    from vllm.v1.attention.ops import flashmla

    rows = []
    print("fp8parts: fp8 FlashMLA (causal=False) with metadata made for "
          "num_q_tokens_per_head_k x factor (partitions, us)")
    for heads in args.heads:
        for batch in args.profile_batch:
            for local in args.profile_local:
                point = Point(batch, local, args.q_len, heads, False, True, WORLD, gen)
                q = point.q.view(batch, args.q_len, heads, DV + DR)
                line = []
                for factor in (0.25, 0.5, 1.0, 2.0):
                    tokens = int(args.q_len * heads * factor)
                    tile, splits = flashmla.get_mla_metadata_dense_fp8(
                        point.local_lens, tokens, 1)

                    def call(tile=tile, splits=splits):
                        return flashmla.flash_mla_with_kvcache_fp8(
                            q=q, k_cache=point.caches[0].unsqueeze(-2),
                            block_table=point.table, cache_seqlens=point.local_lens,
                            head_dim_v=DV, tile_scheduler_metadata=tile,
                            num_splits=splits, softmax_scale=point.scale, causal=False,
                            descale_q=point.layer._q_scale,
                            descale_k=point.layer._k_scale)
                    try:
                        ref = call()[0].float()
                        us = time_ms(call, rep=REP) * 1e3
                    except Exception as error:  # noqa: BLE001 - report it
                        print(f"  x{factor}: {type(error).__name__}: {str(error)[:200]}")
                        torch.cuda.synchronize()
                        continue
                    if factor == 1.0:
                        base = ref
                    line.append((factor, tile.shape[0], us, ref))
                cells = []
                for factor, parts, us, out in line:
                    err = (out - base).abs().max().item()
                    cells.append(f"x{factor} {parts}p {us:6.1f} (err {err:.1e})")
                    rows.append(dict(part="fp8parts", heads=heads, batch=batch, local=local,
                                     factor=factor, parts=parts, us=round(us, 2),
                                     max_err_vs_default=err))
                print(f"{heads:4} B{batch} {local // 1024}K: " + "  ".join(cells), flush=True)
                del point
                torch.cuda.empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", nargs="+",
                    default=["profile", "finish", "vsplit", "fp8parts"])
    ap.add_argument("--heads", type=int, nargs="+", default=[96, 128])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--local", type=int, nargs="+", default=[16384, 32768, 65536])
    ap.add_argument("--profile-batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--profile-local", type=int, nargs="+", default=[32768])
    ap.add_argument("--q-len", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=1,
                    help="finish: timings per path, interleaved; the median is kept")
    ap.add_argument("--column-blocks", type=int, nargs="*", default=[],
                    help="finish: also time the launch cut into these Dv blocks")
    ap.add_argument("--out-dir", default=".")
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name(0)}", flush=True)
    gen = torch.Generator("cuda").manual_seed(0)
    parts = {"profile": profile_part, "finish": finish_part, "vsplit": vsplit_part,
             "fp8parts": fp8parts_part}
    run_parts({name: functools.partial(part, args, gen) for name, part in parts.items()},
              args.parts, f"{args.out_dir}/flashmla_latency.csv")


if __name__ == "__main__":
    main()
