# SPDX-License-Identifier: Apache-2.0
"""Per-forward DCP decode metadata build time.

Variants (all CUDA-graph replays, causal verify, persistent output buffers):
  triton    build_flat_decode_triton: one fused launch per forward.
  torch     build_flat_decode (torch ops) once per forward.
  upstream  the per-layer pattern: every MLA layer re-expands the batch
            (repeat_interleave of the block table and lengths, local bounds,
            empty mask); timed as L consecutive expansions for L = 24 and 61.
For reference it also times one layer of the backend's sm90 decode (FlashInfer
FA3 prefix segments + Triton tails) at batch 64, ctx 32K (per rank, W = 8 and
W = 1) when flashinfer imports, and reports the metadata build as a fraction
of it.

Example: python -m benchmarks.metadata --out-dir benchmarks/results
"""

from __future__ import annotations

import argparse
import itertools
import math
import os

import torch
from tqdm import tqdm

from benchmarks._common import (environment, print_table, random_paged_tables,
                                time_ms, write_csv)
from vllm.v1.attention.ops.dcp_decode import (
    DCPLayout, alloc_flat_decode, build_flat_decode)
from vllm.v1.attention.ops.triton_dcp_metadata import build_flat_decode_triton


def upstream_expand(seq_lens, qsl, block_table, *, world_size, rank,
                    interleave, num_rows):
    """One layer's worth of re-expansion, as upstream does per layer call."""
    q_lens = qsl[1:] - qsl[:-1]
    reqs = torch.arange(seq_lens.shape[0], device=seq_lens.device)
    table = torch.repeat_interleave(block_table, q_lens, dim=0,
                                    output_size=num_rows)
    req = torch.repeat_interleave(reqs, q_lens, output_size=num_rows)
    pos = torch.arange(num_rows, device=seq_lens.device) - qsl[req]
    bound = seq_lens[req] - q_lens[req] + 1 + pos
    local = DCPLayout(world_size, rank, interleave).local_seq_lens(bound)
    empty = local == 0
    return table, local, empty


