# SPDX-License-Identifier: Apache-2.0
"""Tokenspeed MLA under DCP x DSpark (sm100, fp8 KV cache).

Registered over ``TOKENSPEED_MLA`` by the plugin. The Tokenspeed kernel has
native DCP arguments, so a uniform decode batch stays fused: the causal
verify block (``causal_mask=True``) and the non-causal DSpark draft block
(``causal_mask=False``) run as ``[requests, q_len]`` queries with the global
bounds (``causal_seqs``), ``cp_world``, ``cp_rank`` and ``cp_interleave_size``
taken from the per-forward ``DCPDecodeMetadata``. A batch that does not fill
requests x vLLM's query-length bound (CUDA-graph padding, ragged query
lengths) runs as one single-token query per flattened row, bounded by the
row's local length. Under DCP the backend declares host/device query-length
mismatches (adaptive verification) unsupported. The kernel's LSE is base 2;
rows where this rank holds no KV are masked from the metadata (out 0, LSE
-inf), which also covers rows whose per-token bound is 0 while their
request's local length is not; the layers' combines, routed once when the
builder is made, skip their own per-layer mask (``dcp_epilogue``).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from vllm.model_executor.layers.attention.mla_attention import MLACommonMetadata
from vllm.v1.attention.backend import AttentionLayer
from vllm.v1.attention.backends.mla import dcp_config_checks as checks
from vllm.v1.attention.backends.mla.dcp_compat import current_dcp_size
from vllm.v1.attention.backends.mla.dcp_epilogue import finish_rows_decode
from vllm.v1.attention.backends.mla.dcp_metadata import (
    DCPDecodeBuilderMixin,
    DCPDecodeMetadata,
    DCPRowsImplMixin,
)
from vllm.v1.attention.backends.mla.tokenspeed_mla import (
    TokenspeedMLABackend,
    TokenspeedMLAImpl,
    TokenspeedMLAMetadataBuilder,
    _get_workspace,
)


class TokenspeedDCPMLAMetadataBuilder(DCPDecodeBuilderMixin, TokenspeedMLAMetadataBuilder):
    """Tokenspeed builder that fills the DCP rows once per forward.

    Under DCP its decode batches are ``VARLEN`` (``DCPDecodeBuilderMixin``):
    a verify block cut short by the token budget decodes on the rows (the
    impl's per-row path).
    """

    dcp_backend = "TOKENSPEED_MLA"


class TokenspeedDCPMLAImpl(DCPRowsImplMixin, TokenspeedMLAImpl):
    """Tokenspeed decode reading the per-forward DCP metadata."""

    def forward_rows(
        self,
        q: torch.Tensor,
        kv_c_and_k_pe_cache: torch.Tensor,
        decode: DCPDecodeMetadata,
        attn_metadata: MLACommonMetadata,
        layer: AttentionLayer,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Absorbed-MLA decode of ``q`` [N, H, Dv + R] fp8 over this rank's
        fp8 cache [num_blocks, block_size, Dv + R]: the kernel's fused
        ``[R, s]`` query with its own DCP arguments (its
        ``cp_interleave_size``) for a uniform batch, one row per token
        otherwise; both at any --cp-kv-cache-interleave-size.

        Returns:
            ``(out [N, H, Dv], lse [N, H] float32 base 2 or None)``.
        """
        from tokenspeed_mla import tokenspeed_mla_decode

        num_tokens, num_heads = q.shape[0], q.shape[1]
        num_reqs = attn_metadata.num_decodes
        if self.softmax_scale is None:
            self.softmax_scale = self.scale * layer._q_scale_float * layer._k_scale_float
            self.output_scale = layer._k_scale_float

        # vLLM's bound, not the host offsets: no request exceeds it, so R x
        # bound tokens means every real request sits at the bound (in a
        # uniform CUDA graph, zero-length padding requests take the padding
        # tokens and their rows are empty); anything else runs on the rows.
        uniform = num_tokens == num_reqs * decode.max_query_len
        if uniform:
            query = q.view(num_reqs, decode.max_query_len, num_heads, q.shape[-1])
            rows_args = dict(
                block_tables=decode.block_table,
                seq_lens=decode.seq_lens,
                causal_mask=decode.causal,
                causal_seqs=decode.dcp_tot_seq_lens,
                cp_world=decode.layout.world_size,
                cp_rank=decode.layout.rank,
                cp_interleave_size=decode.layout.interleave,
            )
        else:
            rows = decode.flat
            query = q.unsqueeze(1)
            rows_args = dict(
                block_tables=rows.block_table[:num_tokens],
                seq_lens=rows.seq_lens[:num_tokens],
                causal_mask=False,
            )
        out, lse = tokenspeed_mla_decode(
            query=query,
            kv_cache=kv_c_and_k_pe_cache,
            workspace_buffer=_get_workspace(q.device, num_heads, self.kv_lora_rank,
                                            self._min_split_kv,
                                            self._max_decode_tokens),
            kv_lora_rank=self.kv_lora_rank,
            qk_rope_head_dim=self.qk_rope_head_dim,
            max_seq_len=attn_metadata.max_seq_len,
            softmax_scale=self.softmax_scale,
            output_scale=self.output_scale,
            enable_pdl=False,
            return_lse=True,
            min_split_kv=self._min_split_kv,
            **rows_args,
        )
        out = out.view(num_tokens, num_heads, -1)
        lse = lse.view(num_tokens, num_heads)
        return finish_rows_decode(self, out, lse, decode.flat)


class TokenspeedDCPMLABackend(checks.DCPSelection, TokenspeedMLABackend):
    """``TOKENSPEED_MLA`` reading the per-forward DCP metadata; sm100 only."""

    # tokenspeed-mla's fused decode: at most 8 query tokens per request,
    # Kimi-K3's head dims.
    dcp_max_query_len: ClassVar[int] = 8
    dcp_qk_nope_head_dims: ClassVar[tuple[int, ...]] = (128,)
    dcp_v_head_dims: ClassVar[tuple[int, ...]] = (128,)

    @classmethod
    def supports_device_cpu_query_lens_mismatch(cls) -> bool:
        """False under DCP: adaptive verification (device query offsets
        ragged, host ones even) is refused, so the selector picks another
        backend and a forced ``TOKENSPEED_MLA`` fails its config check.

        The builder splits decodes from prefills on the host offsets, and
        its ``UNIFORM_BATCH`` CUDA graphs cannot replay a batch whose device
        offsets are ragged while the host's are even (vLLM's adaptive
        verification refuses them at start-up anyway). With DCP 1 the
        answer is upstream's.
        """
        if current_dcp_size() > 1:
            return False
        return super().supports_device_cpu_query_lens_mismatch()

    @staticmethod
    def get_impl_cls() -> type[TokenspeedDCPMLAImpl]:
        return TokenspeedDCPMLAImpl

    @staticmethod
    def get_builder_cls() -> type[TokenspeedDCPMLAMetadataBuilder]:
        return TokenspeedDCPMLAMetadataBuilder
