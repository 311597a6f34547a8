# SPDX-License-Identifier: Apache-2.0
"""Fused Triton builder of the DCP multi-token decode rows.

``build_flat_decode_triton`` fills every field of a
:class:`~vllm.v1.attention.ops.dcp_decode.FlatDecode` in ONE kernel launch,
into persistent buffers, with no host sync: it is bit-equal to the torch
reference ``build_flat_decode`` and can be captured in a CUDA graph.

Only ``vllm.v1.attention.ops.dcp_decode`` (pure torch) is imported from vllm.

Shapes: R requests, N flattened rows (query tokens, padding included),
B block-table columns.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm.v1.attention.ops.dcp_decode import DCPLayout, FlatDecode, alloc_flat_decode

__all__ = ["build_flat_decode_triton"]


@triton.jit
def _local_len(bound, world_size, rank, interleave):
    """``DCPLayout.local_seq_lens`` with floor division (matches torch on < 0)."""
    span = world_size * interleave
    rem = bound % span
    rem = tl.where(rem < 0, rem + span, rem)
    quot = (bound - rem) // span
    part = rem - rank * interleave
    part = tl.minimum(tl.maximum(part, 0), interleave)
    return quot * interleave + part


@triton.jit
def _row_to_request(rows, qsl_ptr, num_reqs, num_search_steps):
    """Right searchsorted of ``rows`` in ``query_start_loc[1:]``.

    Returns the first request ``i`` with ``query_start_loc[i + 1] > row``
    (``num_reqs`` when none), so zero-length requests are skipped.
    """
    lo = tl.zeros_like(rows)
    hi = tl.zeros_like(rows) + num_reqs
    for _ in range(num_search_steps):
        active = lo < hi
        mid = (lo + hi) // 2
        end = tl.load(qsl_ptr + mid + 1, mask=active, other=0)
        go_right = active & (end <= rows)
        lo = tl.where(go_right, mid + 1, lo)
        hi = tl.where(active & (end > rows), mid, hi)
    return lo


@triton.jit
def _flat_decode_kernel(
    # inputs
    seq_lens_ptr, qsl_ptr, bt_ptr, bt_stride,
    # outputs
    out_seq_lens_ptr, out_bt_ptr, out_bt_stride,
    out_row_to_req_ptr, out_empty_ptr,
    # sizes
    num_reqs, num_rows, num_cols, num_search_steps,
    world_size, rank, interleave,
    CAUSAL: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < num_rows

    req = _row_to_request(rows, qsl_ptr, num_reqs, num_search_steps)
    is_real = req < num_reqs
    req = tl.minimum(req, tl.maximum(num_reqs - 1, 0))

    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < num_cols
    # Padded rows copy the clamped request's row, like the torch path.
    src = bt_ptr + req.to(tl.int64)[:, None] * bt_stride + cols[None, :]
    tile_mask = row_ok[:, None] & col_ok[None, :]
    has_req = req < num_reqs  # False only when R == 0
    tile = tl.load(src, mask=tile_mask & has_req[:, None], other=0)
    dst = out_bt_ptr + rows.to(tl.int64)[:, None] * out_bt_stride + cols[None, :]
    tl.store(dst, tile, mask=tile_mask)

    if pid_c == 0:
        req_ok = row_ok & has_req
        req_start = tl.load(qsl_ptr + req, mask=req_ok, other=0)
        req_end = tl.load(qsl_ptr + req + 1, mask=req_ok, other=0)
        req_len = tl.load(seq_lens_ptr + req, mask=req_ok, other=0)
        if CAUSAL:
            bound = req_len - (req_end - req_start) + 1 + (rows - req_start)
        else:
            bound = req_len
        bound = tl.maximum(tl.where(is_real, bound, 0), 0)
        local = _local_len(bound, world_size, rank, interleave)
        tl.store(out_seq_lens_ptr + rows, local, mask=row_ok)
        tl.store(out_row_to_req_ptr + rows, req, mask=row_ok)
        tl.store(out_empty_ptr + rows, (local == 0).to(tl.uint8), mask=row_ok)


def _search_steps(num_reqs: int) -> int:
    return max(num_reqs, 1).bit_length() + 1


def _tile_shape(num_cols: int) -> tuple[int, int]:
    block_c = min(triton.next_power_of_2(max(num_cols, 1)), 256)
    block_r = max(4096 // block_c, 16)
    return min(block_r, 256), block_c


def build_flat_decode_triton(
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    block_table: torch.Tensor,
    *,
    layout: DCPLayout,
    causal: bool,
    num_rows: int | None = None,
    out: FlatDecode | None = None,
) -> FlatDecode:
    """One-launch Triton twin of ``dcp_decode.build_flat_decode``.

    Same contract and bit-equal output: row ``n`` of request ``i`` (query
    token ``t``) sees the global bound ``g_t`` (``L - q_len + 1 + t`` when
    ``causal``, ``L`` otherwise, clamped at 0) and gets
    ``seq_lens = local(g_t, rank)``, ``row_to_req = i``,
    ``block_table = block_table[i]`` (a view of the first ``B`` columns of
    ``out``) and ``empty = seq_lens == 0``. Rows at or beyond
    ``query_start_loc[-1]`` are padding: seq len 0, empty, and
    ``row_to_req`` / ``block_table`` of the last request (``R - 1``), exactly
    as the torch path clamps them. Zero-length requests produce no rows.

    No host sync when ``num_rows`` is given; with ``out`` from
    ``alloc_flat_decode`` the launch can be captured in a CUDA graph.

    Args:
        seq_lens: int32 [R] global lengths (tokens, query included), CUDA.
        query_start_loc: int32 [R + 1] cumulative query lengths.
        block_table: int32 [R, B] local block tables (row stride may be > B;
            columns must be contiguous).
        layout: the DCP split, seen from the rank the rows are built for.
        causal: causal verify (True) or non-causal draft block (False).
        num_rows: N; defaults to ``query_start_loc[-1]`` (one host sync).
        out: persistent buffers with at least N rows and B columns.

    Returns:
        FlatDecode view of ``out`` with N rows.
    """
    if num_rows is None:
        num_rows = int(query_start_loc[-1])
    num_reqs = seq_lens.shape[0]
    num_cols = block_table.shape[1]
    if out is None:
        out = alloc_flat_decode(num_rows, num_cols, seq_lens.device)
    assert out.block_table.shape[1] >= num_cols
    assert out.seq_lens.shape[0] >= num_rows
    assert block_table.stride(1) == 1 and out.block_table.stride(1) == 1
    flat = out.slice(num_rows, num_cols)
    if num_reqs == 0:
        # Matches the torch path, which zeroes the whole table then.
        flat.block_table.zero_()
    block_r, block_c = _tile_shape(num_cols)
    grid = (max(triton.cdiv(num_rows, block_r), 1),
            max(triton.cdiv(num_cols, block_c), 1))
    _flat_decode_kernel[grid](
        seq_lens, query_start_loc, block_table, block_table.stride(0),
        flat.seq_lens, flat.block_table, flat.block_table.stride(0),
        flat.row_to_req, flat.empty.view(torch.uint8),
        num_reqs, num_rows, num_cols, _search_steps(num_reqs),
        layout.world_size, layout.rank, layout.interleave,
        CAUSAL=causal, BLOCK_R=block_r, BLOCK_C=block_c,
    )
    return flat
