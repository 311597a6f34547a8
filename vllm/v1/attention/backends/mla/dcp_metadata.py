# SPDX-License-Identifier: Apache-2.0
"""Per-forward DCP decode metadata for MLA backends.

Under decode context parallelism every rank holds an interleaved slice of each
sequence's KV cache. A multi-token decode query (causal speculative verify or a
non-causal DSpark draft block) then needs, per rank and per query token, its
own local KV bound. ``DCPDecodeBuilderMixin`` computes these once per forward
pass, in the metadata builder, and every MLA layer of the KV-cache group plus
the DCP combine read the same ``DCPDecodeMetadata`` object;
``DCPRowsImplMixin`` is the impls' side: their decode on those rows.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch

from vllm.distributed.parallel_state import get_dcp_group
from vllm.model_executor.layers.attention.mla_attention import (
    MLACommonDecodeMetadata,
    QueryLenSupport,
)
from vllm.v1.attention.backends.mla import dcp_config_checks as checks
from vllm.v1.attention.backends.mla.dcp_epilogue import route_combines_through_rows
from vllm.v1.attention.backends.mla.dcp_settings import (
    DCPSetting,
    kv_split_over_dcp,
    layer_roles,
)
from vllm.v1.attention.ops import dcp_decode
from vllm.v1.attention.ops.dcp_decode import DCPLayout, FlatDecode


class RowDecodePlan(Protocol):
    """A kernel object planned by the metadata builder once per forward and
    run by every layer: sm90 FLASHINFER_MLA's ``FlashInferSm90MLA`` (planned
    from host data), FLASHMLA's ``FlashMLARowPlan`` (planned on the device;
    its ``run`` also takes the layer's softmax and fp8 scales)."""

    planned_forward_id: int  # the ``forward_id`` of its last plan

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor,
            **layer_args) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out [T, H, Dv], lse [T, H] float32, natural log)`` of the
        planned rows for one layer."""
        ...


@dataclass
class DCPDecodeMetadata(MLACommonDecodeMetadata):
    """MLA decode metadata with this rank's flattened DCP rows.

    The inherited fields keep upstream's per-request meaning: ``block_table``
    [R, B] and ``seq_lens`` [R] (local KV tokens of each request on this rank),
    ``dcp_tot_seq_lens`` [R] (global lengths).

    Attributes:
        flat: one row per decode query token (N = decode tokens): local seq
            lens, expanded block table, ``row_to_req`` and the ``empty``
            mask. See ``vllm.v1.attention.ops.dcp_decode.FlatDecode``.
        causal: True for speculative verify (each token sees its prefix), False
            for a non-causal DSpark draft block (every token sees the block).
        max_query_len: the bound vLLM promises on every decode request's
            query length (the builder's argument); the device offsets may be
            ragged below it even where the host offsets are uniform.
        layout: the DCP split the rows were built for, seen from this rank.
        forward_id: distinct for every ``build``.
        plan: the kernel object the builder planned for this forward, which
            every layer only runs (sm90 FLASHINFER_MLA, FLASHMLA); None where the
            layers call their kernel directly.
    """

    flat: FlatDecode
    causal: bool
    max_query_len: int
    layout: DCPLayout
    forward_id: int = 0
    plan: RowDecodePlan | None = None



class DCPDecodeBuilderMixin:
    """Mixin for ``MLACommonMetadataBuilder`` subclasses: fills
    ``DCPDecodeMetadata`` once per ``build`` when DCP size > 1.

    Put it first in the bases: ``class B(DCPDecodeBuilderMixin, XBuilder)``.
    With DCP size 1 the builder's own decode metadata is returned unchanged,
    unless ``rows_without_dcp`` is set (a kernel that only runs on rows).
    Where it builds rows it reads once the ``DCPSetting`` of the forwards it
    builds (the target's, or the draft's: ``is_draft_group``), checks the
    setting of each model whose layers it serves (``dcp_backend``; vLLM may
    group target and draft layers together) and, under DCP, routes the
    layers' combines through the rows' empty mask (``dcp_epilogue``).
    The flattened rows are written into persistent buffers allocated at
    init from vLLM's bounds (decode tokens of a full batch x the block-table
    width vLLM uses for this cache), so a CUDA graph captured over ``build``
    replays into the same memory; a batch beyond them raises. The build makes
    no host sync. On CUDA one fused Triton
    launch fills them; elsewhere the torch path of the ops layer does.
    """

    rows_without_dcp: bool = False
    # The ``dcp_config_checks`` backend name whose problems the builder
    # raises for its group's setting; None: checked at start-up only.
    dcp_backend: str | None = None

    def __init__(self, kv_cache_spec, layer_names: list[str], vllm_config, device,
                 *args, **kwargs) -> None:
        if kv_split_over_dcp(kv_cache_spec, vllm_config):
            # Per builder (as vLLM's ROCm AITER MLA builder sets it), read by
            # the base __init__ and every build's decode/prefill split: the
            # rows decode any mix of speculative block lengths, a verify
            # block cut short by the token budget included. UNIFORM would
            # hand a short block to the prefill path, which sizes its context
            # from the host's upper bound of the sequence length.
            self.query_len_support = QueryLenSupport.VARLEN  # type: ignore[misc]
        super().__init__(kv_cache_spec, layer_names, vllm_config, device,
                         *args, **kwargs)
        self._init_dcp_rows(layer_names)

    def _init_dcp_rows(self, layer_names: list[str]) -> None:
        """State of the mixin; call it from an ``__init__`` that bypasses
        the mixin's own."""
        self._dcp_causal = True
        self._dcp_forward_ids = itertools.count(1)
        self._dcp_layer_names = list(layer_names)
        self._dcp_softmax_scale: float | None = None
        # Sized once, before any CUDA graph is captured: a graph replays
        # into these exact tensors.
        self._dcp_rows: FlatDecode | None = None
        # None where the builder is upstream's (DCP size 1, no rows).
        self.dcp_setting: DCPSetting | None = None
        if self.dcp_world_size > 1 or self.rows_without_dcp:
            rank = get_dcp_group().rank_in_group if self.dcp_world_size > 1 else 0
            gpu_major = checks.current_gpu_major()
            setting = DCPSetting.for_builder(self, layer_names, gpu_major, rank)
            if self.dcp_backend is not None:
                # Each layer's model's own setting (verify of 1 + k, or the
                # draft's block), also where vLLM grouped both models' layers.
                for draft in {setting.draft, *layer_roles(self.vllm_config,
                                                          layer_names)}:
                    checks.raise_if_unsupported(
                        checks.plugin_backend(self.dcp_backend),
                        setting if draft == setting.draft else
                        DCPSetting.for_builder(self, layer_names, gpu_major,
                                               rank, draft=draft),
                        kernel_blocks=False)
            self.dcp_setting = setting
            self._dcp_rows = dcp_decode.alloc_flat_decode(
                setting.row_capacity, setting.block_table_width, self.device)
        if self.dcp_world_size > 1:
            route_combines_through_rows(self.vllm_config, layer_names)

    def _group_softmax_scale(self, what: str) -> float:
        """The softmax scale of the group's layers, read off their impls (as
        vLLM's FlashInfer builder does), for a kernel planned once for every
        layer; ``what`` names that kernel in the error. Read once (the
        layers' impls exist by the first plan), not per forward."""
        if self._dcp_softmax_scale is None:
            context = self.vllm_config.compilation_config.static_forward_context
            scales = {getattr(getattr(context[name], "impl", None), "scale", None)
                      for name in self._dcp_layer_names}
            if len(scales) != 1 or None in scales:
                raise ValueError(
                    f"{what} plans one softmax scale per KV-cache group; its layers "
                    f"have {sorted(map(str, scales))}")
            self._dcp_softmax_scale = scales.pop()
        return self._dcp_softmax_scale

    def _dcp_row_buffers(self, num_rows: int, num_blocks: int) -> FlatDecode:
        """The persistent rows; a batch beyond them is a configuration error,
        never a fresh tensor (a captured graph would keep the old one)."""
        rows = self._dcp_rows
        assert rows is not None
        if num_rows > rows.num_rows:
            sched = self.vllm_config.scheduler_config
            raise ValueError(
                f"A DCP decode batch of {num_rows} query tokens exceeds the "
                f"{rows.num_rows} rows sized at start-up from max_num_seqs "
                f"({sched.max_num_seqs}) x (1 + num_speculative_tokens) = "
                f"{sched.max_num_seqs * (1 + self.dcp_setting.num_speculative_tokens)}"
                ", capped at "
                f"max_num_batched_tokens ({sched.max_num_batched_tokens}), or "
                "max_cudagraph_capture_size: raise --max-num-seqs or "
                "--max-num-batched-tokens.")
        if num_blocks > rows.block_table.shape[1]:
            raise ValueError(
                f"A block table of {num_blocks} columns is wider than the "
                f"{rows.block_table.shape[1]} sized at start-up from "
                f"max_model_len ({self.vllm_config.model_config.max_model_len}), "
                f"block size {self.kv_cache_spec.block_size} and DCP size "
                f"{self.dcp_world_size}: raise --max-model-len.")
        return rows

    def _dcp_rows_builder(self):
        if self.device.type == "cuda":
            from vllm.v1.attention.ops.triton_dcp_metadata import (
                build_flat_decode_triton,
            )

            return build_flat_decode_triton
        return dcp_decode.build_flat_decode

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        self._dcp_causal = common_attn_metadata.causal is not False
        return super().build(common_prefix_len, common_attn_metadata, fast_build)

    def _build_decode(
        self,
        block_table_tensor: torch.Tensor,
        seq_lens_device: torch.Tensor,
        max_seq_len: int,
        query_start_loc_cpu: torch.Tensor,
        query_start_loc_device: torch.Tensor,
        num_decode_tokens: int,
        max_query_len: int,
        dcp_tot_seq_lens_device: torch.Tensor | None,
    ) -> MLACommonDecodeMetadata:
        if self.dcp_world_size == 1 and not self.rows_without_dcp:
            return super()._build_decode(
                block_table_tensor=block_table_tensor,
                seq_lens_device=seq_lens_device,
                max_seq_len=max_seq_len,
                query_start_loc_cpu=query_start_loc_cpu,
                query_start_loc_device=query_start_loc_device,
                num_decode_tokens=num_decode_tokens,
                max_query_len=max_query_len,
                dcp_tot_seq_lens_device=dcp_tot_seq_lens_device,
            )
        if dcp_tot_seq_lens_device is None:  # DCP size 1: local is global
            dcp_tot_seq_lens_device = seq_lens_device
        out = self._dcp_row_buffers(num_decode_tokens, block_table_tensor.shape[1])
        flat = self._dcp_rows_builder()(
            dcp_tot_seq_lens_device,
            query_start_loc_device,
            block_table_tensor,
            layout=self.dcp_setting.layout,
            causal=self._dcp_causal,
            num_rows=num_decode_tokens,
            out=out,
        )
        return DCPDecodeMetadata(
            block_table=block_table_tensor,
            seq_lens=seq_lens_device,
            dcp_tot_seq_lens=dcp_tot_seq_lens_device,
            flat=flat,
            causal=self._dcp_causal,
            # vLLM's promise, not a measurement of the host offsets: under
            # adaptive verification those are even while the device ones are
            # ragged, and a CUDA graph must be sized for the bound.
            max_query_len=max_query_len,
            layout=self.dcp_setting.layout,
            forward_id=next(self._dcp_forward_ids),
        )


