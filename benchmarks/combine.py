# SPDX-License-Identifier: Apache-2.0
"""Cost of the DCP combine (LSE-weighted merge of W partial outputs).

Times ``dcp_decode.merge_partials`` (torch) and a fused Triton merge (one
pass: read W partial outputs and LSEs, write the merged output and LSE) over
rows x heads x W, all heads on one device and, as after an all-to-all over
heads, H / W heads per rank; compares with one layer's attention (FlashInfer
sm90 MLA, rank 0's local KV, grouped rows) at batch 64, ctx 32K, W = 8,
q_len 4.
Local merge only: the all-to-all / all-gather that brings the partials
together is not timed. The Triton merge is checked against merge_partials.

Example: python -m benchmarks.combine --out-dir benchmarks/results
"""

from __future__ import annotations

import argparse
import itertools
import math
import os

import torch
import triton
import triton.language as tl
from tqdm import tqdm

from benchmarks._common import environment, print_table, time_ms, write_csv
from vllm.v1.attention.ops.dcp_decode import merge_partials


@triton.jit
def _merge_kernel(outs_ptr, lses_ptr, out_ptr, lse_ptr, num_ranks, rank_stride,
                  lse_rank_stride, num_rows_heads,
                  DV: tl.constexpr, BLOCK_H: tl.constexpr, MAX_W: tl.constexpr):
    """Program = BLOCK_H (row, head) pairs; natural-log LSEs."""
    rh = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    rh_ok = rh < num_rows_heads
    w = tl.arange(0, MAX_W)
    w_ok = w < num_ranks
    lse = tl.load(lses_ptr + w[:, None] * lse_rank_stride + rh[None, :],
                  mask=w_ok[:, None] & rh_ok[None, :], other=float("-inf"))
    # NaN / +inf mark an empty partial.
    bad = (lse != lse) | (lse == float("inf"))
    lse = tl.where(bad, float("-inf"), lse)
    lse_max = tl.max(lse, axis=0)
    lse_max_safe = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weight = tl.exp(lse - lse_max_safe[None, :])  # [W, BH]
    total = tl.sum(weight, axis=0)
    scale = weight / tl.where(total > 0, total, 1.0)[None, :]
    cols = tl.arange(0, DV)
    acc = tl.zeros([BLOCK_H, DV], dtype=tl.float32)
    for r in range(num_ranks):
        s = tl.sum(tl.where(w[:, None] == r, scale, 0.0), axis=0)  # [BH]
        part = tl.load(outs_ptr + r * rank_stride + rh.to(tl.int64)[:, None] * DV
                       + cols[None, :], mask=rh_ok[:, None] & (s > 0)[:, None],
                       other=0.0)
        acc += s[:, None] * part.to(tl.float32)
    tl.store(out_ptr + rh.to(tl.int64)[:, None] * DV + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=rh_ok[:, None])
    tl.store(lse_ptr + rh, lse_max_safe + tl.log(total), mask=rh_ok)


