# SPDX-License-Identifier: Apache-2.0
"""Simulate one W-rank DCP decode step of an MLA layer in one process.

For each case (DCP size W, interleave I, causal verify or non-causal draft
block) it builds a random paged latent cache for a batch of long and short
sequences, shards it by vLLM's DCP layout, builds each rank's flattened decode
metadata, runs the reference MLA decode per rank, merges the partials by LSE
and reports the largest error against full attention without DCP.

Run ``vllm-dcp-simulate --help`` (or ``python -m tools.dcp_simulate`` from the
repository root). Pure torch. Torch and the ops layer are imported only after
the arguments are parsed and checked, so ``--help`` and bad input answer at
once (the console script's package, ``vllm_dcp_tools`` = ``tools/``, lies
outside the ``vllm`` package; see pyproject.toml).
"""

from __future__ import annotations

import argparse
import itertools
import math
import time

KV_LORA_RANK = 512
ROPE_DIM = 64


def dcp_step(q, cache, table, lens, query_start_loc, *, layout, causal, scale,
             seed=0):
    """Merged output and LSE of a simulated decode step over every rank of
    ``layout`` (a ``DCPLayout``)."""
    import torch

    from vllm.v1.attention.ops.dcp_decode import build_flat_decode, mla_decode_reference
    from .dcp_simulated_ranks import decode_on_simulated_ranks

    def decode_rank(rank_layout, local_cache, local_table):
        flat = build_flat_decode(lens, query_start_loc, local_table,
                                 layout=rank_layout, causal=causal)
        return mla_decode_reference(q, local_cache, flat.block_table, flat.seq_lens,
                                    kv_lora_rank=KV_LORA_RANK, scale=scale)

    return decode_on_simulated_ranks(
        cache, table, lens, decode_rank, layout=layout,
        generator=torch.Generator().manual_seed(seed))


def _int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is below {low}")
        return value

    parse.__name__ = f"integer >= {low}"  # argparse names the type in errors
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vllm-dcp-simulate", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    positive = _int_at_least(1)
    p.add_argument("--heads", type=positive, default=16,
                   help="query heads on a rank (Kimi-K3: 96 gathered at TP8xDCP8)")
    p.add_argument("--seq-lens", type=positive, nargs="+",
                   default=[8192, 2500, 700, 63, 9, 3],
                   help="global sequence lengths of the batch (tokens)")
    p.add_argument("--world-sizes", type=positive, nargs="+", default=[1, 2, 4, 8],
                   help="DCP sizes W to simulate (-dcp)")
    p.add_argument("--interleaves", type=positive, nargs="+", default=[1, 16, 64],
                   help="interleave sizes I (--cp-kv-cache-interleave-size); "
                        "each must divide --block-size")
    p.add_argument("--verify-len", type=positive, default=4,
                   help="causal verify block: 1 + speculative tokens")
    p.add_argument("--draft-len", type=positive, default=7,
                   help="non-causal DSpark draft block size")
    p.add_argument("--block-size", type=positive, default=64,
                   help="KV cache block size (tokens)")
    p.add_argument("--seed", type=_int_at_least(0), default=0,
                   help="seed of the random cache and queries")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    """Parse and check the arguments as vLLM checks its own (exits on error)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    bad = [i for i in args.interleaves if args.block_size % i]
    if bad:
        # vLLM refuses these at start-up (VllmConfig.validate_block_size).
        parser.error(
            f"argument --interleaves: {', '.join(map(str, bad))} "
            f"{'does' if len(bad) == 1 else 'do'} not divide --block-size "
            f"{args.block_size}; vLLM accepts only interleaves that divide the "
            "block size")
    return args


def run(args: argparse.Namespace) -> int:
    """Simulate every case of ``args``; print the table and the worst case."""
    import torch
    from tabulate import tabulate
    from tqdm import tqdm

    from vllm.v1.attention.ops.dcp_decode import (
        DCPLayout,
        build_flat_decode,
        mla_decode_reference,
    )
    from .dcp_simulated_ranks import random_paged_kv

    torch.manual_seed(args.seed)
    cache, table, lens = random_paged_kv(
        args.seq_lens, args.block_size,
        generator=torch.Generator().manual_seed(args.seed),
        width=KV_LORA_RANK + ROPE_DIM)
    scale = (128 + ROPE_DIM) ** -0.5
    modes = [("verify", True, args.verify_len), ("draft", False, args.draft_len)]
    cases = list(itertools.product(modes, args.world_sizes, args.interleaves))
    rows, worst, worst_case = [], -1.0, ""
    for (name, causal, q_len), world, inter in tqdm(cases, desc="DCP decode"):
        q_lens = torch.tensor([min(q_len, int(n)) for n in lens], dtype=torch.int32)
        qsl = torch.zeros(len(lens) + 1, dtype=torch.int32)
        qsl[1:] = torch.cumsum(q_lens, 0)
        q = torch.randn(int(qsl[-1]), args.heads, KV_LORA_RANK + ROPE_DIM)
        full = build_flat_decode(lens, qsl, table, layout=DCPLayout(),
                                 causal=causal)
        ref_out, ref_lse = mla_decode_reference(q, cache, full.block_table,
                                                full.seq_lens,
                                                kv_lora_rank=KV_LORA_RANK,
                                                scale=scale)
        t0 = time.perf_counter()
        out, lse = dcp_step(q, cache, table, lens, qsl,
                            layout=DCPLayout(world, 0, inter), causal=causal,
                            scale=scale, seed=args.seed)
        elapsed = time.perf_counter() - t0
        err_out = (out - ref_out).abs().max().item()
        err_lse = (lse - ref_lse).abs().max().item()
        err = max(err_out, err_lse)
        if math.isnan(err_out) or math.isnan(err_lse):  # max() would drop a NaN
            err = math.inf
        if err > worst:
            worst, worst_case = err, f"{name} q_len={q_len} W={world} I={inter}"
        rows.append([name, q_len, world, inter, int(qsl[-1]),
                     f"{err_out:.2e}", f"{err_lse:.2e}", f"{elapsed:.2f}"])
    print(tabulate(rows, headers=["block", "q_len", "W", "I", "rows",
                                  "max|out err|", "max|lse err|", "sec"]))
    ok = worst < 1e-4
    print(f"heads={args.heads} latent={KV_LORA_RANK}+{ROPE_DIM} "
          f"block_size={args.block_size} seq_lens={args.seq_lens}")
    print(f"worst error vs full attention without DCP: {worst:.2e} at "
          f"{worst_case} ({'OK' if ok else 'FAIL'}, fp32 tolerance 1e-4)")
    return 0 if ok else 1


def main(argv=None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
