# SPDX-License-Identifier: Apache-2.0
"""Fused Triton builders for DCP multi-token decode metadata.

``build_flat_decode_triton`` fills every field of a
:class:`~vllm.v1.attention.ops.dcp_decode.FlatDecode` in ONE kernel launch,
into persistent buffers, with no host sync: it is bit-equal to the torch
reference ``build_flat_decode`` and can be captured in a CUDA graph.

``build_grouped_decode`` / ``build_grouped_decode_reference`` build the
*grouped rows* view: under DCP a request's per-token local bounds are
non-decreasing and step by 0 or 1, so consecutive query tokens of one request
with the same local bound can share one non-causal attention row (a DSpark
draft block, where every token sees the whole block, is always one row).

Only ``vllm.v1.attention.ops.dcp_decode`` (pure torch) is imported from vllm.

Shapes: R requests, N flattened rows (query tokens, padding included),
B block-table columns, G row groups (G <= N).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vllm.v1.attention.ops.dcp_decode import (
    DCPLayout,
    FlatDecode,
    alloc_flat_decode,
    build_flat_decode,
)

__all__ = [
    "GroupedDecode",
    "alloc_grouped_decode",
    "build_flat_decode_triton",
    "build_grouped_decode",
    "build_grouped_decode_reference",
]


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
    out_seq_lens_ptr, out_qsl_ptr, out_bt_ptr, out_bt_stride,
    out_row_to_req_ptr, out_global_ptr, out_empty_ptr,
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
        tl.store(out_global_ptr + rows, bound, mask=row_ok)
        tl.store(out_row_to_req_ptr + rows, req, mask=row_ok)
        tl.store(out_empty_ptr + rows, (local == 0).to(tl.uint8), mask=row_ok)
        # query_start_loc = arange(N + 1): the last block also writes row N.
        tl.store(out_qsl_ptr + rows, rows, mask=rows <= num_rows)


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
    token ``t``) gets ``global_seq_lens = g_t`` (``L - q_len + 1 + t`` when
    ``causal``, ``L`` otherwise, clamped at 0), ``seq_lens = local(g_t, rank)``,
    ``row_to_req = i``, ``block_table = block_table[i]`` (a view of the first
    ``B`` columns of ``out``) and ``empty = seq_lens == 0``;
    ``query_start_loc = arange(N + 1)``. Rows at or beyond
    ``query_start_loc[-1]`` are padding: seq len 0, global 0, empty, and
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
    grid = (triton.cdiv(num_rows + 1, block_r),
            max(triton.cdiv(num_cols, block_c), 1))
    _flat_decode_kernel[grid](
        seq_lens, query_start_loc, block_table, block_table.stride(0),
        flat.seq_lens, flat.query_start_loc, flat.block_table,
        flat.block_table.stride(0), flat.row_to_req, flat.global_seq_lens,
        flat.empty.view(torch.uint8),
        num_reqs, num_rows, num_cols, _search_steps(num_reqs),
        layout.world_size, layout.rank, layout.interleave,
        CAUSAL=causal, BLOCK_R=block_r, BLOCK_C=block_c,
    )
    return flat


# --------------------------------------------------------------------------
# Grouped rows
# --------------------------------------------------------------------------


@dataclass
class GroupedDecode:
    """Per-rank decode metadata, one non-causal row per *group* of tokens.

    A group is a maximal run of consecutive query tokens of one request whose
    local bound on this rank (``FlatDecode.seq_lens``) is equal. Groups keep
    token order, so group ``g`` covers flattened query tokens
    ``query_start_loc[g] : query_start_loc[g + 1]`` and an attention kernel
    fed ``query_start_loc`` as its ragged query offsets writes its output
    straight into the per-token layout. Every token of a group attends,
    non-causally, to the first ``seq_lens[g]`` local KV tokens: on this rank
    that is exactly what each token of the group may see.

    Buffers are sized for G_max = N groups (every token its own group, the
    worst case); groups at or beyond ``num_groups`` are padding: zero query
    tokens (``query_start_loc`` stays at the real token count), seq len 0,
    empty, ``row_to_req`` / ``block_table`` of the last request (clamped like
    the flat path).

    Attributes:
        seq_lens: int32 [G], local KV tokens of the group.
        query_start_loc: int32 [G + 1], first flattened query token of each
            group (the last entry: number of real tokens).
        block_table: int32 [G, B], the group's request's block table.
        row_to_req: int32 [G], request of each group.
        empty: bool [G], True where the group has no local KV (or is padding).
        num_groups: int32 [1], number of real groups (on device).
    """

    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    block_table: torch.Tensor
    row_to_req: torch.Tensor
    empty: torch.Tensor
    num_groups: torch.Tensor

    def slice(self, num_groups: int) -> "GroupedDecode":
        """Views of the first ``num_groups`` groups."""
        return GroupedDecode(
            seq_lens=self.seq_lens[:num_groups],
            query_start_loc=self.query_start_loc[: num_groups + 1],
            block_table=self.block_table[:num_groups],
            row_to_req=self.row_to_req[:num_groups],
            empty=self.empty[:num_groups],
            num_groups=self.num_groups,
        )


def alloc_grouped_decode(
    max_rows: int, max_blocks: int, device: torch.device | str = "cpu"
) -> GroupedDecode:
    """Persistent buffers for up to ``max_rows`` groups."""
    i32 = dict(dtype=torch.int32, device=device)
    return GroupedDecode(
        seq_lens=torch.zeros(max_rows, **i32),
        query_start_loc=torch.zeros(max_rows + 1, **i32),
        block_table=torch.zeros(max_rows, max_blocks, **i32),
        row_to_req=torch.zeros(max_rows, **i32),
        empty=torch.ones(max_rows, dtype=torch.bool, device=device),
        num_groups=torch.zeros(1, **i32),
    )


def build_grouped_decode_reference(
    flat: FlatDecode, query_start_loc: torch.Tensor, block_table: torch.Tensor
) -> GroupedDecode:
    """Torch reference: group the rows of a ``FlatDecode`` (N rows).

    Args:
        flat: per-token metadata from ``build_flat_decode`` (N rows; rows at
            or beyond ``query_start_loc[-1]`` are padding and join no group).
        query_start_loc: int32 [R + 1], the request query offsets ``flat``
            was built from.
        block_table: int32 [R, B], the table ``flat`` was built from.

    Returns:
        GroupedDecode with G_max = N (see its docstring); host syncs.
    """
    num_rows = flat.num_rows
    device = flat.seq_lens.device
    num_reqs, num_cols = block_table.shape
    out = alloc_grouped_decode(num_rows, num_cols, device)
    num_tokens = min(int(query_start_loc[-1]), num_rows)
    rows = torch.arange(num_rows, device=device)
    real = rows < num_tokens
    prev_req = torch.roll(flat.row_to_req, 1)
    prev_len = torch.roll(flat.seq_lens, 1)
    starts = real & ((rows == 0) | (prev_req != flat.row_to_req)
                     | (prev_len != flat.seq_lens))
    start_rows = rows[starts]
    num_groups = start_rows.numel()
    out.num_groups.fill_(num_groups)
    out.seq_lens.zero_()
    out.seq_lens[:num_groups] = flat.seq_lens[start_rows]
    out.row_to_req.fill_(max(num_reqs - 1, 0))
    out.row_to_req[:num_groups] = flat.row_to_req[start_rows]
    out.query_start_loc.fill_(num_tokens)
    out.query_start_loc[:num_groups] = start_rows.to(torch.int32)
    torch.eq(out.seq_lens, 0, out=out.empty)
    if num_reqs > 0:
        out.block_table[:, :num_cols] = block_table[out.row_to_req.long()]
    else:
        out.block_table.zero_()
    return out


@triton.jit
def _group_scan_kernel(
    flat_seq_lens_ptr, flat_req_ptr, qsl_ptr,
    out_seq_lens_ptr, out_qsl_ptr, out_req_ptr, out_empty_ptr,
    out_num_groups_ptr,
    num_rows, num_reqs, last_req,
    BLOCK: tl.constexpr,
):
    """One program: scan the N rows in blocks, carrying the group count."""
    # Real tokens come first, padding rows trail.
    num_tokens = tl.minimum(tl.load(qsl_ptr + num_reqs), num_rows)
    carry = tl.zeros([1], dtype=tl.int32)
    for base in range(0, num_rows, BLOCK):
        rows = base + tl.arange(0, BLOCK)
        ok = rows < num_rows
        local = tl.load(flat_seq_lens_ptr + rows, mask=ok, other=0)
        req = tl.load(flat_req_ptr + rows, mask=ok, other=0)
        prev_ok = ok & (rows > 0)
        prev_local = tl.load(flat_seq_lens_ptr + rows - 1, mask=prev_ok, other=0)
        prev_req = tl.load(flat_req_ptr + rows - 1, mask=prev_ok, other=0)
        real = rows < num_tokens
        start = real & ((rows == 0) | (prev_req != req) | (prev_local != local))
        start_i = start.to(tl.int32)
        group = carry + tl.cumsum(start_i, axis=0) - 1
        tl.store(out_seq_lens_ptr + group, local, mask=start)
        tl.store(out_req_ptr + group, req, mask=start)
        tl.store(out_qsl_ptr + group, rows, mask=start)
        tl.store(out_empty_ptr + group, (local == 0).to(tl.uint8), mask=start)
        carry += tl.sum(start_i, axis=0)
    tl.store(out_num_groups_ptr + tl.arange(0, 1), carry)
    # Padding groups [num_groups, N) and the closing offsets.
    for base in range(0, num_rows + 1, BLOCK):
        g = base + tl.arange(0, BLOCK)
        pad = (g >= carry) & (g < num_rows)
        tl.store(out_seq_lens_ptr + g, tl.zeros_like(g), mask=pad)
        tl.store(out_req_ptr + g, tl.zeros_like(g) + last_req, mask=pad)
        tl.store(out_empty_ptr + g, tl.full([BLOCK], 1, tl.uint8), mask=pad)
        tl.store(out_qsl_ptr + g, tl.zeros_like(g) + num_tokens,
                 mask=(g >= carry) & (g <= num_rows))


@triton.jit
def _gather_rows_kernel(
    src_ptr, src_stride, idx_ptr, dst_ptr, dst_stride,
    num_rows, num_cols, num_src,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_ok = rows < num_rows
    idx = tl.load(idx_ptr + rows, mask=row_ok, other=0)
    mask = row_ok[:, None] & (cols < num_cols)[None, :]
    tile = tl.load(src_ptr + idx.to(tl.int64)[:, None] * src_stride + cols[None, :],
                   mask=mask & (idx < num_src)[:, None], other=0)
    tl.store(dst_ptr + rows.to(tl.int64)[:, None] * dst_stride + cols[None, :],
             tile, mask=mask)


def build_grouped_decode(
    flat: FlatDecode,
    query_start_loc: torch.Tensor,
    block_table: torch.Tensor,
    *,
    out: GroupedDecode | None = None,
) -> GroupedDecode:
    """Triton twin of ``build_grouped_decode_reference`` (two launches).

    No host sync; the group count stays on the device (``num_groups``).

    Args:
        flat: FlatDecode with N rows (from either flat builder), on CUDA.
        query_start_loc: int32 [R + 1] request query offsets of ``flat``.
        block_table: int32 [R, B] request block tables (columns contiguous).
        out: buffers from ``alloc_grouped_decode`` with >= N rows, >= B cols.

    Returns:
        GroupedDecode view of ``out`` with G_max = N.
    """
    num_rows = flat.num_rows
    num_reqs, num_cols = block_table.shape
    device = flat.seq_lens.device
    if out is None:
        out = alloc_grouped_decode(num_rows, num_cols, device)
    grouped = out.slice(num_rows)
    _group_scan_kernel[(1,)](
        flat.seq_lens, flat.row_to_req, query_start_loc,
        grouped.seq_lens, grouped.query_start_loc, grouped.row_to_req,
        grouped.empty.view(torch.uint8), grouped.num_groups,
        num_rows, num_reqs, max(num_reqs - 1, 0),
        BLOCK=1024,
    )
    if num_reqs == 0:
        grouped.block_table.zero_()
    elif num_rows > 0:
        block_r, block_c = _tile_shape(num_cols)
        grid = (triton.cdiv(num_rows, block_r), max(triton.cdiv(num_cols, block_c), 1))
        _gather_rows_kernel[grid](
            block_table, block_table.stride(0), grouped.row_to_req,
            grouped.block_table, grouped.block_table.stride(0),
            num_rows, num_cols, num_reqs, BLOCK_R=block_r, BLOCK_C=block_c,
        )
    return grouped


def _self_check() -> None:  # pragma: no cover - manual smoke test
    dev = "cuda"
    seq = torch.tensor([10, 3, 40], dtype=torch.int32, device=dev)
    qsl = torch.tensor([0, 2, 2, 6], dtype=torch.int32, device=dev)
    bt = torch.randint(1, 100, (3, 5), dtype=torch.int32, device=dev)
    a = build_flat_decode(seq, qsl, bt, world_size=2, rank=1, interleave=1,
                          causal=True, num_rows=8)
    b = build_flat_decode_triton(seq, qsl, bt, world_size=2, rank=1,
                                 interleave=1, causal=True, num_rows=8)
    for name in ("seq_lens", "query_start_loc", "block_table", "row_to_req",
                 "global_seq_lens", "empty"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
