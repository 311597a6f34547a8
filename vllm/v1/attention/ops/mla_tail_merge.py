# SPDX-License-Identifier: Apache-2.0
"""Finish a prefix+tail MLA decode: attend each row's tail keys, merge in place.

A planned kernel (FlashInfer's FA3 MLA on sm90) has already written each query
row's attention over its first ``prefix_lens[t]`` local keys into ``out`` /
``lse``. This kernel (one Triton launch over every row) attends to the row's
remaining keys ``[prefix_lens[t], row_lens[t])``, any number of them, with an
online softmax, merges them with the prefix partial, and leaves the final
output and a natural-log LSE. It also finishes every other row:

- no local keys (``row_lens == 0``, padding included): out 0, lse -inf;
- no tail: out kept, lse converted to natural log;
- ``row_lens < prefix_lens`` (a plan whose host-side bound was not a lower
  bound of the device's exact one): out and lse NaN, so that the error is loud.

An fp8 cache and query (vLLM's fp8 MLA decode: e4m3 values, per-tensor
scales) are dequantized as they are loaded: ``q * q_scale``, ``k * k_scale``.

The prefix partial may also come as N pieces per request (its keys cut into N
requests of their own, as FLASHMLA's planner does for a lone request: the
kernel's split combine then has fewer splits per request); they are merged
first, and every row's output is written.

Because every row is handled by the same launch whatever its data, the launch
is the same for every batch of a CUDA graph's size.

Imports no vllm module. Shapes: T rows, H heads, Dv = kv_lora_rank,
Dr = rope dim, P pages, page = tokens per page, B block-table columns.
"""

from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the prefix+tail path needs Triton
    triton = None

__all__ = ["LN2", "column_blocks_for", "tail_merge"]

LN2 = math.log(2.0)
# Programs of (row, 16 heads) up to which a launch cuts each into 4 along Dv:
# a lone q_len 4 request at 96-128 heads (24-32 programs) leaves most of an
# H100's 132 SMs idle, and each program's serial work (a lone bf16 request's
# 2-4 FlashMLA pieces merged) is the latency. Measured on an H100 (RESULTS,
# run 22): 0.2-4.7 us less at batch 1 in bf16, fp8 unchanged within noise;
# up to 12 us more at batch 2-4, which keep one program.
SMALL_GRID = 32


def column_blocks_for(programs: int) -> int:
    """Dv blocks per (row, head block) program for a launch of ``programs``:
    4 up to ``SMALL_GRID``, else 1 (a large batch's launch as before)."""
    return 4 if programs <= SMALL_GRID else 1

