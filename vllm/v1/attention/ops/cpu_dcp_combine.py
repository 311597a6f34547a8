# SPDX-License-Identifier: Apache-2.0
"""CPU stand-in for vLLM's DCP output-correction Triton kernel.

vLLM combines the DCP ranks' partial MLA decode outputs with
all-gather(LSE) -> per-rank rescale (a Triton kernel) -> reduce-scatter over
heads. Triton has no CPU backend here, so the rescale step runs in torch: each
rank's weight in the merge is ``merge_partials`` applied to a one-hot
indicator of that rank, which keeps the empty-shard rules (-inf, +inf and NaN
LSE contribute nothing) in one place.

Pure torch: no vllm import.
"""

from __future__ import annotations

import torch

from vllm.v1.attention.ops.dcp_decode import merge_partials

__all__ = ["dcp_rank_weight", "correct_attn_out_kernel_cpu"]


def dcp_rank_weight(
    lses: torch.Tensor, rank: int, *, lse_base_e: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight of rank ``rank``'s partial output in the LSE merge.

    Args:
        lses: [W, B, H] every rank's partial LSE (all-gathered).
        rank: the rank whose weight is wanted.
        lse_base_e: natural-log LSE (True) or base 2.

    Returns:
        ``(weight [B, H] float32, merged_lse [B, H] float32)``, with
        ``sum_r weight_r = 1`` on rows where any rank holds KV, weight 0 and
        merged LSE -inf where none does. The merged LSE is in the input's base.
    """
    one_hot = torch.zeros(lses.shape + (1,), dtype=torch.float32,
                          device=lses.device)
    one_hot[rank] = 1.0
    weight, merged_lse = merge_partials(one_hot, lses, lse_base_e=lse_base_e)
    return weight[..., 0], merged_lse


def correct_attn_out_kernel_cpu(
    outputs_ptr: torch.Tensor,
    new_output_ptr: torch.Tensor,
    lses_ptr: torch.Tensor,
    vlse_ptr: torch.Tensor,
    outputs_stride_B: int,
    outputs_stride_H: int,
    outputs_stride_D: int,
    lses_stride_N: int,
    lses_stride_B: int,
    lses_stride_H: int,
    lse_idx: int,
    HEAD_DIM: int,
    N_ROUNDED: int,
    IS_BASE_E: bool,
) -> None:
    """Drop-in for ``CorrectAttnCPOutKernel.kernel`` (same argument names).

    Args (tensors arrive as tensors, not pointers):
        outputs_ptr: [B, H, D] this rank's partial output.
        new_output_ptr: [B, H, D] written with the rescaled output (may alias
            ``outputs_ptr``).
        lses_ptr: [W, B, H] all-gathered partial LSEs.
        vlse_ptr: [B, H] written with the merged LSE.
        lse_idx: this rank's index in ``lses_ptr``.
        IS_BASE_E: LSE base; the strides, HEAD_DIM and N_ROUNDED are implied by
            the tensors and unused.
    """
    weight, merged_lse = dcp_rank_weight(lses_ptr, lse_idx,
                                         lse_base_e=bool(IS_BASE_E))
    corrected = outputs_ptr.float() * weight[..., None]
    # An empty shard's output may hold garbage (even NaN): zero, not scale it.
    corrected = torch.where(weight[..., None] > 0, corrected, 0.0)
    new_output_ptr.copy_(corrected.to(new_output_ptr.dtype))
    vlse_ptr.copy_(merged_lse.to(vlse_ptr.dtype))
