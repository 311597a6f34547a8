# SPDX-License-Identifier: Apache-2.0
"""FLASHINFER_MLA's sm90 (Hopper) decode rows, which no upstream backend
serves for a DSpark draft under DCP.

The metadata builder owns one ``Sm90RowPlanner`` per KV-cache group (as
vLLM's sparse sm90 FlashInfer builder owns its state). Each forward it plans
the rows once, from host data (no device-to-host sync of ours), and hands
the planned kernel to the layers on ``DCPDecodeMetadata.plan``; every layer
only runs it (``run_planned``), so uniform decode batches replay in full
CUDA graphs. The kernel is FlashInfer's FA3 MLA
(``BatchMLAPagedAttentionWrapper``) over one segment per request on a
host-known lower bound of the local keys all its tokens share (the KV is
read once, as in FlashInfer's own multi-token decode), plus each token's
remaining keys, attended and merged by one Triton launch over all rows
(``vllm.v1.attention.ops.flashinfer_sm90_mla``). Every shape vLLM captures in
a CUDA graph is planned on a FlashInfer CUDA-graph wrapper of its own (the
builder's ``build_for_cudagraph_capture``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vllm.v1.attention.backends.mla.dcp_metadata import DCPDecodeMetadata
from vllm.v1.attention.backends.mla.dcp_settings import DCPSetting


class Sm90RowPlanner:
    """Plans a KV-cache group's decode rows on sm90 once per forward.

    Args:
        setting: the builder's ``DCPSetting`` (gathered heads, row capacity,
            block-table width, host-length slack).
        vllm_config: the builder's config (its model dtype).
        softmax_scale: the group's one scale, read when the first plan is
            made (the layers' impls exist by then); one plan serves them all.
        page_size: tokens per KV page of the group's kernel blocks.
        kv_lora_rank, rope_dim: the latent (value) and rope widths.
    """

    def __init__(self, setting: DCPSetting, vllm_config,
                 softmax_scale: Callable[[], float], *,
                 page_size: int, kv_lora_rank: int, rope_dim: int) -> None:
        self.setting = setting
        self._vllm_config = vllm_config
        self._softmax_scale = softmax_scale
        self._page_size = page_size
        self._kv_lora_rank = kv_lora_rank
        self._rope_dim = rope_dim
        # The group's FlashInferSm90MLA, made by the first plan (when the
        # layers' impls exist).
        self.kernel = None

    def _make_kernel(self, workspace: torch.Tensor):
        """The group's ``FlashInferSm90MLA``, sized for the largest decode
        batch. No CUDA-graph wrapper up front: a plan for capture makes the
        one of its segment count."""
        from vllm.v1.attention.ops.flashinfer_sm90_mla import FlashInferSm90MLA

        if self.kernel is None:
            self.kernel = FlashInferSm90MLA(
                workspace, num_heads=self.setting.gathered_heads,
                page_size=self._page_size, sm_scale=self._softmax_scale(),
                dtype=self._vllm_config.model_config.dtype,
                kv_lora_rank=self._kv_lora_rank, rope_dim=self._rope_dim,
                max_rows=self.setting.row_capacity,
                max_cols=self.setting.block_table_width)
        return self.kernel

    def plan(self, decode: DCPDecodeMetadata, workspace: torch.Tensor, *,
             block_table: torch.Tensor, query_start_loc_cpu: torch.Tensor,
             host_seq_lens: torch.Tensor | None, num_rows: int,
             for_graph: bool) -> None:
        """Plan this forward for every layer of the group and put the kernel
        on ``decode.plan``.

        Args:
            decode: the forward's rows (``decode.flat``).
            workspace: FlashInfer's uint8 CUDA workspace.
            block_table: int32 [R, B] local block table of the requests.
            query_start_loc_cpu: int CPU [R + 1] query offsets.
            host_seq_lens: int CPU [>= R] vLLM's host global lengths (an upper
                bound under async speculative decoding); None reads the
                device's (a sync).
            num_rows: T, decode query rows the layers run.
            for_graph: the forward is captured in a CUDA graph.
        """
        kernel = self._make_kernel(workspace)
        if host_seq_lens is None:
            host_seq_lens = decode.dcp_tot_seq_lens.cpu()
        kernel.plan_rows(query_start_loc_cpu, host_seq_lens, block_table,
                         decode.flat.slice(num_rows), num_rows=num_rows,
                         causal=decode.causal, slack=self.setting.host_length_slack,
                         layout=decode.layout, for_graph=for_graph,
                         forward_id=decode.forward_id)
        decode.plan = kernel


def run_planned(decode: DCPDecodeMetadata, scale: float, q: torch.Tensor,
                kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's run of the plan its builder made for this forward.

    Args:
        decode: the forward's metadata, planned by ``Sm90RowPlanner``.
        scale: the layer's softmax scale (must be the planned one).
        q: [T, H, Dv + Dr] queries; kv_cache: [P, page, Dv + Dr].

    Returns:
        ``(out [T, H, Dv], lse [T, H] float32 natural log)``.
    """
    kernel = decode.plan
    if kernel is None or kernel.planned_forward_id != decode.forward_id:
        raise RuntimeError(
            "FLASHINFER_MLA on sm90: no plan for this forward; the "
            "metadata builder plans once per forward before the layers run")
    if kernel.sm_scale != scale:
        raise ValueError(
            f"FLASHINFER_MLA on sm90 planned softmax scale {kernel.sm_scale}, "
            f"layer has {scale}")
    return kernel.run(q, kv_cache)
