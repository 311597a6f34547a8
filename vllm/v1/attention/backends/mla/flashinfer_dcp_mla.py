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
  DCP): FlashInfer's FA3 MLA (``BatchMLAPagedAttentionWrapper``), planned
  once per forward and run by every layer; natural-log LSE. A request's
  tokens share the local keys below its first token's bound, so the plan is
  one segment per request over that prefix (the KV is read once, as in
  FlashInfer's own multi-token decode) plus each causal token's short tail
  (at most q_len - 1 keys), merged by a Triton kernel; a non-causal draft
  block has no tail.
  On sm90 the rows are built at DCP size 1 too (the trtllm-gen path is
  sm100-only).

Rows where this rank holds no KV are masked from the metadata (out 0, LSE
-inf) and the layer's combine skips its own per-layer mask.
With DCP size 1 everything is upstream's: on sm90 the backend is not
selectable then (as upstream), on sm100 the builder and kernels are upstream's.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
from flashinfer.decode import trtllm_batch_decode_with_kv_cache_mla

from vllm.config import VllmConfig
from vllm.model_executor.layers.attention.mla_attention import MLACommonMetadataBuilder
from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.backend import AttentionCGSupport, AttentionLayer
from vllm.v1.attention.backends.mla import dcp_config_checks as checks
from vllm.v1.attention.backends.mla.dcp_combine import finish_rows_decode
from vllm.v1.attention.backends.mla.dcp_metadata import (
    DCPDecodeBuilderMixin,
    DCPDecodeMetadata,
)
from vllm.v1.attention.backends.mla.flashinfer_mla import (
    FlashInferMLABackend,
    FlashInferMLAImpl,
    FlashInferMLAMetadata,
    FlashInferMLAMetadataBuilder,
    _get_workspace_buffer,
)
from vllm.v1.kv_cache_interface import AttentionSpec

try:  # vLLM >= 0.33
    from vllm.v1.kv_cache_interface import is_quantized_kv_cache
except ImportError:  # vLLM 0.32
    from vllm.utils.torch_utils import is_quantized_kv_cache


def _current_dcp_size() -> int:
    """DCP size of the config being built or selected for (1 without one)."""
    try:  # vLLM >= 0.33 asserts outside a config context
        from vllm.config import get_current_vllm_config_or_none as current
    except ImportError:  # vLLM 0.32 returns a default config there
        from vllm.config import get_current_vllm_config as current
    config = current()
    return 1 if config is None else config.parallel_config.decode_context_parallel_size


def _check(vllm_config: VllmConfig, dcp_size: int, gpu_major: int | None) -> None:
    """``dcp_size``: the DCP size the builder runs at (vLLM >= 0.33 builds a
    cache every rank holds whole, a DCP-1 draft under a DCP target, at 1)."""
    setting = checks.DCPSetting.from_vllm_config(vllm_config, gpu_major)
    setting = dataclasses.replace(setting, dcp_size=dcp_size)
    if setting.dcp_size > 1 or gpu_major == 9:
        checks.raise_if_unsupported(checks.FLASHINFER_MLA, setting)


class FlashInferDCPMLAMetadataBuilder(DCPDecodeBuilderMixin, FlashInferMLAMetadataBuilder):
    """FlashInfer-MLA builder that fills the DCP rows once per forward.

    Flattened rows take any query-length mix with LSE, causal or not, and any
    interleave size, so all three DSpark x DCP capability flags hold on both
    GPU generations this backend runs on.
    """

    supports_non_causal_multi_token_decode: ClassVar[bool] = True
    supports_non_causal_multi_token_dcp: ClassVar[bool] = True

    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
    ) -> None:
        gpu_major = checks.current_gpu_major()
        self.rows_without_dcp = gpu_major == 9
        # FlashInferMLAMetadataBuilder.__init__ only adds a rejection of
        # interleave sizes other than 1, which the rows lift.
        MLACommonMetadataBuilder.__init__(
            self, kv_cache_spec, layer_names, vllm_config, device,
            FlashInferMLAMetadata, supports_dcp_with_varlen=True)
        _check(vllm_config, self.dcp_world_size, gpu_major)
        self._init_dcp_rows()

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        # FA3 MLA plans on the host (it syncs on the indptrs) once per forward,
        # inside the first layer: not capturable in a CUDA graph.
        if checks.current_gpu_major() == 9:
            return AttentionCGSupport.NEVER
        return super().get_cudagraph_support(vllm_config, kv_cache_spec)


