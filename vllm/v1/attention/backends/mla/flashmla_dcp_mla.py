# SPDX-License-Identifier: Apache-2.0
"""vLLM's FlashMLA under DCP x DSpark on Hopper: the target's causal verify and
the DSpark draft's non-causal block, bf16 or fp8 KV, any interleave.

Registered over ``FLASHMLA`` by the plugin. Upstream's builder passes no
``supports_dcp_with_varlen``, so with DSpark and DCP it refuses the target at
model load, and its ``causal=True`` (aligned to the end of the whole
sequence) is wrong on a rank's interleaved shard. Here, under DCP, the
builder fills ``DCPDecodeMetadata`` once per forward and plans FlashMLA on it
(``vllm.v1.attention.ops.flashmla_dcp_rows``): one ``causal=False`` call per
layer over each request's shared local prefix, kept as one tile per request
as FlashMLA wants it, plus each verify token's few remaining local keys
through the tail kernel; all from device data, so uniform decode batches
replay in full CUDA graphs (upstream's ``UNIFORM_BATCH``).

A lone bf16 request's block (batch 1 per rank: the DSpark latency regime)
runs FlashInfer's FA3 on Hopper instead, with its plan made on the device
(``flashmla_fa3_rows``; faster there, benchmarks/RESULTS.md run 23), where
FlashInfer is installed; ``VLLM_DCP_FLASHMLA_FA3=0`` keeps FlashMLA.
Over an fp8 cache with the heads a multiple of 64, FlashMLA takes a
multi-token block's rows as one-token requests over their own bounds
(``flashmla_token_rows``: no tail launch); ``VLLM_DCP_FLASHMLA_TOKEN_ROWS``
1 / 0 forces it on / off.

Rows where this rank holds no KV are masked (out 0, LSE -inf) by the plan's
own last launch, and the layers' combines, routed once when the builder is
made, skip their own per-layer mask (``dcp_epilogue``).

With DCP size 1 (or a cache every rank holds whole) the selection, builder
and kernel calls are upstream's.
"""

from __future__ import annotations

import importlib.util
import os
from typing import ClassVar

import torch

from vllm.config import VllmConfig
from vllm.utils.platform_utils import num_compute_units
from vllm.v1.attention.backend import AttentionLayer
from vllm.v1.attention.backends.mla import dcp_config_checks as checks
from vllm.v1.attention.backends.mla.dcp_compat import current_dcp_size
from vllm.v1.attention.backends.mla.dcp_metadata import (
    DCPDecodeBuilderMixin,
    DCPDecodeMetadata,
    DCPRowsImplMixin,
)
from vllm.v1.attention.backends.mla.dcp_settings import kv_split_over_dcp
from vllm.v1.attention.backends.mla.flashmla import (
    FlashMLABackend,
    FlashMLAImpl,
    FlashMLAMetadata,
    FlashMLAMetadataBuilder,
)
from vllm.v1.attention.ops.flashmla_dcp_rows import FlashMLARowPlan, FlashMLARowPlanner
from vllm.v1.attention.ops.flashmla_fa3_rows import FA3RowPlans
from vllm.v1.attention.ops.flashmla_pieces import PAGE
from vllm.v1.kv_cache_interface import AttentionSpec, is_quantized_kv_cache
from vllm.v1.worker.cpu.triton_interpreter_boot import env_flag

FA3_SWITCH = "VLLM_DCP_FLASHMLA_FA3"
# FlashMLA's one-token requests (flashmla_token_rows): 1 always, 0 never,
# unset by shape (token_rows_preferred: fp8, heads a multiple of 64).
TOKEN_ROWS_SWITCH = "VLLM_DCP_FLASHMLA_TOKEN_ROWS"


def _group_kv_cache_dtype(kv_cache_spec: AttentionSpec, vllm_config) -> str:
    """The KV-cache dtype of a group's layers: the one their MLA layers put
    on the spec (a layer's own, e.g. a DSpark draft's), else the config's."""
    return (getattr(kv_cache_spec, "cache_dtype_str", None)
            or vllm_config.cache_config.cache_dtype)