def merge_partials_triton(outs: torch.Tensor, lses: torch.Tensor):
    """Fused merge; outs [W, N, H, Dv] contiguous, lses [W, N, H] float32."""
    world, rows, heads, dv = outs.shape
    out = outs.new_empty(rows, heads, dv)
    lse = torch.empty(rows, heads, dtype=torch.float32, device=outs.device)
    block_h = 4
    n = rows * heads
    _merge_kernel[(triton.cdiv(n, block_h),)](
        outs, lses, out, lse, world, outs.stride(0), lses.stride(0), n,
        DV=dv, BLOCK_H=block_h, MAX_W=triton.next_power_of_2(max(world, 2)))
    return out, lse


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--q-len", type=int, default=4)
    ap.add_argument("--heads", type=int, nargs="+", default=[16, 96])
    ap.add_argument("--world", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--out-dir", default="benchmarks/results")
    args = ap.parse_args()
    env = environment()
    print(env)
    rows = []
    for batch, heads, world in tqdm(list(itertools.product(
            args.batch, args.heads, args.world)), desc="combine"):
        n = batch * args.q_len
        outs = torch.randn(world, n, heads, 512, device="cuda",
                           dtype=torch.bfloat16)
        lses = torch.randn(world, n, heads, device="cuda") * 3
        lses[0, : n // 3] = float("-inf")          # some empty partials
        lses[-1, n // 2:] = float("nan")
        ref_out, ref_lse = merge_partials(outs, lses)
        got_out, got_lse = merge_partials_triton(outs, lses)
        err = (got_out.float() - ref_out.float()).abs().max().item()
        fin = torch.isfinite(ref_lse)
        assert torch.equal(fin, torch.isfinite(got_lse))
        lerr = (got_lse[fin] - ref_lse[fin]).abs().max().item()
        assert err < 2e-2 and lerr < 1e-4, (err, lerr)
        t_torch = time_ms(lambda: merge_partials(outs, lses))
        t_triton = time_ms(lambda: merge_partials_triton(outs, lses))
        # After an all-to-all over heads each rank merges only H / W heads.
        per_rank = max(heads // world, 1)
        outs_r = outs[:, :, :per_rank].contiguous()
        lses_r = lses[:, :, :per_rank].contiguous()
        t_rank = time_ms(lambda: merge_partials_triton(outs_r, lses_r))
        bytes_moved = outs.numel() * 2 + lses.numel() * 4 + n * heads * (512 * 2 + 4)
        rows.append(dict(batch=batch, rows=n, heads=heads, W=world,
                         torch_us=t_torch * 1e3, triton_us=t_triton * 1e3,
                         triton_rank_heads=per_rank,
                         triton_rank_us=t_rank * 1e3,
                         triton_TBps=bytes_moved / (t_triton * 1e-3) / 1e12,
                         max_err=err))
        del outs, lses, outs_r, lses_r
    layer = {}
    try:
        from benchmarks.metadata import layer_decode_ms
        for heads in args.heads:
            # Grouped rows: the faster (so stricter) layer reference.
            layer[heads] = layer_decode_ms(64, 32768, heads, 8, args.q_len,
                                           grouped=True) * 1e3
    except Exception as e:  # noqa: BLE001 - no flashinfer / no GPU
        print(f"(no flashinfer: no layer reference: {e})")
    for r in rows:
        if r["heads"] in layer:
            r["layer_us_b64_ctx32k_W8"] = layer[r["heads"]]
            r["torch_pct_of_layer"] = 100 * r["torch_us"] / layer[r["heads"]]
            r["triton_pct_of_layer"] = 100 * r["triton_us"] / layer[r["heads"]]
            r["triton_rank_pct_of_layer"] = (100 * r["triton_rank_us"]
                                             / layer[r["heads"]])
    os.makedirs(args.out_dir, exist_ok=True)
    write_csv(os.path.join(args.out_dir, "combine.csv"), rows)
    print_table(rows, ["batch", "rows", "heads", "W", "torch_us", "triton_us",
                       "triton_TBps", "torch_pct_of_layer", "triton_pct_of_layer",
                       "triton_rank_us", "triton_rank_pct_of_layer"])

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(args.heads), figsize=(6 * len(args.heads), 4),
                             squeeze=False)
    for ax, heads in zip(axes[0], args.heads):
        for k, world in enumerate(args.world):
            sel = [r for r in rows if r["heads"] == heads and r["W"] == world]
            ax.plot([r["batch"] for r in sel], [r["torch_us"] for r in sel],
                    "s--", color=f"C{k}", label=f"torch W={world}")
            ax.plot([r["batch"] for r in sel], [r["triton_us"] for r in sel],
                    "o-", color=f"C{k}", label=f"triton W={world}")
        if heads in layer:
            ax.axhline(layer[heads], color="k", ls=":",
                       label="1 layer attn (b64, 32K, W=8)")
            ax.axhline(0.1 * layer[heads], color="r", ls=":", label="10% target")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(f"batch (q_len {args.q_len})")
        ax.set_ylabel("us")
        ax.set_title(f"H={heads}")
        ax.legend(fontsize=6)
    fig.suptitle(f"DCP combine, {env['device']}")
    fig.tight_layout()
    fig.savefig(os.path.join(args.out_dir, "combine.png"), dpi=110)


if __name__ == "__main__":
    main()
