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
group's tokens as one ragged query segment. For causal verify,
``plan_causal_prefix`` plans one segment per request over its first token's
local bound (the KV is read once, as in FlashInfer's own multi-token decode)
and ``causal_tail_merge`` (Triton) adds each token's at most ``q_len - 1``
remaining local keys and merges the two partials.

The adapter plans once per forward (``plan_flat`` / ``plan_grouped`` /
``plan_causal_prefix`` / ``plan_requests``) and runs once per layer
(``run``), returning
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

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the prefix+tail path needs Triton
    triton = None

__all__ = [
    "FlashInferSm90MLA",
    "causal_tail_merge",
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


if triton is not None:

    @triton.jit
    def _causal_tail_merge_kernel(
        q_ptr, q_stride_t, q_stride_h,
        kv_ptr, kv_stride_p, kv_stride_s,
        bt_ptr, bt_stride,
        tail_rows_ptr, row_lens_ptr, prefix_lens_ptr,
        out_ptr, lse_ptr,
        num_heads, page_size, sm_scale,
        DV: tl.constexpr, DR: tl.constexpr,
        BLOCK_H: tl.constexpr, KEYS: tl.constexpr, PRECISION: tl.constexpr,
    ):
        """Program = (row t = tail_rows[pid], BLOCK_H heads): attend to local
        keys [prefix_len, row_len) (at most KEYS) and merge with the prefix
        partial already in out / lse (natural-log LSE in and out)."""
        t = tl.load(tail_rows_ptr + tl.program_id(0))
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        h_ok = heads < num_heads
        row_len = tl.load(row_lens_ptr + t)
        prefix_len = tl.load(prefix_lens_ptr + t)
        # Rows without tail keys only rescale the LSE (and zero empty rows):
        # every load below is predicated off for them.
        no_keys = tl.zeros_like(heads) + row_len
        has_tail = no_keys > prefix_len  # [BLOCK_H], all equal
        is_empty = no_keys == 0
        keys = prefix_len + tl.arange(0, KEYS)
        k_ok = keys < row_len
        page = tl.load(bt_ptr + t.to(tl.int64) * bt_stride + keys // page_size,
                       mask=k_ok, other=0)
        slot = page.to(tl.int64) * kv_stride_p + (keys % page_size) * kv_stride_s
        dv = tl.arange(0, DV)
        dr = tl.arange(0, DR)
        k_c = tl.load(kv_ptr + slot[:, None] + dv[None, :], mask=k_ok[:, None],
                      other=0.0)
        k_r = tl.load(kv_ptr + slot[:, None] + DV + dr[None, :],
                      mask=k_ok[:, None], other=0.0)
        q_row = q_ptr + t.to(tl.int64) * q_stride_t + heads[:, None] * q_stride_h
        q_ok = (h_ok & has_tail)[:, None]
        q_c = tl.load(q_row + dv[None, :], mask=q_ok, other=0.0)
        q_r = tl.load(q_row + DV + dr[None, :], mask=q_ok, other=0.0)
        # fp32 operands: bf16 values are exact in tf32, so the default "tf32"
        # keeps bf16 products exact; fp32 inputs ask for "ieee".
        scores = (tl.dot(q_c.to(tl.float32), tl.trans(k_c.to(tl.float32)),
                         input_precision=PRECISION)
                  + tl.dot(q_r.to(tl.float32), tl.trans(k_r.to(tl.float32)),
                           input_precision=PRECISION))
        scores = tl.where(k_ok[None, :], scores * sm_scale, float("-inf"))
        m_tail = tl.max(scores, axis=1)
        m_tail = tl.where(m_tail == float("-inf"), 0.0, m_tail)
        probs = tl.exp(scores - m_tail[:, None])  # 0 on masked keys
        sum_tail = tl.sum(probs, axis=1)
        o_tail = tl.dot(probs, k_c.to(tl.float32), input_precision=PRECISION)  # [BLOCK_H, DV] unnormalised
        o_tail = o_tail / tl.where(sum_tail > 0, sum_tail, 1.0)[:, None]
        lse_tail = tl.where(sum_tail > 0, m_tail + tl.log(sum_tail),
                            float("-inf"))

        has_prefix = (tl.zeros_like(heads) + prefix_len) > 0  # [BLOCK_H]
        out_rows = (t.to(tl.int64) * num_heads + heads)
        lse_pre = tl.load(lse_ptr + out_rows, mask=h_ok & has_prefix,
                          other=float("-inf"))
        o_pre = tl.load(out_ptr + out_rows[:, None] * DV + dv[None, :],
                        mask=(h_ok & has_prefix & has_tail)[:, None], other=0.0)
        lse_max = tl.maximum(lse_pre, lse_tail)
        lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
        w_pre = tl.exp(lse_pre - lse_max)
        w_tail = tl.exp(lse_tail - lse_max)
        total = w_pre + w_tail
        norm = tl.where(total > 0, total, 1.0)
        merged = (w_pre[:, None] * o_pre.to(tl.float32)
                  + w_tail[:, None] * o_tail) / norm[:, None]
        tl.store(out_ptr + out_rows[:, None] * DV + dv[None, :],
                 merged.to(out_ptr.dtype.element_ty),
                 mask=(h_ok & (has_tail | is_empty))[:, None])
        tl.store(lse_ptr + out_rows,
                 tl.where(total > 0, lse_max + tl.log(total), float("-inf")),
                 mask=h_ok)


def causal_tail_merge(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    row_lens: torch.Tensor,
    prefix_lens: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    sm_scale: float,
    max_tail: int = 16,
    tail_rows: torch.Tensor | None = None,
) -> None:
    """Finish prefix+tail causal decode in place (one Triton launch).

    Each query row ``t`` must attend to local keys ``[0, row_lens[t])``;
    ``out`` / ``lse`` already hold its attention over ``[0, prefix_lens[t])``
    (``lse`` in base 2, as FlashInfer returns it; ignored where
    ``prefix_lens == 0``). This attends to the tail keys
    ``[prefix_lens[t], row_lens[t])`` (at most ``max_tail``), merges, and
    leaves the natural-log LSE; rows with no keys get out 0, lse -inf.

    Args:
        q: [T, H, Dv + Dr] queries. kv_cache: [P, page, Dv + Dr].
        block_table: int32 [T, B] per-row local block table.
        row_lens, prefix_lens: int32 [T].
        out: [T, H, Dv] (contiguous), lse: float32 [T, H] (contiguous).
        tail_rows: int32 [T'] rows to process (default all T); rows left out
            must already be final (no tail keys).
    """
    num_tokens, num_heads, width = q.shape
    dv = out.shape[-1]
    block_h = 16
    keys = max(triton.next_power_of_2(max_tail), 16)
    if tail_rows is None:
        tail_rows = torch.arange(num_tokens, dtype=torch.int32, device=q.device)
    if tail_rows.numel() == 0:
        return
    grid = (tail_rows.numel(), triton.cdiv(num_heads, block_h))
    _causal_tail_merge_kernel[grid](
        q, q.stride(0), q.stride(1),
        kv_cache, kv_cache.stride(0), kv_cache.stride(1),
        block_table, block_table.stride(0),
        tail_rows, row_lens, prefix_lens, out, lse,
        num_heads, kv_cache.shape[1], sm_scale,
        DV=dv, DR=width - dv, BLOCK_H=block_h, KEYS=keys,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=8,
    )


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
        self.tail: tuple | None = None

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
        # Plan syncs anyway: keep the (few) empty rows as an index list so
        # that masking touches only them.
        self.empty_rows = torch.nonzero(token_empty).flatten()
        self.tail = None

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

    def plan_causal_prefix(self, flat: FlatDecode,
                           query_start_loc: torch.Tensor) -> None:
        """Plan causal rows as a shared prefix plus a short per-token tail.

        Under DCP a request's per-token local bounds ``l_0 <= .. <= l_{n-1}``
        step by 0 or 1, so every token sees the request's first ``l_0``
        local keys: one non-causal segment per request over ``l_0`` keys
        reads the KV once (like FlashInfer's native multi-token decode), and
        ``causal_tail_merge`` adds each token's ``l_t - l_0 <= n - 1`` tail
        keys and merges. Works for non-causal rows too (empty tails).

        Args:
            flat: FlatDecode (N rows) of this rank.
            query_start_loc: int32 [R + 1] request query offsets ``flat``
                was built from.
        """
        device = flat.seq_lens.device
        num_rows = flat.num_rows
        q_lens = query_start_loc[1:] - query_start_loc[:-1]
        starts = query_start_loc[:-1][q_lens > 0]  # host sync (plan syncs)
        num_tokens = min(int(query_start_loc[-1]), num_rows)
        starts = starts[starts < num_tokens]
        seg_qsl = torch.cat([starts, starts.new_tensor([num_tokens])])
        csr = build_paged_kv_csr(flat.seq_lens[starts.long()],
                                 flat.block_table[starts.long()], self.page_size)
        rows = torch.arange(num_rows, dtype=torch.int32, device=device)
        first = query_start_loc[flat.row_to_req.long()].long()
        prefix = flat.seq_lens[first.clamp(max=max(num_rows - 1, 0))]
        prefix_lens = torch.where(rows < num_tokens, prefix, 0).to(torch.int32)
        tails = flat.seq_lens - prefix_lens
        tail_rows = torch.nonzero(tails > 0).flatten().to(torch.int32)
        self._plan(seg_qsl, csr, causal=False, num_tokens=num_rows,
                   token_empty=flat.empty)
        if tail_rows.numel():  # none for non-causal draft blocks
            max_tail = int(tails.max())
            self.tail = (flat.block_table, flat.seq_lens, prefix_lens, max_tail,
                         tail_rows)

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
        if mask_empty and self.empty_rows.numel():
            out.index_fill_(0, self.empty_rows, 0.0)
            lse.index_fill_(0, self.empty_rows, float("-inf"))
        if self.tail is not None:
            table, row_lens, prefix_lens, max_tail, tail_rows = self.tail
            causal_tail_merge(q, kv_cache, table, row_lens, prefix_lens, out,
                              lse, sm_scale=self.sm_scale, max_tail=max_tail,
                              tail_rows=tail_rows)
        return out, lse