if triton is not None:

    @triton.jit
    def _tail_merge_kernel(
        q_ptr, q_stride_t, q_stride_h,
        kv_ptr, kv_stride_p, kv_stride_s,
        bt_ptr, bt_stride,
        row_lens_ptr, prefix_lens_ptr,
        out_ptr, lse_ptr,
        lse_in_ptr, lse_in_stride_req, lse_in_stride_h, lse_in_stride_tok, query_len,
        out_in_ptr, out_in_stride_req, out_in_stride_tok, out_in_stride_h, piece_lens_ptr,
        q_scale_ptr, k_scale_ptr,
        num_heads, page_size, sm_scale, lse_in_scale,
        DV: tl.constexpr, DR: tl.constexpr,
        BLOCK_H: tl.constexpr, KEYS: tl.constexpr, PRECISION: tl.constexpr,
        HAS_SCALES: tl.constexpr, HAS_TAILS: tl.constexpr, PIECES: tl.constexpr,
        DV_BLOCK: tl.constexpr,
    ):
        """Program = (row t, BLOCK_H heads, DV_BLOCK output columns); the
        softmax state is the same in every column block (each computes the
        full q.k), the first one stores the LSE."""
        t = tl.program_id(0)
        col_block = tl.program_id(2)
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        h_ok = heads < num_heads
        row_len = tl.load(row_lens_ptr + t)
        prefix_len = tl.load(prefix_lens_ptr + t)
        # Per-head copies of the row scalars (masks need tensors).
        row_len_h = tl.zeros_like(heads) + row_len
        prefix_h = tl.zeros_like(heads) + prefix_len
        has_prefix = prefix_h > 0
        has_tail = row_len_h > prefix_h
        is_empty = row_len_h == 0
        bad = row_len_h < prefix_h

        dv = col_block * DV_BLOCK + tl.arange(0, DV_BLOCK)  # this program's columns
        dk = tl.arange(0, DV)  # the latent part of q.k
        dr = tl.arange(0, DR)
        out_rows = t.to(tl.int64) * num_heads + heads
        o_ptrs = out_ptr + out_rows[:, None] * DV + dv[None, :]
        # Running softmax state, seeded with the prefix partial: max m, sum l
        # (relative to m), unnormalised output acc.
        # The prefix LSE of row t = request t // query_len, token t % query_len.
        req = (t // query_len).to(tl.int64)
        tok = t % query_len
        lse_in = lse_in_ptr + tok * lse_in_stride_tok + heads * lse_in_stride_h
        if PIECES == 1:
            m = tl.load(lse_in + req * lse_in_stride_req, mask=h_ok & has_prefix,
                        other=float("-inf")) * lse_in_scale
            l_sum = tl.where(has_prefix, 1.0, 0.0)
            if HAS_TAILS:
                acc = tl.load(o_ptrs, mask=(h_ok & has_prefix & has_tail)[:, None],
                              other=0.0).to(tl.float32)
        else:
            # The prefix came as PIECES partials (request req's keys cut into
            # pieces req * PIECES + p, each attended as a request of its own):
            # merge them first; an empty piece is skipped, whatever it holds.
            m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
            l_sum = tl.zeros((BLOCK_H,), tl.float32)
            acc = tl.zeros((BLOCK_H, DV_BLOCK), tl.float32)
            for p in tl.static_range(PIECES):
                piece = req * PIECES + p
                piece_ok = h_ok & ((tl.zeros_like(heads) + tl.load(piece_lens_ptr + piece)) > 0)
                m_p = tl.load(lse_in + piece * lse_in_stride_req, mask=piece_ok,
                              other=float("-inf")) * lse_in_scale
                o_p = tl.load(out_in_ptr + piece * out_in_stride_req + tok * out_in_stride_tok
                              + heads[:, None] * out_in_stride_h + dv[None, :],
                              mask=piece_ok[:, None], other=0.0).to(tl.float32)
                m_new = tl.maximum(m, m_p)
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp(m - m_safe)
                beta = tl.exp(m_p - m_safe)
                acc = acc * alpha[:, None] + o_p * beta[:, None]
                l_sum = l_sum * alpha + beta
                m = m_new
        if HAS_TAILS:
            q_row = q_ptr + t.to(tl.int64) * q_stride_t + heads[:, None] * q_stride_h
            q_ok = (h_ok & has_tail)[:, None]
            q_c = tl.load(q_row + dk[None, :], mask=q_ok, other=0.0).to(tl.float32)
            q_r = tl.load(q_row + DV + dr[None, :], mask=q_ok, other=0.0).to(tl.float32)
            k_scale = 1.0
            if HAS_SCALES:
                q_scale = tl.load(q_scale_ptr)
                q_c = q_c * q_scale
                q_r = q_r * q_scale
                k_scale = tl.load(k_scale_ptr)
            bt_row = bt_ptr + t.to(tl.int64) * bt_stride
            for start in range(prefix_len, row_len, KEYS):
                keys = start + tl.arange(0, KEYS)
                k_ok = keys < row_len
                page = tl.load(bt_row + keys // page_size, mask=k_ok, other=0)
                slot = page.to(tl.int64) * kv_stride_p + (keys % page_size) * kv_stride_s
                k_c = tl.load(kv_ptr + slot[:, None] + dk[None, :], mask=k_ok[:, None],
                              other=0.0).to(tl.float32)
                k_r = tl.load(kv_ptr + slot[:, None] + DV + dr[None, :],
                              mask=k_ok[:, None], other=0.0).to(tl.float32)
                if HAS_SCALES:
                    k_c = k_c * k_scale
                    k_r = k_r * k_scale
                if DV_BLOCK == DV:
                    v = k_c
                else:  # this program's value columns (the latent keys' slice)
                    v = tl.load(kv_ptr + slot[:, None] + dv[None, :], mask=k_ok[:, None],
                                other=0.0).to(tl.float32)
                    if HAS_SCALES:
                        v = v * k_scale
                # bf16 values are exact in tf32, so "tf32" keeps q.k exact for
                # bf16 inputs; fp32 inputs ask for "ieee".
                scores = (tl.dot(q_c, tl.trans(k_c), input_precision=PRECISION)
                          + tl.dot(q_r, tl.trans(k_r), input_precision=PRECISION))
                scores = tl.where(k_ok[None, :], scores * sm_scale, float("-inf"))
                m_new = tl.maximum(m, tl.max(scores, axis=1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp(m - m_safe)  # 0 while nothing was seen yet
                probs = tl.exp(scores - m_safe[:, None])
                l_sum = l_sum * alpha + tl.sum(probs, axis=1)
                acc = acc * alpha[:, None] + tl.dot(probs, v, input_precision=PRECISION)
                m = m_new

            norm = tl.where(l_sum > 0, l_sum, 1.0)
            merged = acc / norm[:, None]
            lse = tl.where(l_sum > 0, m + tl.log(norm), float("-inf"))
            merged = tl.where(bad[:, None], float("nan"), merged)
            lse = tl.where(bad, float("nan"), lse)
            if PIECES == 1:  # out holds the prefix partial: only changed rows
                tl.store(o_ptrs, merged.to(out_ptr.dtype.element_ty),
                         mask=(h_ok & (has_tail | is_empty | bad))[:, None])
            else:
                tl.store(o_ptrs, merged.to(out_ptr.dtype.element_ty), mask=h_ok[:, None])
        elif PIECES > 1:
            # No tails, the pieces merged: every row written.
            bad = row_len_h != prefix_h
            norm = tl.where(l_sum > 0, l_sum, 1.0)
            merged = tl.where(bad[:, None], float("nan"), acc / norm[:, None])
            lse = tl.where(l_sum > 0, m + tl.log(norm), float("-inf"))
            lse = tl.where(bad, float("nan"), lse)
            tl.store(o_ptrs, merged.to(out_ptr.dtype.element_ty), mask=h_ok[:, None])
        else:
            # A block without tails (a DSpark block: every row's bound is its
            # prefix): only the LSE layout and the empty rows; a row with a
            # tail is an error here, made loud.
            bad = row_len_h != prefix_h
            lse = tl.where(has_prefix, m, float("-inf"))
            lse = tl.where(bad, float("nan"), lse)
            fill = tl.where(bad, float("nan"), 0.0)
            blank = fill[:, None] + tl.zeros((BLOCK_H, DV_BLOCK), dtype=tl.float32)
            tl.store(o_ptrs, blank.to(out_ptr.dtype.element_ty),
                     mask=(h_ok & (is_empty | bad))[:, None])
        first_block = (tl.zeros_like(heads) + col_block) == 0
        tl.store(lse_ptr + out_rows, lse, mask=h_ok & first_block)


def tail_merge(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    row_lens: torch.Tensor,
    prefix_lens: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    sm_scale: float,
    lse_in_base2: bool = True,
    lse_in: torch.Tensor | None = None,
    q_scale: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    keys_per_step: int = 16,
    num_stages: int = 3,
    has_tails: bool = True,
    num_warps: int | None = None,
    out_in: torch.Tensor | None = None,
    piece_lens: torch.Tensor | None = None,
    column_blocks: int | None = None,
) -> None:
    """Finish prefix+tail decode of every row in place (one launch).

    Row ``t`` must attend to local keys ``[0, row_lens[t])``; ``out[t]`` /
    ``lse[t]`` (or ``lse_in``) hold its attention over ``[0, prefix_lens[t])``
    (read only where ``prefix_lens[t] > 0``; in base 2 with ``lse_in_base2``,
    as FlashInfer's MLA returns it).

    Args:
        q: [T, H, Dv + Dr] queries. kv_cache: [P, page, Dv + Dr].
        block_table: int32 [T, B] local block table of each row.
        row_lens, prefix_lens: int32 [T], on q's device.
        out: [T, H, Dv] contiguous; lse: float32 [T, H] contiguous; both are
            overwritten with the final output and natural-log LSE.
        lse_in: float32 [R, H, s] prefix LSE in FlashMLA's layout (row ``t``
            is token ``t % s`` of request ``t // s``), read instead of
            ``lse``'s own values; None: ``lse`` holds it.
        q_scale, k_scale: float32 one-element tensors on q's device, both or
            neither: q and kv_cache hold fp8 values of ``value / scale``
            (the layer's ``_q_scale`` / ``_k_scale``; read on the device, so
            a CUDA graph replays with the current scales).
        keys_per_step: tail keys attended per loop step (a power of 2, >= 16).
        num_stages: software-pipelining stages of the key loop (CUDA).
        has_tails: False for a block whose rows have no tail (``row_lens ==
            prefix_lens``, a DSpark block): the launch only converts the LSE
            and finishes the empty rows, with no tail code compiled in (a
            row with a tail then gets NaN: loud).
        num_warps: warps per program (None: 8 with tails, 4 without).
        out_in: [R * N, s, H, Dv] the prefix as N pieces per request (piece
            ``r * N + p`` holds part of request r's prefix keys, attended as
            a request of its own; its LSE in ``lse_in`` [R * N, H, s]):
            merged first, and ``out`` (then only written) gets every row.
            None: ``out`` holds the prefix partial (one piece).
        piece_lens: int32 [R * N] keys of each piece (0: the piece is
            skipped, whatever its out / LSE hold); with ``out_in``.
        column_blocks: programs each (row, head block) is cut into along
            Dv (1, 2 or 4; each recomputes the row's scores and writes
            Dv / column_blocks output columns; > 1 needs ``lse_in``). None:
            ``column_blocks_for`` the launch's grid with ``lse_in`` (more,
            smaller programs on a small batch), else 1.
    """
    num_tokens, num_heads, width = q.shape
    if num_tokens == 0:
        return
    assert out.is_contiguous() and lse.is_contiguous()
    assert out.shape[0] == lse.shape[0] == row_lens.shape[0] == num_tokens
    dv = out.shape[-1]
    has_scales = q_scale is not None
    if has_scales != (k_scale is not None):
        raise ValueError("tail_merge takes q_scale and k_scale together")
    if lse_in is None:  # [T, H] seen as T requests of one token
        lse_in_args = (lse, lse.stride(0), lse.stride(1), 0, 1)
    else:
        assert out_in is not None or lse_in.shape[0] * lse_in.shape[2] == num_tokens
        lse_in_args = (lse_in, lse_in.stride(0), lse_in.stride(1), lse_in.stride(2),
                       lse_in.shape[2])
    if out_in is None:
        pieces, out_in_args = 1, (out, 0, 0, 0, row_lens)
    else:
        if lse_in is None or piece_lens is None or out_in.stride(-1) != 1:
            raise ValueError("tail_merge's pieces take lse_in, piece_lens and an out_in "
                             "with a contiguous last dim")
        pieces = out_in.shape[0] * out_in.shape[1] // num_tokens
        assert out_in.shape[0] == lse_in.shape[0] == piece_lens.shape[0]
        assert pieces * num_tokens == out_in.shape[0] * out_in.shape[1] and pieces >= 1
        out_in_args = (out_in, out_in.stride(0), out_in.stride(1), out_in.stride(2),
                       piece_lens)
    block_h = 16
    head_blocks = triton.cdiv(num_heads, block_h)
    if column_blocks is None:  # lse read in place: one program per row's heads
        column_blocks = 1 if lse_in is None else column_blocks_for(num_tokens * head_blocks)
    if column_blocks not in (1, 2, 4) or dv % column_blocks:
        raise ValueError(f"tail_merge: column_blocks {column_blocks} does not cut Dv {dv}")
    if column_blocks > 1 and lse_in is None:
        raise ValueError("tail_merge cuts Dv only with a separate lse_in (the first "
                         "column block rewrites lse, which the others would read)")
    grid = (num_tokens, head_blocks, column_blocks)
    _tail_merge_kernel[grid](
        q, q.stride(0), q.stride(1),
        kv_cache, kv_cache.stride(0), kv_cache.stride(1),
        block_table, block_table.stride(0),
        row_lens, prefix_lens, out, lse, *lse_in_args, *out_in_args,
        q_scale if has_scales else lse, k_scale if has_scales else lse,
        num_heads, kv_cache.shape[1], sm_scale, LN2 if lse_in_base2 else 1.0,
        DV=dv, DR=width - dv, BLOCK_H=block_h, KEYS=keys_per_step,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        HAS_SCALES=has_scales, HAS_TAILS=has_tails, PIECES=pieces,
        DV_BLOCK=dv // column_blocks,
        num_warps=num_warps or (8 if has_tails and column_blocks == 1 else 4),
        num_stages=num_stages,
    )
