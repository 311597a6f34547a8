# SPDX-License-Identifier: Apache-2.0
"""FlashInfer MLA under DCP x DSpark: causal verify and non-causal draft blocks.

Registered over ``FLASHINFER_MLA`` by the plugin. With DCP every decode query
token is one row of the per-forward ``DCPDecodeMetadata`` (its own local KV
bound, block table row and empty flag), so one code path serves causal
speculative verification, non-causal DSpark draft blocks, ragged batches and
any ``--cp-kv-cache-interleave-size``:

- sm100: FlashInfer's CuTe DSL MLA decode (``trtllm_batch_decode_with_kv_cache_mla``,
  ``backend="cute-dsl"``) over the rows, each a single-token query bounded by
  its local length; natural-log LSE.
- sm90 (Hopper, which no upstream backend serves for a DSpark draft under
  DCP): FlashInfer's FA3 MLA plus Triton tails, planned by the builder once
  per forward and only run by every layer (``flashinfer_dcp_mla_sm90``), so
  uniform decode batches replay in full CUDA graphs; natural-log LSE. On
  sm90 the rows are built at DCP size 1 too (the trtllm-gen path is
  sm100-only).

Rows where this rank holds no KV are masked from the metadata (out 0, LSE
-inf) and the layers' combines, routed once when the builder is made, skip
their own per-layer mask (``dcp_epilogue``).
With DCP size 1 everything is upstream's: on sm90 the backend is not
selectable then (as upstream), on sm100 the builder and kernels are upstream's.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from flashinfer.decode import trtllm_batch_decode_with_kv_cache_mla

from vllm.config import VllmConfig
from vllm.model_executor.layers.attention.mla_attention import MLACommonMetadataBuilder
from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.backend import AttentionCGSupport, AttentionLayer
from vllm.v1.attention.backends.mla import dcp_config_checks as checks
from vllm.v1.attention.backends.mla.dcp_compat import current_dcp_size
from vllm.v1.attention.backends.mla.dcp_epilogue import finish_rows_decode
from vllm.v1.attention.backends.mla.dcp_metadata import (
    DCPDecodeBuilderMixin,
    DCPDecodeMetadata,
    DCPRowsImplMixin,
)
from vllm.v1.attention.backends.mla.flashinfer_dcp_mla_sm90 import (
    Sm90RowPlanner,
    run_planned,
)
from vllm.v1.attention.backends.mla.flashinfer_mla import (
    FlashInferMLABackend,
    FlashInferMLAImpl,
    FlashInferMLAMetadata,
    FlashInferMLAMetadataBuilder,
    _get_workspace_buffer,
)
from vllm.v1.kv_cache_interface import AttentionSpec, is_quantized_kv_cache


class FlashInferDCPMLAMetadataBuilder(DCPDecodeBuilderMixin, FlashInferMLAMetadataBuilder):
    """FlashInfer-MLA builder that fills the DCP rows once per forward.

    Flattened rows take any query-length mix with LSE, causal or not, and any
    interleave size, so all three DSpark x DCP capability flags hold on both
    GPU generations this backend runs on.
    """

    supports_non_causal_multi_token_decode: ClassVar[bool] = True
    supports_non_causal_multi_token_dcp: ClassVar[bool] = True
    dcp_backend = "FLASHINFER_MLA"

    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
    ) -> None:
        # On sm90 the rows are built at DCP size 1 too (the trtllm-gen path
        # is sm100-only); there, and under DCP, the mixin checks the setting.
        self.rows_without_dcp = checks.current_gpu_major() == 9
        # FlashInferMLAMetadataBuilder.__init__ (0.32 and 0.34) is a
        # rejection of interleave sizes other than 1 under DCP, read from the
        # parallel config, followed by exactly this call. The rows lift that
        # limit, and only a doctored config would pass the check, which the
        # grandparent would then record (interleave, DCP block sizes) and
        # keep as ``self.vllm_config``; so this builder makes the call
        # itself. tests/test_vllm_compat.py fails if the parent's __init__
        # ever does more.
        MLACommonMetadataBuilder.__init__(
            self, kv_cache_spec, layer_names, vllm_config, device,
            FlashInferMLAMetadata, supports_dcp_with_varlen=True)
        self._init_dcp_rows(layer_names)
        self._sm90_for_graph = False
        self._sm90: Sm90RowPlanner | None = None
        if self.rows_without_dcp:
            self._sm90 = Sm90RowPlanner(
                self.dcp_setting, vllm_config,
                lambda: self._group_softmax_scale("FLASHINFER_MLA on sm90"),
                page_size=kv_cache_spec.block_size,
                kv_lora_rank=self.mla_dims.kv_lora_rank,
                rope_dim=self.mla_dims.qk_rope_head_dim)

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        if checks.current_gpu_major() == 9:
            # sm90 (DCP > 1 only): the builder plans FA3 from host data
            # into persistent buffers and every layer only runs,
            # so a uniform decode batch (every segment q_len tokens) replays
            # in a graph.
            dcp_size = (vllm_config.parallel_config.decode_context_parallel_size
                        if vllm_config is not None else 1)
            if dcp_size > 1:
                return AttentionCGSupport.UNIFORM_BATCH
            return AttentionCGSupport.NEVER
        return super().get_cudagraph_support(vllm_config, kv_cache_spec)

    # ------------------------------------------------------------ sm90 plan
    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        # The sm90 plan reads vLLM's host copy of the sequence lengths (an
        # upper bound under async speculative decoding).
        self._host_seq_lens = common_attn_metadata.seq_lens_cpu_upper_bound
        return super().build(common_prefix_len, common_attn_metadata, fast_build)

    def build_for_cudagraph_capture(self, common_attn_metadata):
        # Every FULL graph vLLM captures (target and draft, any version's
        # capture sizes) is built here: its FA3 segment count gets a
        # CUDA-graph wrapper, which its replays' plans then reuse.
        self._sm90_for_graph = True
        try:
            return super().build_for_cudagraph_capture(common_attn_metadata)
        finally:
            self._sm90_for_graph = False

    def _build_decode(self, *, block_table_tensor, seq_lens_device, max_seq_len,
                      query_start_loc_cpu, query_start_loc_device,
                      num_decode_tokens, max_query_len, dcp_tot_seq_lens_device):
        decode = super()._build_decode(
            block_table_tensor=block_table_tensor, seq_lens_device=seq_lens_device,
            max_seq_len=max_seq_len, query_start_loc_cpu=query_start_loc_cpu,
            query_start_loc_device=query_start_loc_device,
            num_decode_tokens=num_decode_tokens, max_query_len=max_query_len,
            dcp_tot_seq_lens_device=dcp_tot_seq_lens_device)
        if self._sm90 is not None and isinstance(decode, DCPDecodeMetadata):
            self._sm90.plan(decode, _get_workspace_buffer(True),
                            block_table=block_table_tensor,
                            query_start_loc_cpu=query_start_loc_cpu,
                            host_seq_lens=self._host_seq_lens,
                            num_rows=num_decode_tokens, for_graph=self._sm90_for_graph)
        return decode


class FlashInferDCPMLAImpl(DCPRowsImplMixin, FlashInferMLAImpl):
    """FlashInfer-MLA decode over the per-forward DCP rows."""

    # The kernels on the rows (CuTe DSL on sm100, FA3 + tails on sm90)
    # report natural-log LSE.
    lse_base_on_e: ClassVar[bool] = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gpu_major = checks.current_gpu_major()

    def forward_rows(
        self,
        q: torch.Tensor,
        kv_c_and_k_pe_cache: torch.Tensor,
        decode: DCPDecodeMetadata,
        attn_metadata: FlashInferMLAMetadata,
        layer: AttentionLayer,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Absorbed-MLA decode of ``q`` [N, H, Dv + R] over this rank's
        cache [num_blocks, block_size, Dv + R].

        Returns:
            ``(out [N, H, Dv], lse [N, H] float32 natural log or None)``.
        """
        if self.gpu_major == 9:
            out, lse = run_planned(decode, self.scale, q, kv_c_and_k_pe_cache)
        else:
            out, lse = self._decode_rows_sm100(q, kv_c_and_k_pe_cache, decode,
                                               attn_metadata.max_seq_len, layer)
        return finish_rows_decode(self, out, lse, decode.flat)

    def _decode_rows_sm100(self, q, kv_cache, decode: DCPDecodeMetadata,
                           max_seq_len: int, layer: AttentionLayer):
        """One single-token query per row, bounded by the row's local length."""
        num_rows = q.shape[0]
        rows = decode.flat
        bmm1_scale, bmm2_scale = self.scale, 1.0
        if is_quantized_kv_cache(self.kv_cache_dtype):
            bmm1_scale *= layer._q_scale_float * layer._k_scale_float
            bmm2_scale *= layer._k_scale_float
        out, lse = trtllm_batch_decode_with_kv_cache_mla(
            query=q.unsqueeze(1),
            kv_cache=kv_cache.unsqueeze(1),
            workspace_buffer=_get_workspace_buffer(True),
            qk_nope_head_dim=self.qk_nope_head_dim,
            kv_lora_rank=self.kv_lora_rank,
            qk_rope_head_dim=self.qk_rope_head_dim,
            block_tables=rows.block_table[:num_rows],
            seq_lens=rows.seq_lens[:num_rows],
            max_seq_len=max_seq_len,
            bmm1_scale=bmm1_scale,
            bmm2_scale=bmm2_scale,
            backend="cute-dsl",
            return_lse=True,
        )
        return out.view(num_rows, q.shape[1], -1), lse.view(num_rows, q.shape[1])


