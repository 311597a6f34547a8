# SPDX-License-Identifier: Apache-2.0
"""W DCP ranks simulated in one process: simulation and tests only.

A random paged MLA latent cache (the input every simulation, test and device
check starts from) and the one loop that shards it by vLLM's DCP layout, runs
each rank's decode and merges the partial results by LSE. Pure torch, like the
rest of the ops layer.

Shapes: R requests, B blocks per request, N decode rows, H heads, D latent
width (kv_lora_rank + rope dim), Dv kv_lora_rank, W DCP ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from vllm.v1.attention.ops.dcp_decode import merge_partials, shard_paged_kv

__all__ = ["PagedKV", "decode_on_simulated_ranks", "random_paged_kv"]

# Kimi-K3 / DeepSeek-V3 MLA latent row: kv_lora_rank 512 + rope 64.
MLA_LATENT_WIDTH = 576

# rank, local kv_cache [M, block_size, D], local block_table int32 [R, B']
# -> (out [N, H, Dv], lse [N, H] float32).
RankDecode = Callable[[int, torch.Tensor, torch.Tensor],
                      tuple[torch.Tensor, torch.Tensor]]
# (outs [W, N, H, Dv], lses [W, N, H]) -> (out [N, H, Dv], lse [N, H]).
Merge = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class PagedKV(NamedTuple):
    """A global paged latent cache and the requests that own its blocks.

    Attributes:
        kv_cache: float32 [1 + sum(blocks), block_size, D]; block 0 is the
            null block, filled with NaN so that reading it shows.
        block_table: int32 [R, B]; each request's blocks are distinct ids in
            shuffled order, unused entries 0 (the null block).
        seq_lens: int32 [R], tokens each request holds.
    """

    kv_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor


def random_paged_kv(
    seq_lens: Sequence[int],
    block_size: int,
    *,
    generator: torch.Generator,
    width: int = MLA_LATENT_WIDTH,
    extra_blocks: int = 0,
) -> PagedKV:
    """A standard-normal paged cache holding ``seq_lens`` tokens.

    Draws from ``generator`` the cache values first, then the block-id
    shuffle; callers that go on drawing (queries) from the same generator
    get reproducible batches.

    Args:
        seq_lens: tokens of each request (0 allowed).
        block_size: tokens per block.
        generator: CPU generator for values and block ids.
        width: D, the latent row width.
        extra_blocks: table columns beyond the longest request's blocks
            (entries 0), as a block table sized for longer sequences has.
    """
    blocks = [-(-n // block_size) for n in seq_lens]
    kv_cache = torch.randn(sum(blocks) + 1, block_size, width, generator=generator)
    kv_cache[0] = float("nan")
    ids = torch.randperm(sum(blocks), generator=generator).to(torch.int32) + 1
    block_table = torch.zeros(len(seq_lens), max(blocks + [1]) + extra_blocks,
                              dtype=torch.int32)
    start = 0
    for req, num_blocks in enumerate(blocks):
        block_table[req, :num_blocks] = ids[start:start + num_blocks]
        start += num_blocks
    return PagedKV(kv_cache, block_table, torch.tensor(seq_lens, dtype=torch.int32))


def decode_on_simulated_ranks(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    decode_rank: RankDecode,
    *,
    world_size: int,
    interleave: int,
    generator: torch.Generator | None = None,
    merge: Merge = merge_partials,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Shard a global paged cache over W ranks, decode on each, merge.

    Args:
        kv_cache, block_table, seq_lens: the global cache
            ([num_blocks, block_size, D]), int [R, B] tables and int [R]
            lengths, as ``random_paged_kv`` returns them.
        decode_rank: ``decode_rank(rank, local_cache, local_block_table)``
            returns that rank's partial ``(out [N, H, Dv], lse [N, H])``;
            the local table is int32 [R, B'] of shuffled local block ids.
        world_size, interleave: the DCP layout (W, I).
        generator: for the local block-id shuffle (``shard_paged_kv``).
        merge: combines the stacked partials; ``merge_partials`` (natural-log
            LSE) by default, or e.g. a backend's own combine.

    Returns:
        ``merge``'s ``(out [N, H, Dv], lse [N, H])``.
    """
    shards = shard_paged_kv(kv_cache, block_table, seq_lens, world_size=world_size,
                            interleave=interleave, generator=generator)
    partials = [decode_rank(rank, local_cache, local_table)
                for rank, (local_cache, local_table) in enumerate(shards)]
    outs, lses = zip(*partials)
    return merge(torch.stack(outs), torch.stack(lses))
