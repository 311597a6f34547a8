# SPDX-License-Identifier: Apache-2.0
"""FlashMLA on a rank's DCP rows with every query row a request of its own.

FlashMLA keeps one cache length per request, so the tile path
(``flashmla_dcp_rows``) gives each request its shared local prefix and
finishes a verify block's later tokens (their few remaining local keys)
in a launch of its own after FlashMLA's, which also reads FlashMLA's LSE
layout [R, H, s] into vLLM's [T, H]. Given instead as T requests of one
query token (q [T, 1, H, D], the rows' own block tables and local bounds),
FlashMLA attends every row over exactly its keys: no tails, the causal
bounds of any interleave exact, a ragged or padded batch the same as a
uniform one, and its output [T, 1, H, Dv] / LSE [T, H, 1] already in
vLLM's layout. What is left is the rows with no local key (a rank's
share of a short request, CUDA-graph padding): FlashMLA gives them out 0
and LSE +inf (bf16), or, for fp8, whose kernel faults when no request has
a key, one key's attention (their length is raised to 1). One launch of
the project's own (``mask_empty_rows``) sets those rows to out 0 and
LSE -inf; a program whose row has keys loads one length and returns.

FlashMLA tiles a request's s x H query rows 64 at a time: per-token
requests cost the same tiles as one request of s tokens where H is a
multiple of 64 (128 heads: 2 tiles per token, 8 per 4-token request), and
more where it is not (96 heads: 2 per token against 6 per 4 tokens).
Taken by shape (``token_rows_preferred``) where measured faster: fp8.
``mask_empty_rows`` also finishes a DSpark block given to FlashMLA with
its tokens as heads (``FlashMLARowPlan._run_block_as_heads``).

Imports no vllm module. Shapes: T rows, H heads, Dv = kv_lora_rank.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the rows need Triton
    triton = None

__all__ = ["MAX_REQS", "mask_empty_rows", "token_rows_preferred"]

FLASHMLA_TILE_ROWS = 64
# Requests per forward (CUDA-graph padding included) up to which the rows
# take token rows (fp8) and a DSpark block's tokens go as heads: measured
# at batch 1-8; at batch 64 token rows were 1.06-1.10 x FlashMLA alone
# (H100, benchmarks/RESULTS.md run 25).
MAX_REQS = 8


def token_rows_preferred(*, num_heads: int, query_len: int, fp8: bool,
                         num_reqs: int) -> bool:
    """Whether FlashMLA takes the rows as one-token requests: a multi-token
    block over an fp8 cache, where that costs FlashMLA no more 64-row tiles
    than one request of ``query_len`` tokens (``num_heads`` a multiple of
    64), for at most ``MAX_REQS`` requests. By shape only: one CUDA-graph
    size runs one kernel.

    Measured on an H100 (benchmarks/RESULTS.md, run 25), 128 heads, q_len
    4, batch 1-4 x 16-64K and 8 x 32-128K local keys: fp8 0.91-1.01 x
    FlashMLA alone (the tiles with their finishing launch 1.00-1.11); at
    batch 64 1.06-1.10 x;
    bf16 faster at 16K but 1.09-1.14 x at 32-64K (batch 2-4), so bf16 keeps
    the tiles (and a lone bf16 request FA3); at 96 heads (8 tiles against
    6) 1.13-1.42 x.
    """
    return (fp8 and query_len >= 2 and num_reqs <= MAX_REQS
            and num_heads % FLASHMLA_TILE_ROWS == 0)


if triton is not None:

    @triton.jit
    def _mask_empty_rows_kernel(out_ptr, lse_ptr, seq_lens_ptr, prefix_lens_ptr,
                                num_heads, DV: tl.constexpr, BLOCK_H: tl.constexpr,
                                HAS_PREFIX: tl.constexpr):
        """Program = (row t, BLOCK_H heads): out 0 and LSE -inf where the
        row has no local key, NaN where its bound is not the prefix that
        FlashMLA attended (``HAS_PREFIX``); nothing written otherwise."""
        t = tl.program_id(0)
        row_len = tl.load(seq_lens_ptr + t)
        bad = row_len < 0  # never: lengths are >= 0
        if HAS_PREFIX:
            bad = tl.load(prefix_lens_ptr + t) != row_len
        if (row_len == 0) | bad:
            heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
            h_ok = heads < num_heads
            rows = t.to(tl.int64) * num_heads + heads
            fill = tl.where(bad, float("nan"), 0.0)
            tl.store(lse_ptr + rows,
                     tl.zeros((BLOCK_H,), tl.float32) + tl.where(bad, float("nan"),
                                                                 float("-inf")),
                     mask=h_ok)
            cols = tl.arange(0, DV)
            blank = tl.zeros((BLOCK_H, DV), tl.float32) + fill
            tl.store(out_ptr + rows[:, None] * DV + cols[None, :],
                     blank.to(out_ptr.dtype.element_ty), mask=h_ok[:, None])


def mask_empty_rows(out: torch.Tensor, lse: torch.Tensor, seq_lens: torch.Tensor,
                    prefix_lens: torch.Tensor | None = None) -> None:
    """Rows with no local key: out 0, LSE -inf, in place (one launch).

    Args:
        out: [T, H, Dv] contiguous (bf16 / fp16).
        lse: float32 [T, H] contiguous.
        seq_lens: int32 [T] each row's local keys (0: empty), on out's device.
        prefix_lens: int32 [T] the keys FlashMLA attended for each row, or
            None (its own bound): a row whose bound differs gets out and
            LSE NaN (an error made loud).
    """
    num_rows, num_heads, dv = out.shape
    if num_rows == 0:
        return
    assert out.is_contiguous() and lse.is_contiguous()
    assert lse.shape == (num_rows, num_heads) and seq_lens.shape[0] >= num_rows
    block_h = 16
    has_prefix = prefix_lens is not None
    _mask_empty_rows_kernel[(num_rows, triton.cdiv(num_heads, block_h))](
        out, lse, seq_lens, prefix_lens if has_prefix else seq_lens, num_heads,
        DV=dv, BLOCK_H=block_h, HAS_PREFIX=has_prefix, num_warps=4)
