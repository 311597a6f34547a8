# SPDX-License-Identifier: Apache-2.0
"""W DCP ranks simulated in one process: simulation and tests only.

A random paged MLA latent cache (the input every simulation, test and device
check starts from) and the one loop that shards it by vLLM's DCP layout, runs
each rank's decode and merges the partial results by LSE. Pure torch over the
ops layer (``vllm/v1/attention/ops/dcp_decode.py``).

Shapes: R requests, B blocks per request, N decode rows, H heads, D latent
width (kv_lora_rank + rope dim), Dv kv_lora_rank, W DCP ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from vllm.v1.attention.ops.dcp_decode import DCPLayout, merge_partials

__all__ = ["PagedKV", "decode_on_simulated_ranks", "random_paged_kv",
           "shard_paged_kv"]

# Kimi-K3 / DeepSeek-V3 MLA latent row: kv_lora_rank 512 + rope 64.
MLA_LATENT_WIDTH = 576

# the layout seen from one rank, its local kv_cache [M, block_size, D], local
# block_table int32 [R, B'] -> (out [N, H, Dv], lse [N, H] float32).
RankDecode = Callable[[DCPLayout, torch.Tensor, torch.Tensor],
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


def shard_paged_kv(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    layout: DCPLayout,
    null_fill: float = float("nan"),
    generator: torch.Generator | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Split a global paged latent cache into each DCP rank's local cache.

    Simulates vLLM's DCP layout so that W ranks can run in one process. Each
    rank gets its own paged cache with the same block size; block 0 is the
    null block (filled with ``null_fill``, never referenced below a row's
    length); local blocks are numbered in a shuffled order so that a kernel
    relying on contiguous ids fails.

    Args:
        kv_cache: [num_blocks, block_size, D] global cache.
        block_table: int [R, B] global block tables.
        seq_lens: int [R] global lengths.
        layout: the DCP split (W and I; every rank is made, whatever
            ``layout.rank``).
        null_fill: value written in the null block and in unused slots.
        generator: for the block-id shuffle.

    Returns:
        One ``(local_cache [M, block_size, D], local_block_table int32 [R, B'])``
        per rank; unused table entries are 0 (the null block).
    """
    num_reqs = seq_lens.shape[0]
    block_size, width = kv_cache.shape[1], kv_cache.shape[2]
    seq_lens = seq_lens.long()
    shards = []
    interleave = layout.interleave
    for rank_layout in layout.ranks():
        rank = rank_layout.rank
        local_lens = rank_layout.local_seq_lens(seq_lens)
        blocks_per_req = (local_lens + block_size - 1) // block_size
        max_blocks = max(int(blocks_per_req.max()) if num_reqs else 0, 1)
        num_local = int(blocks_per_req.sum())
        ids = torch.randperm(num_local, generator=generator) + 1
        table = torch.zeros(num_reqs, max_blocks, dtype=torch.int32)
        col = torch.arange(max_blocks)
        used = col[None, :] < blocks_per_req[:, None]
        table[used] = ids.to(torch.int32)
        cache = kv_cache.new_full((num_local + 1, block_size, width), null_fill)

        # Local slot j of a request holds global position p(j).
        req_of = torch.repeat_interleave(torch.arange(num_reqs), local_lens)
        starts = torch.cumsum(local_lens, 0) - local_lens
        j = torch.arange(int(local_lens.sum())) - starts[req_of]
        p = (j // interleave) * layout.span + rank * interleave + j % interleave
        src = kv_cache[block_table[req_of, p // block_size].long(), p % block_size]
        cache[table[req_of, j // block_size].long(), j % block_size] = src
        shards.append((cache.to(kv_cache.device), table.to(block_table.device)))
    return shards


def decode_on_simulated_ranks(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    decode_rank: RankDecode,
    *,
    layout: DCPLayout,
    generator: torch.Generator | None = None,
    merge: Merge = merge_partials,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Shard a global paged cache over W ranks, decode on each, merge.

    Args:
        kv_cache, block_table, seq_lens: the global cache
            ([num_blocks, block_size, D]), int [R, B] tables and int [R]
            lengths, as ``random_paged_kv`` returns them.
        decode_rank: ``decode_rank(rank_layout, local_cache, local_block_table)``
            (``rank_layout``: ``layout`` seen from that rank) returns its partial ``(out [N, H, Dv], lse [N, H])``;
            the local table is int32 [R, B'] of shuffled local block ids.
        layout: the DCP split (W, I; its rank is ignored).
        generator: for the local block-id shuffle (``shard_paged_kv``).
        merge: combines the stacked partials; ``merge_partials`` (natural-log
            LSE) by default, or e.g. a backend's own combine.

    Returns:
        ``merge``'s ``(out [N, H, Dv], lse [N, H])``.
    """
    shards = shard_paged_kv(kv_cache, block_table, seq_lens, layout=layout,
                            generator=generator)
    partials = [decode_rank(rank_layout, local_cache, local_table)
                for rank_layout, (local_cache, local_table)
                in zip(layout.ranks(), shards)]
    outs, lses = zip(*partials)
    return merge(torch.stack(outs), torch.stack(lses))
