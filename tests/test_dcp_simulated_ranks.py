# SPDX-License-Identifier: Apache-2.0
"""The simulation helpers every sharded-and-merged test starts from."""

from __future__ import annotations

import math

import pytest
import torch

from vllm.v1.attention.ops.dcp_decode import DCPLayout
from tools.dcp_simulated_ranks import shard_paged_kv
from tools.dcp_simulated_ranks import (decode_on_simulated_ranks,
                                       random_paged_kv)


@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("extra_blocks", [0, 2])
def test_random_paged_kv_gives_each_request_its_own_blocks(block_size, extra_blocks):
    seq_lens = [130, 0, 1, 64, 65, 7]
    gen = torch.Generator().manual_seed(block_size)
    cache, table, lens = random_paged_kv(seq_lens, block_size, generator=gen,
                                         width=24, extra_blocks=extra_blocks)
    blocks = [-(-n // block_size) for n in seq_lens]
    assert lens.dtype == torch.int32 and lens.tolist() == seq_lens
    assert table.dtype == torch.int32
    assert table.shape == (len(seq_lens), max(blocks) + extra_blocks)
    assert cache.shape == (sum(blocks) + 1, block_size, 24)
    assert torch.isnan(cache[0]).all() and torch.isfinite(cache[1:]).all()
    used = [table[i, :n] for i, n in enumerate(blocks)]
    for i, n in enumerate(blocks):
        assert (table[i, n:] == 0).all()  # the null block past the end
    # Every real block belongs to exactly one request, in shuffled order.
    ids = torch.cat(used).sort().values
    assert torch.equal(ids, torch.arange(1, sum(blocks) + 1, dtype=torch.int32))
    assert not torch.equal(torch.cat(used), ids)


def test_random_paged_kv_draws_cache_then_shuffle_from_the_generator():
    """Callers go on drawing queries from the same generator: the draws
    (values, then block ids) must not change, or every seeded batch does."""
    gen = torch.Generator().manual_seed(3)
    cache, table, _ = random_paged_kv([40, 9], 16, generator=gen, width=8)
    after = torch.randn(4, generator=gen)
    replay = torch.Generator().manual_seed(3)
    values = torch.randn(cache.shape, generator=replay)
    ids = torch.randperm(4, generator=replay) + 1
    assert torch.equal(cache[1:], values[1:])
    assert table[0, :3].tolist() == ids[:3].tolist()
    assert table[1, :1].tolist() == ids[3:].tolist()
    assert torch.equal(after, torch.randn(4, generator=replay))


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_each_rank_decodes_its_own_shard_and_the_merge_weighs_them(world_size):
    cache, table, lens = random_paged_kv([50, 3, 17], 16,
                                         generator=torch.Generator().manual_seed(0),
                                         width=8)
    expected = shard_paged_kv(cache, table, lens,
                              layout=DCPLayout(world_size, interleave=4),
                              generator=torch.Generator().manual_seed(5))
    seen = []

    def decode_rank(layout, local_cache, local_table):
        rank = layout.rank
        seen.append(rank)
        want_cache, want_table = expected[rank]
        assert torch.equal(local_table, want_table)
        assert torch.equal(local_cache.nan_to_num(-1.0), want_cache.nan_to_num(-1.0))
        # Rank r: output r everywhere, LSE log(r + 1): merge weight r + 1.
        out = torch.full((3, 2, 4), float(rank))
        lse = torch.full((3, 2), math.log(rank + 1))
        return out, lse

    out, lse = decode_on_simulated_ranks(cache, table, lens, decode_rank,
                                         layout=DCPLayout(world_size, interleave=4),
                                         generator=torch.Generator().manual_seed(5))
    assert seen == list(range(world_size))
    weights = torch.arange(1, world_size + 1, dtype=torch.float32)
    want = float((weights * torch.arange(world_size)).sum() / weights.sum())
    torch.testing.assert_close(out, torch.full((3, 2, 4), want))
    torch.testing.assert_close(lse, torch.full((3, 2), math.log(weights.sum())))


def test_merge_is_pluggable():
    cache, table, lens = random_paged_kv([5], 4, generator=torch.Generator(), width=8)
    stacked = []

    def merge(outs, lses):
        stacked.append((outs.shape, lses.shape))
        return outs.sum(0), lses.sum(0)

    out, lse = decode_on_simulated_ranks(
        cache, table, lens, lambda r, c, t: (torch.ones(1, 2, 3), torch.zeros(1, 2)),
        layout=DCPLayout(3), merge=merge)
    assert stacked == [((3, 1, 2, 3), (3, 1, 2))]
    assert torch.equal(out, torch.full((1, 2, 3), 3.0))
