# SPDX-License-Identifier: Apache-2.0
"""FlashInfer's Hopper (FA3) MLA decode on DCP-flattened or grouped rows.

``flashinfer.mla.BatchMLAPagedAttentionWrapper(workspace, backend="fa3")``
takes ragged query offsets and paged-KV CSR metadata and returns the LSE, so
one plan per forward pass over the flattened rows of
:class:`~vllm.v1.attention.ops.dcp_decode.FlatDecode` (one query token per
row, non-causal) serves both causal speculative verification and the
non-causal DSpark draft block under decode context parallelism on sm90.
:class:`~vllm.v1.attention.ops.triton_dcp_metadata.GroupedDecode` rows (a run
of query tokens sharing one local bound) are planned the same way, with the
group's tokens as one ragged query segment.

The adapter plans once per forward (``plan_flat`` / ``plan_grouped`` /
``plan_requests``) and runs once per layer (``run``), returning
``(out [T, H, Dv], lse [T, H])`` per query token with the LSE in natural log
and rows that hold no local KV masked (out 0, lse -inf), ready for
``dcp_decode.merge_partials``.

flashinfer is imported lazily (inside the class), so the module and its CSR
helper import without it. Only ``vllm.v1.attention.ops.dcp_decode`` is
imported from vllm.

Shapes: T query tokens (flattened rows), S planned segments (rows or groups),
H heads, Dv = kv_lora_rank (512), Dr = rope dim (64), P pages,
page = tokens per page, B block-table columns.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from vllm.v1.attention.ops.dcp_decode import FlatDecode

__all__ = [
    "FlashInferSm90MLA",
    "PagedKVCSR",
    "build_paged_kv_csr",
    "token_empty_mask",
]

LN2 = math.log(2.0)


@dataclass
class PagedKVCSR:
    """Paged-KV CSR metadata of S attention segments.

    Attributes:
        kv_indptr: int32 [S + 1], ``cumsum(ceil(kv_lens / page))``.
        kv_indices: int32 [S * B], segment ``s``'s pages at
            ``kv_indices[kv_indptr[s] : kv_indptr[s + 1]]``; entries past
            ``kv_indptr[-1]`` are unused (left 0) so that the size is static.
        kv_lens: int32 [S], KV tokens per segment.
    """

    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_lens: torch.Tensor


def build_paged_kv_csr(
    kv_lens: torch.Tensor, block_table: torch.Tensor, page_size: int
) -> PagedKVCSR:
    """CSR page lists from a dense block table, without host syncs.

    Args:
        kv_lens: int32 [S] tokens each segment attends to (0 allowed).
        block_table: int32 [S, B] page ids of each segment.
        page_size: tokens per page.

    Returns:
        PagedKVCSR on ``block_table``'s device; ``kv_indices`` has S * B slots.
    """
    num_segments, num_cols = block_table.shape
    device = block_table.device
    pages = (kv_lens.to(torch.int32) + page_size - 1) // page_size
    pages = pages.clamp(max=num_cols)
    kv_indptr = torch.zeros(num_segments + 1, dtype=torch.int32, device=device)
    torch.cumsum(pages, 0, out=kv_indptr[1:])
    cols = torch.arange(num_cols, dtype=torch.int32, device=device)
    live = cols[None, :] < pages[:, None]  # [S, B]
    # Live slot (s, c) goes to kv_indptr[s] + c; dead slots are dumped in a
    # spare slot past the end and dropped.
    dest = torch.where(live, kv_indptr[:-1, None] + cols[None, :],
                       num_segments * num_cols)
    kv_indices = torch.zeros(num_segments * num_cols + 1, dtype=torch.int32,
                             device=device)
    kv_indices.scatter_(0, dest.reshape(-1).long(),
                        block_table.to(torch.int32).reshape(-1))
    return PagedKVCSR(kv_indptr=kv_indptr,
                      kv_indices=kv_indices[: num_segments * num_cols],
                      kv_lens=kv_lens.to(torch.int32))


def token_empty_mask(
    query_start_loc: torch.Tensor, kv_lens: torch.Tensor, num_tokens: int
) -> torch.Tensor:
    """Per query token: True where its segment has no KV or it is padding.

    Args:
        query_start_loc: int32 [S + 1] ragged query offsets of the segments.
        kv_lens: int32 [S] KV tokens of each segment.
        num_tokens: T, query rows of the output (may exceed
            ``query_start_loc[-1]``: the extra rows are padding).

    Returns:
        bool [T].
    """
    device = kv_lens.device
    tokens = torch.arange(num_tokens, dtype=torch.int32, device=device)
    seg = torch.searchsorted(query_start_loc[1:].contiguous(), tokens,
                             right=True, out_int32=True)
    is_real = seg < kv_lens.shape[0]
    seg = seg.clamp(max=max(kv_lens.shape[0] - 1, 0))
    has_kv = kv_lens[seg] > 0 if kv_lens.numel() else torch.zeros_like(is_real)
    return ~(is_real & has_kv)


class FlashInferSm90MLA:
    """Absorbed-MLA decode on sm90 through FlashInfer's FA3 MLA wrapper.

    One plan per forward pass, one ``run`` per layer::

        mla = FlashInferSm90MLA(workspace, num_heads=H, page_size=64,
                                sm_scale=s, dtype=torch.bfloat16)
        mla.plan_flat(flat)                 # once per forward
        out, lse = mla.run(q, kv_cache)     # per layer

    Args:
        workspace: uint8 CUDA buffer for FlashInfer (128 MiB is usual).
        num_heads: H query heads on this rank.
        page_size: tokens per KV page.
        sm_scale: softmax scale applied to ``q . k``.
        dtype: query and KV dtype (bf16 / fp16).
        kv_lora_rank: Dv, the latent (value) width.
        rope_dim: Dr, the rope width (key = Dv + Dr).
    """

    def __init__(
        self,
        workspace: torch.Tensor,
        *,
        num_heads: int,
        page_size: int,
        sm_scale: float,
        dtype: torch.dtype = torch.bfloat16,
        kv_lora_rank: int = 512,
        rope_dim: int = 64,
    ) -> None:
        from flashinfer.mla import BatchMLAPagedAttentionWrapper

        self._wrapper = BatchMLAPagedAttentionWrapper(workspace, backend="fa3")
        self.num_heads = num_heads
        self.page_size = page_size
        self.sm_scale = sm_scale
        self.dtype = dtype
        self.kv_lora_rank = kv_lora_rank
        self.rope_dim = rope_dim
        self.num_tokens = 0
        self.token_empty: torch.Tensor | None = None
        self.csr: PagedKVCSR | None = None

    # ---------------------------------------------------------------- plans
    def _plan(self, qo_indptr: torch.Tensor, csr: PagedKVCSR, *, causal: bool,
              num_tokens: int, token_empty: torch.Tensor) -> None:
        from flashinfer.mla import MLAPlanMetadata

        self._wrapper.plan(
            metadata=MLAPlanMetadata.csr(
                qo_indptr=qo_indptr.to(torch.int32),
                kv_indptr=csr.kv_indptr,
                kv_indices=csr.kv_indices,
                kv_len_arr=csr.kv_lens,
            ),
            num_heads=self.num_heads,
            head_dim_ckv=self.kv_lora_rank,
            head_dim_kpe=self.rope_dim,
            page_size=self.page_size,
            causal=causal,
            sm_scale=self.sm_scale,
            q_data_type=self.dtype,
            kv_data_type=self.dtype,
            lse_mode="base2",
        )
        self.csr = csr
        self.num_tokens = num_tokens
        self.token_empty = token_empty

    def plan_flat(self, flat: FlatDecode) -> None:
        """Plan one non-causal segment per flattened row (N rows, N tokens)."""
        csr = build_paged_kv_csr(flat.seq_lens, flat.block_table, self.page_size)
        self._plan(flat.query_start_loc, csr, causal=False,
                   num_tokens=flat.num_rows, token_empty=flat.empty)

    def plan_grouped(self, grouped, num_tokens: int) -> None:
        """Plan one non-causal segment per row group.

        Args:
            grouped: ``triton_dcp_metadata.GroupedDecode`` (G_max groups);
                ``num_groups`` is read on the host (plan syncs anyway).
            num_tokens: T, query rows of ``run``'s input (the flat row count).
        """
        num_groups = int(grouped.num_groups[0])
        groups = grouped.slice(num_groups)
        csr = build_paged_kv_csr(groups.seq_lens, groups.block_table,
                                 self.page_size)
        empty = token_empty_mask(groups.query_start_loc, groups.seq_lens,
                                 num_tokens)
        self._plan(groups.query_start_loc, csr, causal=False,
                   num_tokens=num_tokens, token_empty=empty)

    def plan_requests(self, query_start_loc: torch.Tensor, kv_lens: torch.Tensor,
                      block_table: torch.Tensor, *, causal: bool) -> None:
        """Plan FlashInfer's own multi-token decode, one segment per request.

        With ``causal`` the queries of a request are bottom-right aligned on
        its KV (FlashInfer's convention), which is the no-DCP speculative
        verify; used as the baseline in benchmarks.
        """
        csr = build_paged_kv_csr(kv_lens, block_table, self.page_size)
        num_tokens = int(query_start_loc[-1])
        empty = token_empty_mask(query_start_loc, kv_lens, num_tokens)
        self._plan(query_start_loc, csr, causal=causal, num_tokens=num_tokens,
                   token_empty=empty)

    # ------------------------------------------------------------------ run
    def run(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        *,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
        mask_empty: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of the planned segments for one layer.

        Args:
            q: [T, H, Dv + Dr] queries (absorbed latent part, then rope part).
            kv_cache: [P, page, Dv + Dr] paged latent cache of this rank.
            out, lse: optional [T, H, Dv] / float32 [T, H] output buffers.
            mask_empty: zero ``out`` and set ``lse = -inf`` on rows with no
                local KV (and padding rows).

        Returns:
            ``(out [T, H, Dv] in q's dtype, lse [T, H] float32, natural log)``.
        """
        assert self.token_empty is not None, "plan first"
        num_tokens = q.shape[0]
        assert num_tokens == self.num_tokens, (num_tokens, self.num_tokens)
        if out is None:
            out = q.new_empty(num_tokens, q.shape[1], self.kv_lora_rank)
        if lse is None:
            lse = torch.empty(num_tokens, q.shape[1], dtype=torch.float32,
                              device=q.device)
        self._wrapper.run(query=q, kv_cache=kv_cache, out=out, lse=lse,
                          return_lse=True)
        lse.mul_(LN2)  # FlashInfer's MLA LSE is base 2
        if mask_empty:
            empty = self.token_empty
            out.masked_fill_(empty[:, None, None], 0.0)
            lse.masked_fill_(empty[:, None], float("-inf"))
        return out, lse
