# SPDX-License-Identifier: Apache-2.0
"""Local math of the DCP combine, per rank, in vLLM's two layouts (one GPU).

Every one of W ranks holds a partial output ``out_r [N, H, Dv]`` (bf16) and
its LSE ``lse_r [N, H]`` (float32, natural log) over its KV shard, for the H
heads it computed (rank-local shapes: vLLM gathers the queries of the DCP
group, so H is every head the rank attends with). The collectives are not
timed; the math each rank does around them is:

  ag_rs  (vLLM's default): all-gather the LSEs into ``[W, N, H]``, rescale
         the rank's own output by ``exp(lse_r - logsumexp_w lse_w)`` (0 where
         no rank has KV), reduce-scatter the rescaled outputs over heads (a
         sum; each rank keeps H / W heads). Timed: the rescale, as one fused
         Triton kernel (written here, as vLLM fuses it) and in torch; and the
         sum of W rescaled ``[N, H / W, Dv]`` slices, the arithmetic the
         reduce-scatter does inside NCCL (an upper bound of what it adds).
  a2a    an all-to-all gives each rank every rank's partial of its H / W
         heads; the rank merges W partials: ``dcp_decode.merge_partials``
         (torch).

Both are checked against ``merge_partials`` over all H heads (the rescaled
outputs summed over ranks). Also reported against one layer of the sm90
decode (FA3 prefix + tails, batch 64, ctx 32K, W = 8, rank 0) when
flashinfer imports.

    python -m benchmarks.combine --out-dir DIR     # DIR/combine.csv
"""

from __future__ import annotations

import argparse
import itertools
import os

import torch
import triton
import triton.language as tl

from benchmarks._common import environment, print_table, time_ms, write_csv
from vllm.v1.attention.ops.dcp_decode import merge_partials

DV = 512