def layer_decode_ms(batch, ctx, heads, world, q_len, page=64):
    """One layer of the backend's sm90 decode (FA3 prefix segments + Triton
    tails, causal) on rank 0's local KV, CUDA-graph replay."""
    from tests.support.fa3_native import (FlashInferSm90MLAGraphed,
                                          plan_prefix_tail_from_rows)
    gen = torch.Generator().manual_seed(0)
    local = int(DCPLayout(world).local_seq_lens(torch.tensor(ctx)))
    cols = -(-local // page)
    pool = batch * cols + 1
    cache = torch.randn(pool, page, 576, device="cuda", dtype=torch.bfloat16)
    table = random_paged_tables(batch, torch.full((batch,), local), page, pool,
                                gen).cuda()
    seq = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * q_len
    flat = build_flat_decode_triton(seq, qsl, table, layout=DCPLayout(world),
                                    causal=True, num_rows=batch * q_len)
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    mla = FlashInferSm90MLAGraphed(ws, num_heads=heads, page_size=page,
                                   sm_scale=1 / math.sqrt(192), max_rows=batch * q_len,
                                   max_cols=table.shape[1])
    plan_prefix_tail_from_rows(mla, flat, qsl)
    q = torch.randn(batch * q_len, heads, 576, device="cuda",
                    dtype=torch.bfloat16)
    out = q.new_empty(batch * q_len, heads, 512)
    lse = torch.empty(batch * q_len, heads, device="cuda")
    ms = time_ms(lambda: mla.run(q, cache, out=out, lse=lse))
    del cache
    return ms


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64, 256, 512])
    ap.add_argument("--q-len", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--world", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--ctx", type=int, default=32768,
                    help="global context (sets the block-table width)")
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--layers", type=int, nargs="+", default=[24, 61])
    ap.add_argument("--out-dir", default="benchmarks/results")
    args = ap.parse_args()
    env = environment()
    print(env)
    rows = []
    grid = list(itertools.product(args.batch, args.q_len, args.world))
    for batch, q_len, world in tqdm(grid, desc="metadata"):
        gen = torch.Generator().manual_seed(batch * 100 + q_len * 10 + world)
        cols = -(-args.ctx // (world * args.page))
        seq = torch.randint(args.ctx // 2, args.ctx + 1, (batch,),
                            generator=gen).int().cuda()
        qsl = (torch.arange(batch + 1) * q_len).int().cuda()
        table = torch.randint(1, 1 << 20, (batch, cols), generator=gen).int().cuda()
        n = batch * q_len
        kw = dict(layout=DCPLayout(world, world - 1, 1))
        out_t = alloc_flat_decode(n, cols, "cuda")
        out_p = alloc_flat_decode(n, cols, "cuda")
        t_triton = time_ms(lambda: build_flat_decode_triton(
            seq, qsl, table, **kw, causal=True, num_rows=n, out=out_t))
        t_torch = time_ms(lambda: build_flat_decode(
            seq, qsl, table, **kw, causal=True, num_rows=n, out=out_p))
        # Sanity: both produced the same rows.
        assert torch.equal(out_t.seq_lens, out_p.seq_lens)
        assert torch.equal(out_t.block_table, out_p.block_table)
        row = dict(batch=batch, q_len=q_len, W=world, cols=cols, rows=n,
                   triton_us=t_triton * 1e3, torch_us=t_torch * 1e3)
        for layers in args.layers:
            def per_layer(layers=layers):
                for _ in range(layers):
                    upstream_expand(seq, qsl, table, **kw, num_rows=n)
            row[f"upstream_x{layers}_us"] = time_ms(per_layer) * 1e3
            row[f"ratio_x{layers}"] = row[f"upstream_x{layers}_us"] / row["triton_us"]
        row["torch_over_triton"] = t_torch / t_triton
        rows.append(row)
    os.makedirs(args.out_dir, exist_ok=True)
    write_csv(os.path.join(args.out_dir, "metadata.csv"), rows)
    cols = ["batch", "q_len", "W", "rows", "triton_us", "torch_us",
            "torch_over_triton"] + [c for L in args.layers
                                    for c in (f"upstream_x{L}_us", f"ratio_x{L}")]
    print_table(rows, cols)

    # Fraction of one MLA layer's decode at batch 64, ctx 32K.
    layer_rows = []
    try:
        for heads, world in itertools.product([16, 96], [8, 1]):
            meta = next((r for r in rows if r["batch"] == 64 and r["q_len"] == 4
                         and r["W"] == world), None)
            ms = layer_decode_ms(64, 32768, heads, world, 4, page=args.page)
            build = meta["triton_us"]
            layer_rows.append(dict(heads=heads, W=world, layer_us=ms * 1e3,
                                   build_us=build,
                                   pct_of_layer=100 * build / (ms * 1e3)))
        print("\nmetadata build (batch 64, q_len 4) vs one layer decode (ctx 32K, rank 0):")
        print_table(layer_rows, ["heads", "W", "layer_us", "build_us",
                                 "pct_of_layer"])
        write_csv(os.path.join(args.out_dir, "metadata_vs_layer.csv"), layer_rows)
    except Exception as e:  # noqa: BLE001 - no flashinfer / no GPU
        print(f"(no flashinfer: skipping the layer reference: {e})")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(args.q_len), figsize=(5 * len(args.q_len), 4),
                             sharey=True)
    for ax, q_len in zip(list(axes), args.q_len):
        for world, style in zip(args.world, ["-", "--", "-.", ":"]):
            sel = [r for r in rows if r["q_len"] == q_len and r["W"] == world]
            b = [r["batch"] for r in sel]
            ax.plot(b, [r["triton_us"] for r in sel], "o" + style, color="C0",
                    label=f"triton W={world}")
            ax.plot(b, [r["torch_us"] for r in sel], "s" + style, color="C1",
                    label=f"torch W={world}")
            ax.plot(b, [r[f"upstream_x{args.layers[0]}_us"] for r in sel],
                    "^" + style, color="C2",
                    label=f"upstream x{args.layers[0]} W={world}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"q_len {q_len}")
        ax.set_xlabel("batch")
    axes[0].set_ylabel("us per forward (CUDA-graph replay)")
    axes[0].legend(fontsize=6)
    fig.suptitle(f"DCP decode metadata build, {env['device']}")
    fig.tight_layout()
    fig.savefig(os.path.join(args.out_dir, "metadata.png"), dpi=110)


if __name__ == "__main__":
    main()
