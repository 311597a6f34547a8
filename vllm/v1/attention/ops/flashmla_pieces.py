# SPDX-License-Identifier: Apache-2.0
"""A lone request's local prefix cut into pieces for vLLM's bf16 FlashMLA.

FlashMLA splits every request's keys over its SM partitions (``num_sms //
ceil(s * H / 64)`` of them: 22 for 96 heads x 4 query tokens on 132 SMs) and
merges the splits in a combine kernel whose warps walk a request's splits one
after another. With one request per rank (batch 1, the DSpark latency regime)
all partitions are splits of that request: on an H100 the bf16 combine then
ran about 20 us past the main kernel's end, of a 78 us call at 32K local keys
(``benchmarks/flashmla_latency.py``, RESULTS.md run 20). Given as N requests
(N pieces of the prefix's pages, one q seen N times through a batch stride of
0: no copy), each piece has about ``parts / N`` splits; the plan's finishing
launch (``mla_tail_merge.tail_merge``) merges the N partials with the tails.
fp8 FlashMLA (an older kernel with its own combine) and batches of two or
more requests gained nothing from pieces and keep one.

Imports no vllm module. Shapes: B block-table columns, N pieces.
"""

from __future__ import annotations

import torch

__all__ = ["MAX_PIECES", "PAGE", "PiecePlanner", "pieces_for"]

PAGE = 64  # FlashMLA's only page size
MAX_PIECES = 4


def pieces_for(*, num_reqs: int, fp8: bool, rows_per_request: int, num_sms: int) -> int:
    """Pieces to cut each request's prefix into: 1 but for a lone bf16 request.

    Args:
        num_reqs: R, requests of the forward (CUDA-graph padding included):
            fixed for a captured graph, so its plan's piece count is too.
        rows_per_request: s x H, the query rows FlashMLA tiles per request.
        num_sms: the GPU's SM count.

    Measured at batch 1 (q_len 4): 96 heads (22 partitions) fastest with 4
    pieces, 128 heads (16 partitions) with 2.
    """
    if fp8 or num_reqs != 1:
        return 1
    parts = max(num_sms // -(-rows_per_request // 64), 1)
    return 4 if parts >= 20 else 2 if parts >= 8 else 1


class PiecePlanner:
    """Writes a lone request's pieces (block table and lengths) into
    persistent buffers, on the device, once per forward.

    Args:
        device: the buffers' device.
    """

    def __init__(self, device: torch.device) -> None:
        i32 = dict(dtype=torch.int32, device=device)
        self._lens = torch.zeros(MAX_PIECES, **i32)
        self._starts = torch.arange(MAX_PIECES, **i32)  # piece index
        self._table: torch.Tensor | None = None
        self._columns: torch.Tensor | None = None

    def plan(self, prefix_len: torch.Tensor, block_table: torch.Tensor,
             pieces: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The pieces of request 0's prefix.

        Args:
            prefix_len: int32 [1] the request's local prefix (keys).
            block_table: int32 [1, B] its local block table.
            pieces: N, at most ``MAX_PIECES``.

        Returns:
            ``(table int32 [N, B], lens int32 [N])``: piece p holds pages
            ``[p * c, (p + 1) * c)`` of the prefix, c = ceil(prefix / (64 N))
            (its table row starts at page p * c; columns past the request's
            table repeat its last one, never read), and ``lens[p]`` of its keys
            (0 for pieces past the prefix).
        """
        if not 1 <= pieces <= MAX_PIECES:
            raise ValueError(f"{pieces} pieces: 1 to {MAX_PIECES}")
        width = block_table.shape[1]
        if self._table is None or self._table.shape[1] != width:
            # vLLM's block table has one width per model runner: made once,
            # at the first plan, before any CUDA graph is captured.
            self._table = block_table.new_zeros(MAX_PIECES, width)
            self._columns = torch.arange(width, dtype=torch.int64,
                                         device=block_table.device)
        chunk_pages = (prefix_len.long() + PAGE * pieces - 1) // (PAGE * pieces)  # [1]
        first_page = self._starts[:pieces].long() * chunk_pages  # [N]
        columns = (first_page[:, None] + self._columns[None, :]).clamp_(max=width - 1)
        table = self._table[:pieces]
        torch.index_select(block_table[0], 0, columns.view(-1), out=table.view(-1))
        lens = self._lens[:pieces]
        torch.minimum(prefix_len - first_page.int() * PAGE, chunk_pages.int() * PAGE,
                      out=lens)
        lens.clamp_(min=0)
        return table, lens