class FlashMLADCPMetadataBuilder(DCPDecodeBuilderMixin, FlashMLAMetadataBuilder):
    """FlashMLA builder that, under DCP, fills the rows and plans FlashMLA on
    them once per forward; upstream's builder otherwise."""

    dcp_backend = "FLASHMLA"

    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
    ) -> None:
        # Read by the base __init__ (DSpark validation, reorder threshold),
        # so set first; per builder, so that DCP size 1 keeps upstream's
        # class attributes.
        self._dcp_rows_enabled = kv_split_over_dcp(kv_cache_spec, vllm_config)
        if self._dcp_rows_enabled:
            self.supports_non_causal_multi_token_decode = True  # type: ignore[misc]
            self.supports_non_causal_multi_token_dcp = True  # type: ignore[misc]
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._flashmla_rows: FlashMLARowPlanner | None = None
        if self._dcp_rows_enabled:
            setting = self.dcp_setting
            fp8 = is_quantized_kv_cache(_group_kv_cache_dtype(kv_cache_spec, vllm_config))
            num_sms = (num_compute_units(self.device.index)
                       if self.device.type == "cuda" else 1)
            self._flashmla_rows = FlashMLARowPlanner(
                max_reqs=setting.row_capacity, max_rows=setting.row_capacity,
                num_heads=setting.gathered_heads,
                kv_lora_rank=self.mla_dims.kv_lora_rank, fp8=fp8, num_sms=num_sms,
                device=self.device,
                fa3=self._fa3_row_plans(fp8=fp8, num_sms=num_sms),
                token_rows=(env_flag(TOKEN_ROWS_SWITCH)
                            if os.environ.get(TOKEN_ROWS_SWITCH, "").strip() else None))

    def _fa3_row_plans(self, *, fp8: bool, num_sms: int) -> FA3RowPlans | None:
        """FA3 for a lone request's block: on Hopper, bf16 / fp16, where
        FlashInfer is installed and ``VLLM_DCP_FLASHMLA_FA3`` is not 0."""
        dtype = self.vllm_config.model_config.dtype
        if (fp8 or dtype not in (torch.bfloat16, torch.float16)
                or self.device.type != "cuda" or checks.current_gpu_major() != 9
                or not env_flag(FA3_SWITCH, default=True)
                or importlib.util.find_spec("flashinfer") is None):
            return None
        return FA3RowPlans(
            num_heads=self.dcp_setting.gathered_heads,
            page_size=PAGE, dtype=dtype,
            max_cols=self.dcp_setting.block_table_width, num_sms=num_sms,
            kv_lora_rank=self.mla_dims.kv_lora_rank,
            rope_dim=self.mla_dims.qk_rope_head_dim, device=self.device)

    def _validate_dspark_dcp_support(self, supports_dcp_with_varlen: bool) -> None:
        super()._validate_dspark_dcp_support(
            supports_dcp_with_varlen or self._dcp_rows_enabled)

    def _init_reorder_batch_threshold(
        self,
        reorder_batch_threshold: int | None = 1,
        supports_spec_as_decode: bool = False,
        supports_dcp_with_varlen: bool = False,
    ) -> None:
        if self._dcp_rows_enabled:
            # Upstream sends multi-token queries to prefill under DCP; the
            # rows decode speculative blocks (1 + k, or a DSpark block of k),
            # and short prefills stay prefills (upstream's 128-token decode
            # threshold is for DCP size 1).
            reorder_batch_threshold, supports_dcp_with_varlen = 1, True
        super()._init_reorder_batch_threshold(
            reorder_batch_threshold, supports_spec_as_decode, supports_dcp_with_varlen)

    def _build_decode(self, *, block_table_tensor, seq_lens_device, max_seq_len,
                      query_start_loc_cpu, query_start_loc_device,
                      num_decode_tokens, max_query_len, dcp_tot_seq_lens_device):
        decode = super()._build_decode(
            block_table_tensor=block_table_tensor, seq_lens_device=seq_lens_device,
            max_seq_len=max_seq_len, query_start_loc_cpu=query_start_loc_cpu,
            query_start_loc_device=query_start_loc_device,
            num_decode_tokens=num_decode_tokens, max_query_len=max_query_len,
            dcp_tot_seq_lens_device=dcp_tot_seq_lens_device)
        if isinstance(decode, DCPDecodeMetadata):
            decode.plan = self._flashmla_rows.plan(
                decode.flat, block_table_tensor,
                query_start_loc=query_start_loc_device,
                query_start_loc_cpu=query_start_loc_cpu,
                num_rows=num_decode_tokens, causal=decode.causal,
                forward_id=decode.forward_id,
                sm_scale=lambda: self._group_softmax_scale("FLASHMLA under DCP (FA3)"))
        return decode


