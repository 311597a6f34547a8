# SPDX-License-Identifier: Apache-2.0
"""FlashInfer FA3 MLA plans that checks and benchmarks use, the backend never.

- ``NativeFA3MLA``: FlashInfer's own multi-token MLA decode, one segment per
  request over its whole KV (with ``causal`` the queries are bottom-right
  aligned on it, FlashInfer's convention: the no-DCP speculative verify). The
  baseline of the decode benchmarks, and the direct check of the LSE base.
- ``FlashInferSm90MLAGraphed``: ``FlashInferSm90MLA`` with every segment
  count on a CUDA-graph wrapper, for checks and benchmarks that capture
  graphs of plans they make themselves (the backend marks the plans vLLM
  captures, ``for_graph``).
- ``plan_prefix_tail_from_rows``: the backend's prefix+tail plan
  (``plan_prefix_tail_host`` + ``FlashInferSm90MLA.plan_prefix_tail``) with
  every request's prefix at its first token's exact local bound, read back
  from the device rows (a sync; the backend plans from host lengths).

Both plan eagerly from device data (host syncs); neither is graph-safe.
Shapes: T query rows, R requests, H heads, Dv = kv_lora_rank, Dr = rope dim,
P pages, page = tokens per page, B block-table columns.
"""

from __future__ import annotations

import torch

from vllm.v1.attention.ops.dcp_decode import FlatDecode
from vllm.v1.attention.ops.flashinfer_sm90_mla import (FlashInferSm90MLA,
                                                       plan_fa3_csr,
                                                       plan_prefix_tail_host)

__all__ = ["FlashInferSm90MLAGraphed", "NativeFA3MLA", "paged_kv_csr",
           "plan_prefix_tail_from_rows"]


class FlashInferSm90MLAGraphed(FlashInferSm90MLA):
    """``FlashInferSm90MLA`` planning every segment count on a FlashInfer
    CUDA-graph wrapper, so that any of its plans may be captured."""

    def _on_graph_wrapper(self, num_segments: int) -> bool:
        return True


def paged_kv_csr(kv_lens: torch.Tensor, block_table: torch.Tensor,
                 page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """CSR page lists of R segments from a dense block table (a host sync).

    Args:
        kv_lens: int [R] KV tokens of each segment (0 allowed).
        block_table: int [R, B] page ids of each segment.
        page_size: tokens per page.

    Returns:
        ``(kv_indptr int32 CPU [R + 1], kv_indices int32 [nnz])``, the
        indices on ``block_table``'s device: segment ``r``'s pages are
        ``kv_indices[kv_indptr[r] : kv_indptr[r + 1]]``.
    """
    lens = kv_lens.cpu().to(torch.int64)
    num_cols = block_table.shape[1]
    pages = ((lens + page_size - 1) // page_size).clamp(max=num_cols)
    kv_indptr = torch.zeros(lens.shape[0] + 1, dtype=torch.int64)
    torch.cumsum(pages, 0, out=kv_indptr[1:])
    live = torch.arange(num_cols)[None, :] < pages[:, None]  # [R, B]
    kv_indices = block_table[live.to(block_table.device)].to(torch.int32)
    return kv_indptr.to(torch.int32), kv_indices


class NativeFA3MLA:
    """FlashInfer's FA3 MLA decode without DCP: one segment per request.

    Args:
        workspace: uint8 CUDA buffer for FlashInfer.
        num_heads, page_size, sm_scale, dtype, kv_lora_rank, rope_dim: as
            ``FlashInferSm90MLA``.
    """

    def __init__(self, workspace: torch.Tensor, *, num_heads: int, page_size: int,
                 sm_scale: float, dtype: torch.dtype = torch.bfloat16,
                 kv_lora_rank: int = 512, rope_dim: int = 64) -> None:
        from flashinfer.mla import BatchMLAPagedAttentionWrapper

        self._wrapper = BatchMLAPagedAttentionWrapper(workspace, backend="fa3")
        self.num_heads = num_heads
        self.page_size = page_size
        self.sm_scale = sm_scale
        self.dtype = dtype
        self.kv_lora_rank = kv_lora_rank
        self.rope_dim = rope_dim

    def plan(self, query_start_loc: torch.Tensor, kv_lens: torch.Tensor,
             block_table: torch.Tensor, *, causal: bool) -> None:
        """Plan R requests (every query row of ``query_start_loc``).

        Args:
            query_start_loc: int [R + 1] query offsets; ``run`` takes
                ``query_start_loc[-1]`` rows.
            kv_lens: int [R] KV tokens of each request (query included).
            block_table: int32 [R, B] pages of each request, on the device.
            causal: bottom-right aligned causal mask, else every query row
                sees the request's whole KV.
        """
        kv_indptr, kv_indices = paged_kv_csr(kv_lens, block_table, self.page_size)
        plan_fa3_csr(self._wrapper, self, query_start_loc.cpu(), kv_indptr,
                     kv_indices, kv_lens.cpu(), causal=causal)

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor, *,
            out: torch.Tensor | None = None,
            lse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """FlashInfer's bare run (one kernel launch, no post-processing).

        Args:
            q: [T, H, Dv + Dr]; kv_cache: [P, page, Dv + Dr].
            out, lse: optional [T, H, Dv] / float32 [T, H] outputs.

        Returns:
            ``(out [T, H, Dv], lse [T, H] float32 in base 2)``, as FlashInfer
            returns them (rows of requests without KV are left undefined).
        """
        if out is None:
            out = q.new_empty(q.shape[0], q.shape[1], self.kv_lora_rank)
        if lse is None:
            lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        self._wrapper.run(query=q, kv_cache=kv_cache, out=out, lse=lse,
                          return_lse=True)
        return out, lse


def plan_prefix_tail_from_rows(mla: FlashInferSm90MLA, flat: FlatDecode,
                               query_start_loc: torch.Tensor) -> None:
    """Plan ``mla`` as the backend does, with prefixes from the rows' exact
    bounds (the backend's come from host lengths).

    A request's per-token local bounds ``l_0 <= .. <= l_{n-1}`` step by 0 or
    1, so its first token's bound ``l_0`` is the prefix every token sees;
    ``plan_prefix_tail_host`` rounds it down to whole pages, and the tail
    kernel adds each token's remaining keys (fewer than a page + ``n``).

    Args:
        mla: the adapter to plan.
        flat: this rank's ``FlatDecode`` (T rows, padding included).
        query_start_loc: int32 [R + 1] request query offsets ``flat`` was
            built from.
    """
    qsl = query_start_loc.cpu()
    row_lens = flat.seq_lens.cpu()
    first = qsl[:-1].clamp(max=max(flat.num_rows - 1, 0)).long()
    prefix = row_lens[first] if flat.num_rows else torch.zeros_like(first)
    req_table = flat.block_table[first.to(flat.block_table.device)]
    plan = plan_prefix_tail_host(qsl, prefix, num_rows=flat.num_rows,
                                 page_size=mla.page_size)
    mla.plan_prefix_tail(plan, req_table, flat.seq_lens, flat.block_table)