class FlashInferDCPMLAImpl(FlashInferMLAImpl):
    """FlashInfer-MLA decode over the per-forward DCP rows."""

    # Both kernels used on the rows report natural-log LSE.
    lse_base_on_e: ClassVar[bool] = True
    # Every query token is its own row with its own local bound, so causal
    # verify and draft blocks work at any --cp-kv-cache-interleave-size
    # (vLLM's check_attention_cp_compatibility reads this).
    supports_mtp_with_cp_non_trivial_interleave_size: ClassVar[bool] = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gpu_major = checks.current_gpu_major()

    def forward_mqa(
        self,
        q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        kv_c_and_k_pe_cache: torch.Tensor,
        attn_metadata: FlashInferMLAMetadata,
        layer: AttentionLayer,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Absorbed-MLA decode of N query tokens over this rank's KV.

        Args:
            q: [N, H, Dv + R] (or the ``(q_nope, q_pe)`` pair); H is every
                head of the DCP group after vLLM's query gather.
            kv_c_and_k_pe_cache: [num_blocks, block_size, Dv + R] local cache.

        Returns:
            ``(out [N, H, Dv], lse [N, H] float32 natural log or None)``.
        """
        decode = attn_metadata.decode
        if not isinstance(decode, DCPDecodeMetadata):
            return super().forward_mqa(q, kv_c_and_k_pe_cache, attn_metadata, layer)
        if isinstance(q, tuple):
            q = torch.cat(q, dim=-1)
        if self.gpu_major == 9:
            out, lse = self._decode_rows_sm90(q, kv_c_and_k_pe_cache, decode)
        else:
            out, lse = self._decode_rows_sm100(q, kv_c_and_k_pe_cache, decode,
                                               attn_metadata.max_seq_len, layer)
        return finish_rows_decode(self, out, lse, decode.flat, layer)

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

    def _decode_rows_sm90(self, q, kv_cache, decode: DCPDecodeMetadata):
        """FA3 MLA: the first layer of a forward plans, every layer runs."""
        from vllm.v1.attention.ops.flashinfer_sm90_mla import FlashInferSm90MLA

        key = ("fa3", q.shape[1], self.scale, q.dtype)
        kernel = decode.kernel_state.get(key)
        if kernel is None:
            kernel = FlashInferSm90MLA(
                _get_workspace_buffer(True), num_heads=q.shape[1],
                page_size=kv_cache.shape[1], sm_scale=self.scale, dtype=q.dtype,
                kv_lora_rank=self.kv_lora_rank, rope_dim=self.qk_rope_head_dim)
            decode.kernel_state[key] = kernel
        if getattr(kernel, "planned_forward_id", None) != decode.forward_id:
            kernel.plan_causal_prefix(decode.flat.slice(q.shape[0]),
                                      decode.query_start_loc)
            kernel.planned_forward_id = decode.forward_id
        return kernel.run(q, kv_cache, mask_empty=False)


class FlashInferDCPMLABackend(FlashInferMLABackend):
    """``FLASHINFER_MLA`` with DCP x DSpark rows; sm90 and sm100."""

    @staticmethod
    def get_impl_cls() -> type[FlashInferDCPMLAImpl]:
        return FlashInferDCPMLAImpl

    @staticmethod
    def get_builder_cls() -> type[FlashInferDCPMLAMetadataBuilder]:
        return FlashInferDCPMLAMetadataBuilder

    @classmethod
    def supports_compute_capability(cls, capability: DeviceCapability) -> bool:
        # sm90 is this project's FA3 path, for DCP only: at DCP size 1 Hopper
        # keeps upstream's choice (FLASHINFER_MLA is sm100-only there).
        if capability.major == 9:
            return _current_dcp_size() > 1
        return super().supports_compute_capability(capability)

    @classmethod
    def supports_combination(cls, head_size, dtype, kv_cache_dtype, block_size,
                             use_mla, has_sink, use_sparse, use_mm_prefix,
                             device_capability) -> str | None:
        from vllm.config import get_current_vllm_config

        vllm_config = get_current_vllm_config()
        if vllm_config.model_config is not None and _current_dcp_size() > 1:
            setting = checks.DCPSetting.from_vllm_config(
                vllm_config, device_capability.major)
            problems = checks.flashinfer_problems(setting)
            if problems:
                return problems[0]
        return super().supports_combination(
            head_size, dtype, kv_cache_dtype, block_size, use_mla, has_sink,
            use_sparse, use_mm_prefix, device_capability)
