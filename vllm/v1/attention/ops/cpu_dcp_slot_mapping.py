# SPDX-License-Identifier: Apache-2.0
"""KV-cache slot mapping under decode context parallelism, in torch.

vLLM's CPU fallback for its slot-mapping Triton kernel asserts a CP world size
of 1. This is the DCP-aware version: every new token's KV goes to the rank
that owns its position (``DCPLayout.owner``); other ranks get the pad slot.

Pure torch: no vllm import.
"""

from __future__ import annotations

import torch

from vllm.v1.attention.ops.dcp_decode import DCPLayout

__all__ = ["dcp_slot_mapping"]


def dcp_slot_mapping(
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    block_table: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    num_tokens: int,
    max_num_tokens: int,
    block_size: int,
    layout: DCPLayout,
    pad_id: int = -1,
) -> torch.Tensor:
    """Fill ``slot_mapping`` with this rank's cache slot of each new token.

    A request's block table lists local blocks; global position ``p`` falls in
    table column ``p // (block_size * W)``, and within that virtual block at
    offset ``o = p % (block_size * W)``, owned by rank ``(o // I) % W`` at local
    slot ``(o // (W * I)) * I + o % I``.

    Args:
        query_start_loc: int32 [R + 1], token offsets of the R requests.
        positions: int64 [>= num_tokens], global position of each new token.
        block_table: int32 [>= R, B], local block ids per request row.
        slot_mapping: int64 [>= max_num_tokens], written in place.
        num_tokens: tokens scheduled in this step.
        max_num_tokens: slots past ``num_tokens`` up to here get ``pad_id``.
        block_size: tokens per (local) KV block.
        layout: the DCP split (W, I), seen from this rank.
        pad_id: slot of tokens this rank does not store.

    Returns:
        ``slot_mapping``.
    """
    token = torch.arange(num_tokens, dtype=query_start_loc.dtype,
                         device=positions.device)
    req = torch.searchsorted(query_start_loc[1:], token, right=True)
    pos = positions[:num_tokens].long()
    virtual_block_size = block_size * layout.world_size
    owner, local_offset = layout.owner(pos % virtual_block_size)
    block = block_table[req, pos // virtual_block_size].long()
    slots = torch.where(owner == layout.rank, block * block_size + local_offset,
                        pad_id)
    slot_mapping[:num_tokens] = slots
    slot_mapping[num_tokens:max_num_tokens] = pad_id
    return slot_mapping