class FlashInferDCPMLABackend(checks.DCPSelection, FlashInferMLABackend):
    """``FLASHINFER_MLA`` with DCP x DSpark rows; sm90 and sm100."""

    # sm90 runs FA3 over an unquantized cache; the rows need these nope dims.
    dcp_unquantized_on: ClassVar[tuple[int, ...]] = (9,)
    dcp_qk_nope_head_dims: ClassVar[tuple[int, ...]] = (64, 128, 192)

    @staticmethod
    def get_impl_cls() -> type[FlashInferDCPMLAImpl]:
        return FlashInferDCPMLAImpl

    @staticmethod
    def get_builder_cls() -> type[FlashInferDCPMLAMetadataBuilder]:
        return FlashInferDCPMLAMetadataBuilder

    @classmethod
    def supports_device_cpu_query_lens_mismatch(cls) -> bool:
        # sm90 plans FA3's per-request segments from the host query offsets.
        if checks.current_gpu_major() == 9:
            return False
        return super().supports_device_cpu_query_lens_mismatch()

    @classmethod
    def supports_compute_capability(cls, capability: DeviceCapability) -> bool:
        # sm90 is this project's FA3 path, for DCP only: at DCP size 1 Hopper
        # keeps upstream's choice (FLASHINFER_MLA is sm100-only there).
        if capability.major == 9:
            return current_dcp_size() > 1
        return super().supports_compute_capability(capability)
