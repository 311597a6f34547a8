# SPDX-License-Identifier: Apache-2.0
"""Triton MLA under DCP x DSpark: causal verify and non-causal draft blocks.

Registered over ``TRITON_MLA`` by the plugin: the portable decode path (GPUs
without FlashInfer's FA3 or CuTe DSL MLA: Ampere, Ada, ROCm) and the fallback
everywhere. With DCP every decode query token is one row of the per-forward
``DCPDecodeMetadata`` (its own local KV bound, block-table row and empty
flag), which is what vLLM's ``decode_attention_fwd`` consumes: one program per
row over that row's KV extent. So one code path serves single-token decode,
causal speculative verification, non-causal DSpark draft blocks, ragged
batches and any ``--cp-kv-cache-interleave-size``. The kernel's fp8
dequantization (the layer's ``_k_scale``) and its natural-log LSE are used as
they are; the LSE is kept in float32 for the combine.

Rows where this rank holds no KV are masked from the metadata (out 0, LSE
-inf) and the layers' combines, routed once when the builder is made, skip
their own per-layer mask (``dcp_epilogue``).

CUDA graphs: upstream's ``UNIFORM_BATCH``. The rows are persistent buffers
the builder fills on the device before the graph replays; the kernel reads
them through views of fixed address, its split-KV scratch comes from vLLM's
workspace (upstream's reservation, max_num_seqs x (1 + num_speculative_tokens)
rows once the reorder threshold admits multi-token decodes under DCP), and
any split count gives every row its own exact extent, so the count captured
with the graph is only a performance choice.

With DCP size 1 (or a cache every rank holds whole) the builder, the
selection and the kernel call are upstream's.
"""

from __future__ import annotations

from typing import ClassVar

import torch

import vllm.envs as envs
from vllm.config import VllmConfig
from vllm.model_executor.layers.attention.mla_attention import MLACommonMetadata
from vllm.v1.attention.backend import AttentionLayer
from vllm.v1.attention.backends.mla import dcp_config_checks as checks
from vllm.v1.attention.backends.mla.dcp_epilogue import finish_rows_decode
from vllm.v1.attention.backends.mla.dcp_metadata import (
    DCPDecodeBuilderMixin,
    DCPDecodeMetadata,
    DCPRowsImplMixin,
    rows_of,
)
from vllm.v1.attention.backends.mla.dcp_settings import kv_split_over_dcp
from vllm.v1.attention.backends.mla.triton_mla import (
    TritonMLABackend,
    TritonMLAImpl,
    TritonMLAMetadataBuilder,
    _compute_num_kv_splits,
)
from vllm.v1.attention.ops.triton_decode_attention import decode_attention_fwd
from vllm.v1.kv_cache_interface import AttentionSpec
from vllm.v1.worker.workspace import (
    current_workspace_manager,
    is_workspace_manager_initialized,
)


class TritonDCPMLAMetadataBuilder(DCPDecodeBuilderMixin, TritonMLAMetadataBuilder):
    """Triton-MLA builder that fills the DCP rows once per forward.

    Under DCP the rows take any query-length mix, causal or not, at any
    interleave size: decode batches are ``VARLEN`` and vLLM's DSpark x DCP
    checks pass for the causal target and the non-causal draft. Without DCP
    everything is upstream's (uniform blocks, flattened in ``forward_mqa``).
    """

    # Only consulted with DCP (vLLM's selector and DSpark validation).
    supports_non_causal_multi_token_dcp: ClassVar[bool] = True
    dcp_backend = "TRITON_MLA"

    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
    ) -> None:
        # Read by the base __init__ (reorder threshold, DSpark validation,
        # upstream's workspace reservation), so set before it runs.
        self._dcp_rows_enabled = kv_split_over_dcp(kv_cache_spec, vllm_config)
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def _validate_dspark_dcp_support(self, supports_dcp_with_varlen: bool) -> None:
        super()._validate_dspark_dcp_support(
            supports_dcp_with_varlen or self._dcp_rows_enabled)

    def _init_reorder_batch_threshold(
        self,
        reorder_batch_threshold: int | None = 1,
        supports_spec_as_decode: bool = False,
        supports_dcp_with_varlen: bool = False,
    ) -> None:
        # Under DCP upstream keeps the threshold at 1 (multi-token queries go
        # to prefill); the rows decode them, so they stay decodes.
        super()._init_reorder_batch_threshold(
            reorder_batch_threshold, supports_spec_as_decode,
            supports_dcp_with_varlen or self._dcp_rows_enabled)


class TritonDCPMLAImpl(DCPRowsImplMixin, TritonMLAImpl):
    """Triton-MLA decode over the per-forward DCP rows."""

    # decode_attention_fwd's LSE is e_max + log(e_sum) with exp/log: natural.
    lse_base_on_e: ClassVar[bool] = True

    def forward_rows(
        self,
        q: torch.Tensor,
        kv_c_and_k_pe_cache: torch.Tensor,
        decode: DCPDecodeMetadata,
        attn_metadata: MLACommonMetadata,
        layer: AttentionLayer,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Absorbed-MLA decode of ``q`` [N, H, Dv + R] (model dtype) over this
        rank's cache (bf16/fp16, or fp8 dequantized in the kernel with
        ``layer._k_scale``).

        Returns:
            ``(out [N, H, Dv] in q's dtype, lse [N, H] float32 natural log)``
            (LSE None where vLLM does not ask for it); rows without local KV
            give out 0 and LSE -inf.
        """
        num_rows, num_heads = q.shape[0], q.shape[1]
        rows = rows_of(decode, num_rows)
        out = q.new_empty(num_rows, num_heads, self.kv_lora_rank)
        # float32: the combine weighs the ranks by exp(LSE), and a bf16 LSE
        # (upstream's) is off by up to 1/256 of its value.
        lse = torch.empty(num_rows, num_heads, dtype=torch.float32, device=q.device)
        # Any count is exact (each row splits its own extent); attn_metadata's
        # max_seq_len bounds the local lengths under DCP.
        num_kv_splits = (1 if envs.VLLM_BATCH_INVARIANT else
                         _compute_num_kv_splits(attn_metadata.max_seq_len,
                                                self._sm_count))
        logits_shape = (num_rows, num_heads, num_kv_splits, self.kv_lora_rank + 1)
        if is_workspace_manager_initialized():
            (attn_logits,) = current_workspace_manager().get_simultaneous(
                (logits_shape, torch.float32))
        else:
            attn_logits = torch.empty(logits_shape, dtype=torch.float32,
                                      device=q.device)
        kv_cache = kv_c_and_k_pe_cache.unsqueeze(2)  # one KV head
        decode_attention_fwd(
            q, kv_cache, kv_cache[..., :self.kv_lora_rank], out, lse,
            rows.block_table[:num_rows], rows.seq_lens[:num_rows], attn_logits,
            num_kv_splits, self.scale, kv_cache.size(1),
            k_scale=layer._k_scale, v_scale=layer._k_scale, is_mla=True)
        return finish_rows_decode(self, out, lse, rows)


class TritonDCPMLABackend(checks.DCPLimits, TritonMLABackend):
    """``TRITON_MLA`` with DCP x DSpark rows."""

    dcp_latent: ClassVar[None] = None

    @staticmethod
    def get_impl_cls() -> type[TritonDCPMLAImpl]:
        return TritonDCPMLAImpl

    @staticmethod
    def get_builder_cls() -> type[TritonDCPMLAMetadataBuilder]:
        return TritonDCPMLAMetadataBuilder
