# SPDX-License-Identifier: Apache-2.0
"""Full MLA attention without DCP, written independently of the ops layer.

Dense, per request and per query token, over a contiguous copy of the
request's KV: the yardstick that sharded-and-merged decode must equal. Only
the random input batch comes from the ops layer (``random_paged_kv``, shared
with the simulator and the device check).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tools.dcp_simulated_ranks import random_paged_kv

KV_LORA_RANK = 512
ROPE_DIM = 64
LATENT = KV_LORA_RANK + ROPE_DIM


@dataclass
class DecodeBatch:
    """A random decode batch over a global paged latent cache.

    kv_cache [num_blocks, block_size, LATENT] (block 0 is the null block, NaN),
    block_table int32 [R, B], seq_lens int32 [R], query_start_loc int32 [R + 1],
    q [T, H, LATENT] with T = query_start_loc[-1].
    """

    kv_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    q: torch.Tensor
    scale: float


def random_decode_batch(seq_lens, query_lens, *, block_size, num_heads=4,
                        seed=0, extra_blocks=1) -> DecodeBatch:
    """Shuffled block ids, unused table entries pointing at the null block 0."""
    gen = torch.Generator().manual_seed(seed)
    paged = random_paged_kv(seq_lens, block_size, generator=gen, width=LATENT,
                            extra_blocks=extra_blocks)
    qsl = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(query_lens, dtype=torch.int32), 0)
    q = torch.randn(int(qsl[-1]), num_heads, LATENT, generator=gen)
    return DecodeBatch(paged.kv_cache, paged.block_table, paged.seq_lens, qsl, q,
                       scale=0.0721)


def full_attention(batch: DecodeBatch, *, causal: bool):
    """(out [T, H, KV_LORA_RANK], lse [T, H]) of every query token, no DCP."""
    block_size = batch.kv_cache.shape[1]
    outs, lses = [], []
    for i, seq_len in enumerate(batch.seq_lens.tolist()):
        start, end = batch.query_start_loc[i:i + 2].tolist()
        q_len = end - start
        if q_len == 0:
            continue
        kv = torch.cat([batch.kv_cache[int(b)] for b in
                        batch.block_table[i, : -(-seq_len // block_size)]])[:seq_len]
        for t in range(q_len):
            visible = seq_len - q_len + 1 + t if causal else seq_len
            keys = kv[:visible]
            scores = torch.einsum("hd,td->ht", batch.q[start + t].double(),
                                  keys.double()) * batch.scale
            lse = torch.logsumexp(scores, dim=-1)
            probs = torch.softmax(scores, dim=-1)
            outs.append(probs @ keys[:, :KV_LORA_RANK].double())
            lses.append(lse)
    return torch.stack(outs).float(), torch.stack(lses).float()