@triton.jit
def _rescale_by_gathered_lse_kernel(
    out_ptr, lses_ptr, dst_ptr, lse_total_ptr, rank, num_ranks, lse_rank_stride,
    num_row_heads, DV: tl.constexpr, BLOCK: tl.constexpr, MAX_W: tl.constexpr,
):
    """Program = BLOCK (row, head) pairs of one rank's output."""
    rh = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    rh_ok = rh < num_row_heads
    ranks = tl.arange(0, MAX_W)
    lses = tl.load(lses_ptr + ranks[:, None] * lse_rank_stride + rh[None, :],
                   mask=(ranks < num_ranks)[:, None] & rh_ok[None, :],
                   other=float("-inf"))
    # NaN and +inf mark an empty partial, as in merge_partials.
    lses = tl.where((lses != lses) | (lses == float("inf")), float("-inf"), lses)
    lse_max = tl.max(lses, axis=0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    total = tl.sum(tl.exp(lses - lse_max[None, :]), axis=0)
    lse_total = tl.where(total > 0, lse_max + tl.log(total), float("-inf"))
    own = tl.load(lses_ptr + rank * lse_rank_stride + rh, mask=rh_ok,
                  other=float("-inf"))
    own_ok = (own == own) & (own != float("inf")) & (total > 0)
    factor = tl.where(own_ok, tl.exp(own - lse_total), 0.0)
    cols = tl.arange(0, DV)
    offs = rh.to(tl.int64)[:, None] * DV + cols[None, :]
    part = tl.load(out_ptr + offs, mask=rh_ok[:, None], other=0.0).to(tl.float32)
    tl.store(dst_ptr + offs, (part * factor[:, None]).to(dst_ptr.dtype.element_ty),
             mask=rh_ok[:, None])
    tl.store(lse_total_ptr + rh, lse_total, mask=rh_ok)


def rescale_triton(out: torch.Tensor, lses: torch.Tensor, rank: int):
    """ag_rs local step, fused: ``out [N, H, Dv]`` of ``rank`` rescaled by
    the gathered ``lses [W, N, H]``; returns (rescaled [N, H, Dv] in out's
    dtype, lse_total [N, H] float32)."""
    world, rows, heads = lses.shape
    dst = torch.empty_like(out)
    lse_total = torch.empty(rows, heads, dtype=torch.float32, device=out.device)
    block = 8
    n = rows * heads
    _rescale_by_gathered_lse_kernel[(triton.cdiv(n, block),)](
        out, lses, dst, lse_total, rank, world, lses.stride(0), n,
        DV=out.shape[-1], BLOCK=block, MAX_W=triton.next_power_of_2(max(world, 2)))
    return dst, lse_total


def rescale_torch(out: torch.Tensor, lses: torch.Tensor, rank: int):
    """The same math in torch ops."""
    lses = torch.where(torch.isfinite(lses), lses, float("-inf"))
    lse_total = torch.logsumexp(lses, dim=0)
    factor = torch.exp(lses[rank] - lse_total).nan_to_num_(0.0)
    return (out.float() * factor[..., None]).to(out.dtype), lse_total


def random_partials(world, rows, heads, gen):
    """W partials as the backend leaves them: empty ones out 0, lse -inf."""
    outs = torch.randn(world, rows, heads, DV, generator=gen).to(torch.bfloat16)
    lses = torch.randn(world, rows, heads, generator=gen) * 3
    empty = torch.rand(world, rows, generator=gen) < 0.2
    empty[:, : max(rows // 8, 1)] = True  # rows without KV on any rank
    lses[empty] = float("-inf")
    outs[empty] = 0
    return outs.cuda(), lses.cuda()


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--q-len", type=int, default=4)
    ap.add_argument("--heads", type=int, nargs="+", default=[16, 96],
                    help="heads each rank attends with (rank-local)")
    ap.add_argument("--world", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--out-dir", default="benchmarks/results")
    args = ap.parse_args()
    for heads, world in itertools.product(args.heads, args.world):
        if heads % world:
            ap.error(f"--heads {heads} is not a multiple of --world {world}: "
                     f"the reduce-scatter / all-to-all splits heads evenly")
    print(environment())
    layer_us = {}
    try:
        from benchmarks.metadata import layer_decode_ms
        for heads in args.heads:
            layer_us[heads] = layer_decode_ms(64, 32768, heads, 8, args.q_len) * 1e3
    except Exception as e:  # noqa: BLE001 - no flashinfer
        print(f"(no layer reference: {type(e).__name__}: {e})")
    rows_out = []
    for batch, heads, world in itertools.product(args.batch, args.heads,
                                                 args.world):
        n = batch * args.q_len
        gen = torch.Generator().manual_seed(batch * 1000 + heads * 10 + world)
        outs, lses = random_partials(world, n, heads, gen)
        ref_out, ref_lse = merge_partials(outs, lses)
        # ag_rs: every rank rescales its own output; the sum is the merge.
        rescaled = [rescale_triton(outs[r], lses, r) for r in range(world)]
        summed = torch.stack([o.float() for o, _ in rescaled]).sum(0)
        t_out, _ = rescale_torch(outs[0], lses, 0)
        fin = torch.isfinite(ref_lse)
        assert torch.equal(fin, torch.isfinite(rescaled[0][1]))
        lse_err = (rescaled[0][1][fin] - ref_lse[fin]).abs().max().item()
        # bf16 outputs: each rescaled partial is rounded before the sum.
        close = dict(atol=2e-2, rtol=2e-2)
        assert torch.allclose(summed, ref_out.float(), **close)
        assert torch.allclose(t_out.float(), rescaled[0][0].float(), **close)
        assert lse_err < 1e-4, lse_err
        agrs_err = (summed - ref_out.float()).abs().max().item()
        own, rank_heads = outs[0].contiguous(), heads // world
        stacked = torch.stack([o for o, _ in rescaled])[:, :, :rank_heads].contiguous()
        # a2a: the rank's H / W heads of every partial.
        outs_a2a = outs[:, :, :rank_heads].contiguous()
        lses_a2a = lses[:, :, :rank_heads].contiguous()
        a2a_out, _ = merge_partials(outs_a2a, lses_a2a)
        assert torch.allclose(a2a_out.float(), ref_out[:, :rank_heads].float(),
                              **close)
        row = dict(
            batch=batch, rows=n, heads=heads, W=world, rank_heads=rank_heads,
            agrs_rescale_triton_us=time_ms(lambda: rescale_triton(own, lses, 0)) * 1e3,
            agrs_rescale_torch_us=time_ms(lambda: rescale_torch(own, lses, 0)) * 1e3,
            agrs_rs_sum_us=time_ms(lambda: stacked.sum(0)) * 1e3,
            a2a_merge_torch_us=time_ms(lambda: merge_partials(outs_a2a, lses_a2a)) * 1e3,
            agrs_max_err=agrs_err)
        row["agrs_triton_total_us"] = (row["agrs_rescale_triton_us"]
                                       + row["agrs_rs_sum_us"])
        row["agrs_torch_total_us"] = (row["agrs_rescale_torch_us"]
                                      + row["agrs_rs_sum_us"])
        if heads in layer_us:
            row["layer_us_b64_ctx32k_W8"] = layer_us[heads]
            for key in ("agrs_triton_total_us", "agrs_torch_total_us",
                        "a2a_merge_torch_us"):
                row[key.replace("_us", "_pct_of_layer")] = (
                    100 * row[key] / layer_us[heads])
        rows_out.append(row)
        del outs, lses, rescaled, stacked, outs_a2a, lses_a2a
    os.makedirs(args.out_dir, exist_ok=True)
    write_csv(os.path.join(args.out_dir, "combine.csv"), rows_out)
    print_table(rows_out, ["batch", "heads", "W", "rank_heads",
                           "agrs_rescale_triton_us", "agrs_rescale_torch_us",
                           "agrs_rs_sum_us", "a2a_merge_torch_us",
                           "agrs_triton_total_pct_of_layer",
                           "a2a_merge_torch_pct_of_layer"])


if __name__ == "__main__":
    main()
