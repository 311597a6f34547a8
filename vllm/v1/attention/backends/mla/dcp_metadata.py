# SPDX-License-Identifier: Apache-2.0
"""Per-forward DCP decode metadata for MLA backends.

Under decode context parallelism every rank holds an interleaved slice of each
sequence's KV cache. A multi-token decode query (causal speculative verify or a
non-causal DSpark draft block) then needs, per rank and per query token, its
own local KV bound. ``DCPDecodeBuilderMixin`` computes these once per forward
pass, in the metadata builder, and every MLA layer of the KV-cache group plus
the DCP combine read the same ``DCPDecodeMetadata`` object.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Protocol

import torch

from vllm.distributed.parallel_state import get_dcp_group
from vllm.model_executor.layers.attention.mla_attention import (
    MLACommonDecodeMetadata,
)
from vllm.v1.attention.backends.mla.dcp_compat import get_block_table_width
from vllm.v1.attention.ops import dcp_decode
from vllm.v1.attention.ops.dcp_decode import DCPLayout, FlatDecode


class RowDecodePlan(Protocol):
    """A kernel object planned by the metadata builder once per forward from
    host data and run by every layer (``FlashInferSm90MLA``)."""

    sm_scale: float
    planned_forward_id: int  # the ``forward_id`` of its last plan

    def run(self, q: torch.Tensor,
            kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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
            lens, ``arange`` query start locs, expanded block table,
            ``row_to_req``, global causal bounds and the ``empty`` mask. See
            ``vllm.v1.attention.ops.dcp_decode.FlatDecode``.
        query_start_loc: int32 [R + 1], the decode requests' query offsets.
        causal: True for speculative verify (each token sees its prefix), False
            for a non-causal DSpark draft block (every token sees the block).
        max_query_len: the bound vLLM promises on every decode request's
            query length (the builder's argument); the device offsets may be
            ragged below it even where the host offsets are uniform.
        layout: the DCP split the rows were built for, seen from this rank.
        forward_id: distinct for every ``build``.
        plan: the kernel object the builder planned for this forward, which
            every layer only runs (sm90 FLASHINFER_MLA); None where the
            layers call their kernel directly.
    """

    flat: FlatDecode
    query_start_loc: torch.Tensor
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
    The flattened rows are written into persistent buffers allocated at
    init from vLLM's bounds (decode tokens of a full batch x the block-table
    width vLLM uses for this cache), so a CUDA graph captured over ``build``
    replays into the same memory; a batch beyond them raises. The build makes
    no host sync. On CUDA one fused Triton
    launch fills them; elsewhere the torch path of the ops layer does.
    """

    rows_without_dcp: bool = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._init_dcp_rows()

    def _init_dcp_rows(self) -> None:
        """State of the mixin; call it from an ``__init__`` that bypasses
        the mixin's own."""
        self.dcp_rank = get_dcp_group().rank_in_group if self.dcp_world_size > 1 else 0
        self.dcp_layout = DCPLayout(self.dcp_world_size, self.dcp_rank,
                                    self.cp_kv_cache_interleave_size)
        self._dcp_causal = True
        self._dcp_forward_ids = itertools.count(1)
        # Sized once, before any CUDA graph is captured: a graph replays
        # into these exact tensors.
        self._dcp_rows: FlatDecode | None = None
        if self.dcp_world_size > 1 or self.rows_without_dcp:
            self._dcp_rows = dcp_decode.alloc_flat_decode(
                self._dcp_row_capacity(), self._dcp_block_table_width(), self.device)

    def _dcp_query_len_bound(self) -> int:
        """Longest decode query: 1 + num_speculative_tokens, or the decode
        threshold of the batch reorder if that is larger."""
        spec = self.vllm_config.speculative_config
        num_spec = (spec.num_speculative_tokens or 0) if spec is not None else 0
        return max(1 + num_spec, self.reorder_batch_threshold or 1)

    def _dcp_row_capacity(self) -> int:
        """Most decode query tokens one forward can carry, from vLLM's bounds.

        At most ``max_num_seqs`` decode requests of at most
        ``1 + num_speculative_tokens`` tokens, within the token budget
        ``max_num_batched_tokens`` (vLLM's own cap on decode tokens); a CUDA
        graph pads a decode-only batch up to a capture size, at most
        ``max_cudagraph_capture_size``.
        """
        sched = self.vllm_config.scheduler_config
        decode_tokens = min(sched.max_num_batched_tokens,
                            sched.max_num_seqs * self._dcp_query_len_bound())
        capture = self.vllm_config.compilation_config.max_cudagraph_capture_size
        return max(decode_tokens, capture or 0)

    def _dcp_block_table_width(self) -> int:
        """Columns of the block table vLLM hands this builder.

        The worker's block table (``MultiGroupBlockTable`` / MRV2's
        ``BlockTables``) is ``max_num_blocks_per_req(max_model_len)`` of the
        group's spec (DCP-sharded: ``max_model_len / (block_size x DCP)``)
        aligned to 128 tokens by ``get_block_table_width``, in kernel blocks
        when the backend pages finer than the group (``AttentionGroup``).
        This builder only sees the kernel-block spec, so the group's block
        size is taken as the cache's when it is a multiple, and the wider
        of the two readings is kept.
        """
        spec = self.kv_cache_spec
        max_model_len = self.vllm_config.model_config.max_model_len
        kernel_block = spec.block_size
        group_blocks = {kernel_block}
        cache_block = self.vllm_config.cache_config.block_size
        if cache_block and cache_block % kernel_block == 0:
            group_blocks.add(cache_block)
        widths = []
        for group_block in group_blocks:
            group_spec = spec.copy_with_new_block_size(group_block)
            blocks = group_spec.max_num_blocks_per_req(self.vllm_config, max_model_len)
            widths.append(get_block_table_width(blocks, group_block)
                          * (group_block // kernel_block))
        return max(widths)

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
                f"{sched.max_num_seqs * self._dcp_query_len_bound()}, capped at "
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
            layout=self.dcp_layout,
            causal=self._dcp_causal,
            num_rows=num_decode_tokens,
            out=out,
        )
        return DCPDecodeMetadata(
            block_table=block_table_tensor,
            seq_lens=seq_lens_device,
            dcp_tot_seq_lens=dcp_tot_seq_lens_device,
            flat=flat,
            query_start_loc=query_start_loc_device,
            causal=self._dcp_causal,
            # vLLM's promise, not a measurement of the host offsets: under
            # adaptive verification those are even while the device ones are
            # ragged, and a CUDA graph must be sized for the bound.
            max_query_len=max_query_len,
            layout=self.dcp_layout,
            forward_id=next(self._dcp_forward_ids),
        )
