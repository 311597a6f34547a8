# SPDX-License-Identifier: Apache-2.0
"""CPU MLA backend with decode context parallelism (DCP).

vLLM's ``CPU_MLA`` decode kernel returns no LSE, so the CPU MLA impl pins the
DCP world size to 1. This subclass keeps the real DCP world size and rank and,
when DCP > 1, decodes with the ops layer's torch reference kernel over the
per-forward flattened rows of ``DCPDecodeMetadata`` (one row per query token,
each with its own local causal bound), returning natural-log LSE for vLLM's
combine. That covers single-token decode, causal multi-token speculative
verify and non-causal draft blocks alike.

With DCP = 1 everything (builder, decode kernel, prefill) is upstream's,
except in a DSpark draft's KV group: upstream's CPU decode takes one token per
request, so the draft's non-causal block decodes on the same rows.
Prefill is always upstream's (``forward_mha``), and it does read KV from the
(sharded) cache: a prefill with a context (a prefix-cache hit, or the earlier
chunks of a chunked prefill; ``cpu_mla_prefill_context`` keeps both features
on) runs vLLM's chunked-context path over the paged cache, one chunk of
vLLM's context workspace at a time. Under DCP each rank gathers its own
shard of each chunk and the DCP group all-gathers them (gloo on CPU) before
vLLM reorders the interleaved rows.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from vllm.config import VllmConfig, get_current_vllm_config
from vllm.model_executor.layers.attention.mla_attention import (
    MLACommonMetadata,
    MLACommonMetadataBuilder,
    QueryLenSupport,
)
from vllm.v1.attention.backend import AttentionLayer
from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend, CPUMLAImpl
from vllm.v1.attention.backends.mla.dcp_config_checks import DCPLimits
from vllm.v1.attention.backends.mla.dcp_epilogue import finish_rows_decode
from vllm.v1.attention.backends.mla.dcp_metadata import (
    DCPDecodeBuilderMixin,
    DCPDecodeMetadata,
    DCPRowsImplMixin,
    rows_of,
)
from vllm.v1.attention.backends.mla.dcp_settings import decodes_non_causal_block
from vllm.v1.attention.ops.dcp_decode import mla_decode_reference
from vllm.v1.kv_cache_interface import AttentionSpec


class CPUDCPMLAMetadataBuilder(DCPDecodeBuilderMixin, MLACommonMetadataBuilder):
    """Upstream's MLA builder, plus flattened DCP decode rows when DCP > 1.

    Under DCP the decode path accepts variable query lengths and non-causal
    blocks (each query token is its own row), so speculative verify batches
    and draft blocks are decodes. With DCP = 1 the builder is upstream's
    (single-token decode only), except for a DSpark draft group (non-causal
    block), which decodes on the flattened rows as under DCP.
    """

    # Only consulted when DCP > 1.
    supports_non_causal_multi_token_dcp: ClassVar[bool] = True

    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
    ) -> None:
        use_dcp = vllm_config.parallel_config.decode_context_parallel_size > 1
        # A DSpark draft group decodes a non-causal block; the stock CPU
        # decode kernel takes one token per request, so at DCP = 1 such a
        # group runs on the flattened rows too (the target stays upstream's).
        draft_block = decodes_non_causal_block(vllm_config, layer_names)
        if use_dcp or draft_block:
            # Per builder, not per class: both depend on the DCP size and on
            # the KV-cache group (a DSpark draft at DCP 1), and vLLM reads
            # them off the builder (its ROCm AITER MLA builder sets
            # query_len_support the same way). The one flag vLLM reads off
            # the class, supports_non_causal_multi_token_dcp, is a ClassVar.
            self.query_len_support = QueryLenSupport.VARLEN  # type: ignore[misc]
            self.supports_non_causal_multi_token_decode = True  # type: ignore[misc]
        self.rows_without_dcp = draft_block and not use_dcp
        super().__init__(
            kv_cache_spec,
            layer_names,
            vllm_config,
            device,
            supports_dcp_with_varlen=use_dcp,
        )


class CPUDCPMLAImpl(DCPRowsImplMixin, CPUMLAImpl):
    """``CPUMLAImpl`` that keeps the DCP group and returns decode LSE."""

    # The rows' decode (the ops layer's reference kernel) returns
    # natural-log LSE, so vLLM's AttentionImpl.__new__ asks for it under DCP.
    can_return_lse_for_decode: ClassVar[bool] = True
    lse_base_on_e: ClassVar[bool] = True
    supports_dcp: ClassVar[bool] = True

    def __init__(self, *args, **kwargs) -> None:
        # ``AttentionImpl.__new__`` read the DCP group (size, rank, the LSE
        # request). ``CPUMLAImpl.__init__`` replaces ``MLACommonImpl``'s
        # (which needs a GPU) and pins the DCP size and interleave to 1, its
        # decode kernel having no LSE; it takes no argument that would keep
        # them, and this subclass replaces exactly that kernel, so it puts
        # back the two values the pin overwrote (what else it sets does not
        # depend on DCP: tests/test_vllm_compat.py checks both).
        dcp_world_size = self.dcp_world_size
        super().__init__(*args, **kwargs)
        self.dcp_world_size = dcp_world_size
        if dcp_world_size > 1:
            self.cp_kv_cache_interleave_size = (
                get_current_vllm_config().parallel_config.cp_kv_cache_interleave_size)

    def forward_mqa_without_rows(self, q, kv_c_and_k_pe_cache, attn_metadata, layer):
        if self.dcp_world_size > 1:
            raise TypeError(
                "CPU_MLA under DCP decodes on the per-forward rows of "
                "CPUDCPMLAMetadataBuilder, got "
                f"{type(attn_metadata.decode).__name__} metadata")
        return super().forward_mqa_without_rows(q, kv_c_and_k_pe_cache,
                                                attn_metadata, layer)

    def forward_rows(
        self,
        q: torch.Tensor,
        kv_c_and_k_pe_cache: torch.Tensor,
        decode: DCPDecodeMetadata,
        attn_metadata: MLACommonMetadata,
        layer: AttentionLayer,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Absorbed MLA decode of ``q`` [N, H, Dv + R] over this rank's KV
        slice (the ops layer's reference kernel).

        Returns:
            ``(out [N, H, Dv] in q's dtype, lse [N, H] float32 natural log)``
            (LSE None where vLLM does not ask for it; with DCP = 1 the rows
            serve a DSpark draft block). Rows for which this rank holds no
            KV give ``lse = -inf``.
        """
        num_rows = q.shape[0]
        rows = rows_of(decode, num_rows)
        out, lse = mla_decode_reference(
            q,
            kv_c_and_k_pe_cache,
            rows.block_table[:num_rows],
            rows.seq_lens[:num_rows],
            kv_lora_rank=self.kv_lora_rank,
            scale=self.scale,
        )
        return finish_rows_decode(self, out, lse, rows)


class CPUDCPMLABackend(DCPLimits, CPUMLABackend):
    """``CPU_MLA`` with DCP support (registered over it by the plugin)."""

    @staticmethod
    def get_impl_cls() -> type[CPUDCPMLAImpl]:
        return CPUDCPMLAImpl

    @staticmethod
    def get_builder_cls() -> type[CPUDCPMLAMetadataBuilder]:
        return CPUDCPMLAMetadataBuilder
