# SPDX-License-Identifier: Apache-2.0
"""FA3 with its plan made on the device, for a lone request per rank (issue 40).

``flashinfer_sm90_device_plan.FlashInferSm90DevicePlan``: FlashInfer's FA3 MLA
planned once on the host for a template, its key ranges rewritten per forward
by one launch, then the tails (``mla_tail_merge``). Rank 0 of W 8, interleave
1, q_len 4, bf16, as ``benchmarks/flashmla_rows.py``'s points.

``record``: FlashInfer's template plan and its own host plans at several
prefix lengths L (R = 1, 96 / 128 heads), the device plan's works at each L
against the host plan's (non-empty works equal as sets); written to
``OUT/fa3_plans_h100.json`` (the CPU tests' ``tests/data`` record).

``check``: per heads x verify / draft, one plan + run captured as a CUDA
graph at L = 16K, replayed after the rows' lengths change (16K, 17K, 40K,
100, 3 local keys): replay equal to the eager run bitwise, each row against
float32 attention over its keys, and against the host-plan FA3 path
(``FlashInferSm90MLA``) on the same rows.

``layer``: per layer, CUDA-graph replay median of ``--repeats`` interleaved
timings, us: FlashMLA alone, the FLASHMLA DCP rows, FA3 host plan + tails,
FA3 device plan + tails (run only; the plan launch, once per forward, timed
on its own as ``plan``).

``step``: 61 layers as one graph at batch 1 x 256K: W 1 (FlashMLA alone
over 256K) against W 8 (FA3 device plan: one plan, then 61 layers over a
rank's 32K keys) and the FLASHMLA rows (W 8), layers cycling over distinct
caches.

    python3 -m benchmarks.fa3_device_plan --out-dir DIR [--parts record check layer step]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics

import torch

from benchmarks._common import run_parts, time_ms
from benchmarks.flashmla_rows import DV, DR, PAGE, WORLD, Point, roofline_us
from vllm.v1.attention.ops import flashinfer_sm90_device_plan as dp
from vllm.v1.attention.ops.dcp_decode import DCPLayout
from vllm.v1.attention.ops.triton_dcp_metadata import build_flat_decode_triton

Q_LEN = 4


def device_plan(point: Point, *, causal: bool) -> dp.FlashInferSm90DevicePlan:
    ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    mla = dp.FlashInferSm90DevicePlan(
        ws, num_reqs=point.batch, q_len=point.q_len, num_heads=point.heads,
        page_size=PAGE, sm_scale=point.scale, max_cols=point.table.shape[1],
        has_tails=causal)
    mla.plan(point.flat.seq_lens, point.table, point.flat.block_table)
    return mla


def host_plan_arrays(mla: dp.FlashInferSm90DevicePlan, kv_len: int) -> dict:
    """FlashInfer's own host plan of the device plan's requests at ``kv_len``."""
    from flashinfer.mla import BatchMLAPagedAttentionWrapper

    from vllm.v1.attention.ops.flashinfer_sm90_mla import plan_fa3_csr

    ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    wrapper = BatchMLAPagedAttentionWrapper(ws, backend="fa3")
    reqs = torch.arange(mla.num_reqs + 1, dtype=torch.int32)
    plan_fa3_csr(wrapper, mla, reqs * mla.q_len, reqs * -(-kv_len // PAGE), mla.kv_indices,
                 torch.full((mla.num_reqs,), kv_len, dtype=torch.int32), causal=False)
    torch.cuda.synchronize()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    return dp.read_plan_arrays(wrapper._plan_info,
                               wrapper._pin_memory_int_workspace_buffer, num_sms)


def nonempty_works(arrays: dict) -> list[tuple]:
    n = len(arrays["q_indptr"])
    return sorted({(arrays["q_indptr"][w], arrays["q_start"][w], arrays["kv_start"][w],
                    arrays["kv_end"][w]) for w in range(n)
                   if arrays["kv_end"][w] > arrays["kv_start"][w]})


def device_works(mla: dp.FlashInferSm90DevicePlan) -> dict:
    arrays = dict(mla.template_arrays)
    arrays.update({k: v.tolist() for k, v in mla.work_arrays().items()})
    return arrays


def _point(heads, local, causal, gen, copies=1, batch=1):
    return Point(batch, local, Q_LEN, heads, causal, False, WORLD, gen, copies=copies)


def record_part(args, gen):
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    record = dict(device=torch.cuda.get_device_name(0), num_sms=num_sms, cases=[])
    rows = []
    for heads in args.heads:
        point = _point(heads, 65536, False, gen)
        mla = device_plan(point, causal=False)
        case = dict(num_reqs=1, q_len=Q_LEN, num_heads=heads, page_stride=mla.page_stride,
                    template_kv_len=mla.template_kv_len,
                    template={k: v for k, v in mla.template_arrays.items()},
                    host_plans=[])
        for kv_len in (0, 1, 100, 1000, 2048, 5000, 16384, 17408, 32768, 40960, 65536):
            host = host_plan_arrays(mla, kv_len)
            lens = torch.full((Q_LEN,), kv_len, dtype=torch.int32, device="cuda")
            mla.plan(lens, point.table, point.flat.block_table)
            torch.cuda.synchronize()
            ours, theirs = nonempty_works(device_works(mla)), nonempty_works(host)
            same = ours == theirs
            print(f"record H={heads} L={kv_len}: FlashInfer {len(host['q_indptr'])} works "
                  f"({len(theirs)} with keys), device {mla.template.num_works} works "
                  f"({len(ours)} with keys): key ranges "
                  f"{'equal' if same else 'DIFFER'}", flush=True)
            case["host_plans"].append(dict(kv_len=kv_len, arrays=host))
            rows.append(dict(part="record", heads=heads, kv_len=kv_len,
                             host_works=len(host["q_indptr"]), works_equal=same))
        record["cases"].append(case)
        del point
    with open(f"{args.out_dir}/fa3_plans_h100.json", "w") as f:
        json.dump(record, f)
    return rows


def dense_f32(q, cache, row_table, row_lens, scale):
    """float32 attention of each row over its local keys: (out, lse natural)."""
    outs, lses = [], []
    for t in range(q.shape[0]):
        n = int(row_lens[t])
        pages = row_table[t, :-(-n // PAGE)].long()
        keys = cache[pages].reshape(-1, DV + DR)[:n].float()
        scores = q[t].float() @ keys.T * scale
        if n == 0:
            outs.append(torch.zeros(q.shape[1], DV, device=q.device))
            lses.append(torch.full((q.shape[1],), -math.inf, device=q.device))
            continue
        lses.append(torch.logsumexp(scores, -1))
        outs.append(torch.softmax(scores, -1) @ keys[:, :DV])
    return torch.stack(outs), torch.stack(lses)


def check_part(args, gen):
    from tests.support.fa3_native import FlashInferSm90MLAGraphed

    rows = []
    # (local keys, extra global tokens): the global length local x W + extra
    # gives a verify block's rows bounds 0 or 1 key apart (tails of 0-1 key).
    sequence = ((16384, 0), (17408, 1), (40960, 3), (100, 1), (3, 2))
    for heads in args.heads:
        for causal in (True, False):
            point = _point(heads, max(sequence)[0] + 1, causal, gen)
            table, qsl, layout = point.table, point.qsl, DCPLayout(WORLD, 0, 1)
            row_lens = torch.zeros(Q_LEN, dtype=torch.int32, device="cuda")
            row_table = torch.zeros_like(point.flat.block_table)

            def set_rows(local, extra):
                flat = build_flat_decode_triton(
                    torch.tensor([local * WORLD + extra], dtype=torch.int32,
                                 device="cuda"),
                    qsl, table, layout=layout, causal=causal, num_rows=Q_LEN)
                row_lens.copy_(flat.seq_lens)
                row_table.copy_(flat.block_table)
                return flat

            set_rows(*sequence[0])
            ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
            mla = dp.FlashInferSm90DevicePlan(
                ws, num_reqs=1, q_len=Q_LEN, num_heads=heads, page_size=PAGE,
                sm_scale=point.scale, max_cols=table.shape[1], has_tails=causal)
            out = torch.empty(Q_LEN, heads, DV, dtype=torch.bfloat16, device="cuda")
            lse = torch.empty(Q_LEN, heads, dtype=torch.float32, device="cuda")

            def forward():
                mla.plan(row_lens, table, row_table)
                mla.run(point.q, point.caches[0], out=out, lse=lse)

            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                forward()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                forward()
            host = FlashInferSm90MLAGraphed(
                torch.empty(128 << 20, dtype=torch.uint8, device="cuda"), num_heads=heads,
                page_size=PAGE, sm_scale=point.scale, max_rows=Q_LEN,
                max_cols=table.shape[1])
            for local, extra in sequence:
                flat = set_rows(local, extra)
                out.fill_(float("nan"))
                lse.fill_(float("nan"))
                forward()
                eager = out.clone(), lse.clone()
                out.fill_(float("nan"))
                lse.fill_(float("nan"))
                graph.replay()
                torch.cuda.synchronize()
                bitwise = torch.equal(eager[0], out) and torch.equal(eager[1], lse)
                ref_out, ref_lse = dense_f32(point.q, point.caches[0], row_table, row_lens,
                                             point.scale)
                err_out = (out.float() - ref_out).abs().max().item()
                finite = torch.isfinite(ref_lse)
                err_lse = ((lse - ref_lse)[finite].abs().max().item()
                           if finite.any() else 0.0)
                lse_inf_ok = bool((lse[~finite] == -math.inf).all())
                host.plan_rows(qsl.cpu(), torch.tensor([local * WORLD + extra]), table, flat,
                               num_rows=Q_LEN, causal=causal, slack=0, layout=layout)
                h_out, h_lse = host.run(point.q, point.caches[0])
                d_host = (h_out.float() - out.float()).abs().max().item()
                prefix = int(row_lens[0])
                works_equal = (nonempty_works(device_works(mla))
                               == nonempty_works(host_plan_arrays(mla, prefix)))
                ok = (bitwise and err_out < 2e-2 and err_lse < 1e-3 and lse_inf_ok
                      and works_equal and not torch.isnan(out).any())
                print(f"check H={heads} {'verify' if causal else 'draft'} local={local}: "
                      f"rows {row_lens.tolist()}, graph==eager {bitwise}, out err "
                      f"{err_out:.2e}, lse err {err_lse:.2e}, |dev-host| {d_host:.2e}, "
                      f"works==FlashInfer's {works_equal}: {'OK' if ok else 'FAIL'}",
                      flush=True)
                rows.append(dict(part="check", heads=heads, causal=causal, local=local,
                                 bitwise=bitwise, err_out=err_out, err_lse=err_lse,
                                 dev_vs_host=d_host, works_equal=works_equal, ok=ok))
            del point, graph, host, mla
            torch.cuda.empty_cache()
    bad = [r for r in rows if not r["ok"]]
    print(f"check: {len(rows) - len(bad)} of {len(rows)} OK", flush=True)
    return rows


def layer_part(args, gen):
    rows = []
    print(f"{'H':>4}{'kind':>7}{'B':>3}{'local':>7}  " + "".join(
        f"{p:>10}" for p in ("alone", "dcp", "fa3", "fa3dev", "plan"))
        + "   us (median of repeats); fa3dev/alone, fa3dev/dcp, roofline of fa3dev")
    for heads in args.heads:
        for causal in (True, False):
            for batch, local in [(b, n) for b in args.batch for n in args.local]:
                point = _point(heads, local, causal, gen, batch=batch)
                mla = device_plan(point, causal=causal)
                fns = {"alone": point.alone_fn(), "dcp": point.dcp_fn(),
                       "fa3": point.fa3_fn(),
                       "fa3dev": lambda: mla.run(point.q, point.caches[0]),
                       "plan": lambda: mla.plan(point.flat.seq_lens, point.table,
                                                point.flat.block_table)}
                times = {k: [] for k in fns}
                for _ in range(args.repeats):
                    for path, fn in fns.items():
                        times[path].append(time_ms(fn) * 1e3)
                us = {k: statistics.median(v) for k, v in times.items()}
                roof = roofline_us(batch, local, Q_LEN, heads)
                kind = "verify" if causal else "draft"
                print(f"{heads:4}{kind:>7}{batch:3}{local // 1024:6}K  "
                      + "".join(f"{v:10.1f}" for v in us.values())
                      + f"   {us['fa3dev'] / us['alone']:.3f} {us['fa3dev'] / us['dcp']:.3f}"
                      f" {roof / us['fa3dev']:.2f}", flush=True)
                rows += [dict(part="layer", heads=heads, kind=kind, batch=batch, local=local,
                              path=k, us=round(v, 2), roofline_us=round(roof, 1))
                         for k, v in us.items()]
                del point, mla, fns
                torch.cuda.empty_cache()
    return rows


def step_part(args, gen):
    rows = []
    heads, ctx = args.heads[0], 262144
    result = {}
    for label, world in (("W1 alone", 1), ("W8 fa3dev", WORLD), ("W8 dcp", WORLD)):
        local = ctx // world
        copies = max(1, min(args.layers, int(args.pool_gib * 2**30
                                              // (local * (DV + DR) * 2))))
        point = _point(heads, local, True, gen, copies=copies)
        if label == "W8 fa3dev":
            mla = device_plan(point, causal=True)

            def step(mla=mla, point=point):
                mla.plan(point.flat.seq_lens, point.table, point.flat.block_table)
                for layer in range(args.layers):
                    mla.run(point.q, point.caches[layer % copies])
        else:
            make = point.alone_fn if world == 1 else point.dcp_fn
            fns = [make(i) for i in range(copies)]

            def step(fns=fns):
                for layer in range(args.layers):
                    fns[layer % len(fns)]()
        result[label] = time_ms(step, rep=20) * 1e3
        del point, step
        torch.cuda.empty_cache()
    w1 = result["W1 alone"]
    for label in ("W8 fa3dev", "W8 dcp"):
        print(f"step H={heads} bf16 B=1 ctx=256K: W1 {w1:.0f} us, {label} "
              f"{result[label]:.0f} us, ratio {result[label] / w1:.4f}", flush=True)
        rows.append(dict(part="step", heads=heads, path=label, w1_us=round(w1, 1),
                         w8_us=round(result[label], 1),
                         ratio=round(result[label] / w1, 4)))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", nargs="+", default=["record", "check", "layer", "step"])
    ap.add_argument("--heads", type=int, nargs="+", default=[96, 128])
    ap.add_argument("--local", type=int, nargs="+", default=[16384, 32768, 65536])
    ap.add_argument("--batch", type=int, nargs="+", default=[1],
                    help="requests per rank of the layer part (the device plan's R)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--pool-gib", type=float, default=24.0)
    ap.add_argument("--out-dir", default=".")
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name(0)}, "
          f"{torch.cuda.get_device_properties(0).multi_processor_count} SMs", flush=True)
    gen = torch.Generator("cuda").manual_seed(0)
    run_parts({"record": lambda: record_part(args, gen),
               "check": lambda: check_part(args, gen),
               "layer": lambda: layer_part(args, gen),
               "step": lambda: step_part(args, gen)},
              args.parts, f"{args.out_dir}/fa3_device_plan.csv")


if __name__ == "__main__":
    main()