class FlashMLADCPImpl(DCPRowsImplMixin, FlashMLAImpl):
    """FlashMLA decode over the per-forward DCP rows."""

    # FlashMLA's LSE and the tails' are natural log.
    lse_base_on_e: ClassVar[bool] = True

    def forward_rows(
        self,
        q: torch.Tensor,
        kv_c_and_k_pe_cache: torch.Tensor,
        decode: DCPDecodeMetadata,
        attn_metadata: FlashMLAMetadata,
        layer: AttentionLayer,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Absorbed-MLA decode of T = R x s query tokens over this rank's KV.

        Args:
            q: [T, H, 576] bf16, or fp8 e4m3 with an fp8 cache (vLLM
                quantizes it with the layer's ``_q_scale``).
            kv_c_and_k_pe_cache: [P, 64, 576] this rank's cache (fp8 e4m3
                with an fp8 KV-cache dtype).

        Returns:
            ``(out [T, H, 512] bf16, lse [T, H] float32 natural log or None)``.
        """
        plan = decode.plan
        # The builder sets the plan with the metadata; a later build rewrites
        # the buffers it reads (a stale forward).
        if not isinstance(plan, FlashMLARowPlan) or not plan.is_current:
            raise RuntimeError(
                "FLASHMLA under DCP: no plan for this forward; the metadata "
                "builder plans once per forward before the layers run")
        fp8 = is_quantized_kv_cache(self.kv_cache_dtype)
        out, lse = plan.run(q, kv_c_and_k_pe_cache, sm_scale=self.scale,
                            q_scale=layer._q_scale if fp8 else None,
                            k_scale=layer._k_scale if fp8 else None)
        # The plan's last launch already zeroed the rows with no local key.
        return out, (lse if self.need_to_return_lse_for_decode else None)


class FlashMLADCPBackend(checks.DCPSelection, FlashMLABackend):
    """``FLASHMLA`` with DCP x DSpark rows (sm90)."""

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        # The DCP rows are Hopper's (FA3 and FlashMLA's sm90 kernels); at DCP
        # size 1 vLLM's own answer stands.
        if current_dcp_size() > 1:
            return capability.major == 9
        return super().supports_compute_capability(capability)

    @staticmethod
    def get_impl_cls() -> type[FlashMLADCPImpl]:
        return FlashMLADCPImpl

    @staticmethod
    def get_builder_cls() -> type[FlashMLADCPMetadataBuilder]:
        return FlashMLADCPMetadataBuilder

    @classmethod
    def supports_non_causal(cls) -> bool:
        # A DSpark block under DCP is a prefix with no tail; without DCP
        # Hopper keeps upstream's choice (TRITON_MLA).
        return current_dcp_size() > 1 or super().supports_non_causal()

    @classmethod
    def supports_non_causal_dcp(cls) -> bool:
        return True

    @classmethod
    def supports_device_cpu_query_lens_mismatch(cls) -> bool:
        # FlashMLA tiles each request's s tokens together, s read from the
        # host offsets (upstream reshapes the same way); under DCP the rows
        # must match those tiles, so adaptive verification is refused there.
        if current_dcp_size() > 1:
            return False
        return super().supports_device_cpu_query_lens_mismatch()