class DCPRowsImplMixin:
    """An MLA impl whose ``forward_mqa`` decodes on the forward's rows
    (``DCPDecodeMetadata``, made by its ``DCPDecodeBuilderMixin`` builder)
    and is its base class's for any other decode metadata (no DCP, or a
    uniform batch the builder left to upstream).

    Subclasses put it before the vLLM impl they extend and implement
    ``forward_rows``, whose rows without local KV must come out with LSE
    -inf and output 0 (``dcp_epilogue.finish_rows_decode``, or the kernel's
    own last launch).
    """

    # Every query token has its own local bound, so causal verify and draft
    # blocks work at any --cp-kv-cache-interleave-size (vLLM's
    # check_attention_cp_compatibility reads this).
    supports_mtp_with_cp_non_trivial_interleave_size: ClassVar[bool] = True

    def forward_mqa(self, q, kv_c_and_k_pe_cache: torch.Tensor, attn_metadata, layer):
        """Absorbed-MLA decode of this forward's decode tokens.

        Args:
            q: [N, H, Dv + R] (or the ``(q_nope [N, H, Dv], q_pe [N, H, R])``
                pair); H is every head of the DCP group after vLLM's query
                gather.
            kv_c_and_k_pe_cache: [num_blocks, block_size, Dv + R] this
                rank's cache.

        Returns:
            ``(out [N, H, Dv], lse [N, H] float32 or None)``: see
            ``forward_rows`` for the LSE's base.
        """
        decode = attn_metadata.decode
        if not isinstance(decode, DCPDecodeMetadata):
            return self.forward_mqa_without_rows(q, kv_c_and_k_pe_cache,
                                                 attn_metadata, layer)
        if isinstance(q, tuple):
            q = torch.cat(q, dim=-1)
        return self.forward_rows(q, kv_c_and_k_pe_cache, decode, attn_metadata, layer)

    def forward_mqa_without_rows(self, q, kv_c_and_k_pe_cache, attn_metadata, layer):
        return super().forward_mqa(q, kv_c_and_k_pe_cache, attn_metadata, layer)

    def forward_rows(self, q: torch.Tensor, kv_c_and_k_pe_cache: torch.Tensor,
                     decode: DCPDecodeMetadata, attn_metadata, layer):
        """The decode of ``q`` [N, H, Dv + R] on ``decode``'s rows."""
        raise NotImplementedError


def rows_of(decode: DCPDecodeMetadata, num_tokens: int) -> FlatDecode:
    """``decode``'s rows for a kernel that reads one row per query token."""
    if decode.flat.num_rows < num_tokens:
        raise ValueError(f"{num_tokens} decode query tokens but the metadata "
                         f"has {decode.flat.num_rows} rows")
    return decode.flat
