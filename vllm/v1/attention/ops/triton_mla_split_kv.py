# SPDX-License-Identifier: Apache-2.0
"""Split-KV (flash-decoding) absorbed-MLA decode over DCP rows, in Triton.

Every query token is one row of ``dcp_decode.FlatDecode``: its own local KV
bound ``row_lens[t]`` and block-table row ``block_table[t]`` (padding rows
have bound 0). At small batch a row-per-program decode leaves most SMs idle
and a rank's short local KV share is latency bound, so each row's keys are cut
into ``num_splits`` chunks attended by separate programs, then merged:

- stage 1, grid ``(T, cdiv(H, BLOCK_H), num_splits)``: program ``(t, hb, s)``
  attends row ``t``'s keys ``[s * chunk, min((s + 1) * chunk, row_len))``,
  ``chunk = round_up(max(cdiv(row_len, num_splits), min_split_keys),
  BLOCK_N)``, for ``BLOCK_H`` heads (q.k over the latent ``Dv`` + rope ``Dr``
  dims, P@V over the latent), with an online softmax; it writes the split's
  normalised float32 output and natural-log LSE (-inf for an empty split)
  into persistent buffers.
- stage 2, grid ``(T, H, cdiv(Dv, BLOCK_DV))``: the LSE-weighted merge of the
  splits; ``out`` in q's dtype, ``lse`` float32 natural log; rows without
  local keys (padding included) get out 0 and lse -inf.

The chunk is computed on the device from ``row_lens``, so the launch depends
only on (T, H, num_splits): a CUDA graph captured over ``run`` replays
correctly for any lengths. The result is what ``FlashInferSm90MLA.run``
returns (ready for ``dcp_decode.merge_partials`` and the combine).

Imports no vllm module. Shapes: T rows, H heads, S splits, Dv = kv_lora_rank
(512), Dr = rope dim (64), P pages, page = tokens per page, B block-table
columns.
"""

from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the split-KV path needs Triton
    triton = None

__all__ = [
    "TritonMLASplitKV",
    "choose_num_splits",
    "split_kv_preferred",
    "split_kv_decode",
]

_LOG2E = 1.4426950408889634
_LN2 = math.log(2.0)

# H100 / H200 (the sm90 parts this path is for): 132 SMs.
SM90_NUM_SMS = 132


# Where split-KV beat FA3 prefix+tail on the H200 (benchmarks/RESULTS.md,
# run 10, per layer, graph replay): one request's 4 query rows x 16 heads over
# 4K-32K local keys (0.75-0.88x FA3's time). Beyond either bound FA3 wins:
# 64K local keys 1.05x, 8 requests 1.9x, 96 heads 2.0x.
SPLIT_KV_MAX_ROW_HEADS = 64
SPLIT_KV_MAX_LOCAL_LEN = 32768


def split_kv_preferred(num_rows: int, num_heads: int, max_local_len: int) -> bool:
    """Whether a decode forward of ``num_rows`` (padded) rows runs split-KV
    rather than FA3 prefix+tail.

    Split-KV while the rows x heads fit one 64-row MMA tile and no rank holds
    more than 32K keys of the longest sequence (``max_local_len``: the rank's
    share of ``max_model_len``), the shapes where it measured faster. Only
    the padded row count and fixed config decide, so every batch of one
    CUDA-graph size runs one path (a captured graph holds one path's kernels).
    """
    return (num_rows * num_heads <= SPLIT_KV_MAX_ROW_HEADS
            and max_local_len <= SPLIT_KV_MAX_LOCAL_LEN)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def heads_per_program(num_heads: int, rows_per_program: int, *,
                      block_h: int = 16, block_m: int = 64) -> int:
    """Heads of one stage-1 program: ``block_h`` for one row per program;
    for G > 1 rows, enough heads for an MMA of ``block_m`` rows
    (G padded to a power of 2), at least 16 rows, at most the heads."""
    if rows_per_program <= 1:
        return block_h
    group = _pow2(rows_per_program)
    return max(min(block_m // group, _pow2(num_heads)), _cdiv(16, group))


def choose_num_splits(
    num_rows: int,
    num_heads: int,
    max_local_len: int,
    num_sms: int,
    *,
    rows_per_program: int = 1,
    block_h: int = 16,
    min_chunk: int = 512,
    programs_per_sm: int = 2,
    max_splits: int = 256,
) -> int:
    """Splits per row for a forward of ``num_rows`` rows (host ints only).

    Enough stage-1 programs to give every SM ``programs_per_sm`` of them
    (groups of ``rows_per_program`` rows x blocks of ``block_h`` heads x
    splits), but no split shorter than ``min_chunk`` keys of the longest
    possible row (``max_local_len``: each split writes an ``H x Dv`` float32
    partial that stage 2 reads back), and at most ``max_splits``. 1 once the
    row groups alone fill the SMs.

    Pass a fixed ``max_local_len`` (the rank's share of the longest sequence
    the model allows) so that the count depends only on ``num_rows``: a
    captured CUDA graph keeps the count it was captured with.
    """
    if num_rows <= 0:
        return 1
    programs = (_cdiv(num_rows, rows_per_program)
                * _cdiv(num_heads, block_h))
    wanted = _cdiv(programs_per_sm * num_sms, programs)
    by_len = max_local_len // max(min_chunk, 1)
    return max(1, min(wanted, by_len, max_splits))


if triton is not None:

    @triton.jit
    def _split_kv_stage1(
        q_ptr, q_stride_t, q_stride_h,
        kv_ptr, kv_stride_p, kv_stride_s,
        bt_ptr, bt_stride,
        row_lens_ptr, row_req_ptr,
        part_out_ptr, part_lse_ptr,
        num_rows, num_heads, num_splits, group, min_split_keys, page_size,
        qk_scale_log2,
        DV: tl.constexpr, DR: tl.constexpr,
        BLOCK_H: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, PAGE_TILES: tl.constexpr,
        PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    ):
        """Program = (``group`` rows from g * group, BLOCK_H heads, split s);
        partials [T, H, S, DV] and LSE [T, H, S], float32, natural log.

        The program's M = GROUP_PAD * BLOCK_H query rows (row-major: row,
        then head; GROUP_PAD = next power of 2 of ``group``, the rest masked)
        share one key tile: the rows of one request (one block table, each
        row bounded by its own length); the split's chunk follows the group's
        longest row. The head block is the grid's first axis, so the programs
        that read one key chunk run side by side and share it through L2.

        PAGE_TILES (``BLOCK_N`` divides the page size): a key tile lies in
        one page (chunks start at multiples of ``BLOCK_N``), so its page id is
        one scalar load and its keys are consecutive slots.
        """
        first_row = tl.program_id(2) * group
        split = tl.program_id(1)
        m_idx = tl.arange(0, BLOCK_M)
        rows = first_row + m_idx // BLOCK_H
        heads = tl.program_id(0) * BLOCK_H + m_idx % BLOCK_H
        row_ok = (rows < num_rows) & (m_idx // BLOCK_H < group)
        m_ok = row_ok & (heads < num_heads)
        row_len = tl.load(row_lens_ptr + rows, mask=row_ok, other=0)  # [M]
        group_len = tl.max(row_len, axis=0)
        chunk = tl.maximum(tl.cdiv(group_len, num_splits), min_split_keys)
        chunk = tl.cdiv(chunk, BLOCK_N) * BLOCK_N
        start = split * chunk
        end = tl.minimum(start + chunk, group_len)
        # Rows with keys must be the first row's request (its block table is
        # read): a plan that groups rows of two requests gives NaN, loudly.
        if GROUP_PAD > 1:
            req = tl.load(row_req_ptr + rows, mask=row_ok, other=0)
            first_req = tl.load(row_req_ptr + first_row)
            num_mixed = tl.sum(((row_len > 0) & (req != first_req)).to(tl.int32),
                               axis=0)
            mixed = (tl.zeros([BLOCK_M], dtype=tl.int32) + num_mixed) > 0  # [M]

        dv = tl.arange(0, DV)
        dr = tl.arange(0, DR)
        q_row = q_ptr + rows.to(tl.int64)[:, None] * q_stride_t + heads[:, None] * q_stride_h
        q_c = tl.load(q_row + dv[None, :], mask=m_ok[:, None], other=0.0)
        q_r = tl.load(q_row + DV + dr[None, :], mask=m_ok[:, None], other=0.0)
        if UPCAST:
            q_c = q_c.to(tl.float32)
            q_r = q_r.to(tl.float32)
        bt_row = bt_ptr + first_row.to(tl.int64) * bt_stride

        # Online softmax in base 2: running max m, sum l (relative to m),
        # unnormalised output acc.
        m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, DV], dtype=tl.float32)
        for key_start in range(start, end, BLOCK_N):
            keys = key_start + tl.arange(0, BLOCK_N)
            k_ok = keys < end
            if PAGE_TILES:
                page = tl.load(bt_row + key_start // page_size)
                slot = (page.to(tl.int64) * kv_stride_p
                        + (key_start % page_size + tl.arange(0, BLOCK_N)) * kv_stride_s)
            else:
                page = tl.load(bt_row + keys // page_size, mask=k_ok, other=0)
                slot = page.to(tl.int64) * kv_stride_p + (keys % page_size) * kv_stride_s
            k_c = tl.load(kv_ptr + slot[:, None] + dv[None, :], mask=k_ok[:, None],
                          other=0.0)
            k_r = tl.load(kv_ptr + slot[:, None] + DV + dr[None, :],
                          mask=k_ok[:, None], other=0.0)
            if UPCAST:
                k_c = k_c.to(tl.float32)
                k_r = k_r.to(tl.float32)
            scores = tl.dot(q_c, tl.trans(k_c), input_precision=PRECISION)
            scores = tl.dot(q_r, tl.trans(k_r), acc=scores, input_precision=PRECISION)
            visible = k_ok[None, :] & (keys[None, :] < row_len[:, None])
            scores = tl.where(visible, scores * qk_scale_log2, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            # A row may see none of this step's keys yet: keep it at 0.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m - m_safe)  # 0 while the row has seen nothing
            probs = tl.exp2(scores - m_safe[:, None])
            l_sum = l_sum * alpha + tl.sum(probs, axis=1)
            acc = acc * alpha[:, None]
            # P is rounded to the cache dtype, as the MMA on the device takes it.
            probs = probs.to(kv_ptr.dtype.element_ty)
            if UPCAST:
                probs = probs.to(tl.float32)
            acc = tl.dot(probs, k_c, acc=acc, input_precision=PRECISION)
            m = m_new

        has_keys = l_sum > 0
        norm = tl.where(has_keys, l_sum, 1.0)
        lse = tl.where(has_keys, (m + tl.log2(norm)) * 0.6931471805599453,
                       float("-inf"))
        part_out = acc / norm[:, None]
        # Stage 2 reads no output of an empty split (its weight is 0).
        write = has_keys
        if GROUP_PAD > 1:
            lse = tl.where(mixed, float("nan"), lse)
            part_out = tl.where(mixed[:, None], float("nan"), part_out)
            write = has_keys | mixed
        part = (rows.to(tl.int64) * num_heads + heads) * num_splits + split
        tl.store(part_out_ptr + part[:, None] * DV + dv[None, :], part_out,
                 mask=(m_ok & write)[:, None])
        tl.store(part_lse_ptr + part, lse, mask=m_ok)

    @triton.jit
    def _split_kv_stage2(
        part_out_ptr, part_lse_ptr,
        out_ptr, out_stride_t, out_stride_h,
        lse_ptr, lse_stride_t,
        num_heads, num_splits,
        DV: tl.constexpr, SPLITS: tl.constexpr, SPLIT_TILE: tl.constexpr,
        BLOCK_DV: tl.constexpr,
    ):
        """Program = (row t, head h, BLOCK_DV latent columns)."""
        t = tl.program_id(0)
        head = tl.program_id(1)
        dv = tl.program_id(2) * BLOCK_DV + tl.arange(0, BLOCK_DV)
        dv_ok = dv < DV
        base = (t.to(tl.int64) * num_heads + head) * num_splits
        all_splits = tl.arange(0, SPLITS)
        lses = tl.load(part_lse_ptr + base + all_splits,
                       mask=all_splits < num_splits, other=float("-inf"))
        lse_max = tl.max(lses, axis=0)
        lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
        total = tl.sum(tl.exp(lses - lse_max), axis=0)

        acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
        for first in range(0, num_splits, SPLIT_TILE):
            splits = first + tl.arange(0, SPLIT_TILE)
            lse_tile = tl.load(part_lse_ptr + base + splits,
                               mask=splits < num_splits, other=float("-inf"))
            weight = tl.exp(lse_tile - lse_max)  # 0 for empty splits
            part = tl.load(part_out_ptr + (base + splits)[:, None] * DV + dv[None, :],
                           mask=(weight > 0)[:, None] & dv_ok[None, :], other=0.0)
            acc += tl.sum(weight[:, None] * part, axis=0)

        has_keys = total > 0
        out = tl.where(has_keys, acc / tl.where(has_keys, total, 1.0), 0.0)
        # A NaN partial (a plan that grouped two requests' rows) stays NaN.
        out = tl.where(total != total, float("nan"), out)
        tl.store(out_ptr + t.to(tl.int64) * out_stride_t + head * out_stride_h + dv,
                 out.to(out_ptr.dtype.element_ty), mask=dv_ok)
        lse = tl.where(has_keys, lse_max + tl.log(tl.where(has_keys, total, 1.0)),
                       float("-inf"))
        lse = tl.where(total != total, float("nan"), lse)
        tl.store(lse_ptr + t.to(tl.int64) * lse_stride_t + head, lse,
                 mask=tl.program_id(2) == 0)


def split_kv_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    row_lens: torch.Tensor,
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    num_splits: int,
    sm_scale: float,
    rows_per_program: int = 1,
    row_to_req: torch.Tensor | None = None,
    min_split_keys: int = 0,
    block_n: int = 32,
    block_h: int = 16,
    block_m: int = 64,
    num_warps: int | None = None,
    num_stages: int = 2,
    merge_block_dv: int = 128,
    merge_split_tile: int = 16,
):
    """Both stages of the split-KV decode of T rows (two launches, no sync).

    Returns the stage-1 launch's compiled kernel where Triton gives one
    (``n_regs``, ``n_spills``, ``asm``: the benchmarks report them).

    Args:
        q: [T, H, Dv + Dr] queries (absorbed latent part, then rope part),
            last dim contiguous.
        kv_cache: [P, page, Dv + Dr] paged latent cache, last dim contiguous;
            same dtype as q (bf16 / fp16; fp32 for tests).
        block_table: int32 [>= T, B] local block table of each row.
        row_lens: int32 [>= T] local KV tokens of each row (0: no keys).
        part_out: float32, at least T * H * num_splits * Dv elements
            (contiguous scratch; viewed as [T, H, S, Dv]).
        part_lse: float32, at least T * H * num_splits elements ([T, H, S]).
        out: [T, H, Dv] in q's dtype, last dim contiguous (written).
        lse: float32 [T, H], last dim contiguous (written, natural log).
        num_splits: S, key chunks per row (>= 1).
        sm_scale: softmax scale applied to ``q . k``.
        rows_per_program: G, consecutive rows one stage-1 program attends
            together (padded to a power of 2 in the MMA's M): each G-row
            group from row 0 must hold one request's rows (any of them may
            have no keys), e.g. a uniform batch of G-token queries; rows of
            two requests in one group give NaN. 1: no such condition.
        row_to_req: int32 [>= T] request of each row (read when G > 1).
        min_split_keys: fewest keys per split (device side: a row shorter
            than ``num_splits * min_split_keys`` leaves its last splits
            empty, which write only their -inf LSE); 0: the chunk is
            ``cdiv(row_len, S)`` (rounded up to ``block_n``).
        block_n: keys per stage-1 loop step (power of 2, >= 16); when it
            divides the page size a key tile is one page's consecutive slots.
        block_h: heads per stage-1 program at G = 1 (power of 2, >= 16: the
            MMA M).
        block_m: MMA rows (G padded x heads) per stage-1 program at G > 1
            (``heads_per_program``).
        num_warps: stage-1 warps (None: 4, or 8 from 64 MMA rows on, whose
            float32 accumulator [M, Dv] needs the registers).
        num_stages: stage-1 software-pipelining stages.
        merge_block_dv, merge_split_tile: stage-2 latent columns per program
            and splits per loop step (powers of 2).
    """
    num_rows, num_heads, width = q.shape
    if num_rows == 0:
        return
    dv = out.shape[-1]
    # Triton's CPU interpreter gets bf16/fp16 dots wrong: it runs them on
    # float32 copies of the same values (products are exact either way).
    upcast = q.device.type != "cuda"
    group = rows_per_program
    if group > 1 and row_to_req is None:
        raise ValueError("split-KV MLA with rows_per_program > 1 needs row_to_req")
    heads = heads_per_program(num_heads, group, block_h=block_h, block_m=block_m)
    block_rows = triton.next_power_of_2(group) * heads
    if num_warps is None:
        num_warps = 8 if block_rows >= 64 else 4
    page_size = kv_cache.shape[1]
    grid1 = (triton.cdiv(num_heads, heads), num_splits, triton.cdiv(num_rows, group))
    stage1 = _split_kv_stage1[grid1](
        q, q.stride(0), q.stride(1),
        kv_cache, kv_cache.stride(0), kv_cache.stride(1),
        block_table, block_table.stride(0),
        row_lens, row_lens if row_to_req is None else row_to_req,
        part_out, part_lse,
        num_rows, num_heads, num_splits, group, min_split_keys, page_size,
        sm_scale * _LOG2E,
        DV=dv, DR=width - dv, BLOCK_H=heads,
        GROUP_PAD=triton.next_power_of_2(group), BLOCK_M=block_rows, BLOCK_N=block_n,
        PAGE_TILES=page_size % block_n == 0,
        PRECISION="ieee" if q.dtype == torch.float32 or upcast else "tf32",
        UPCAST=upcast, num_warps=num_warps, num_stages=num_stages,
    )
    if upcast:  # the interpreter pays per program: one per (row, head)
        merge_block_dv = triton.next_power_of_2(dv)
    grid2 = (num_rows, num_heads, triton.cdiv(dv, merge_block_dv))
    _split_kv_stage2[grid2](
        part_out, part_lse,
        out, out.stride(0), out.stride(1),
        lse, lse.stride(0),
        num_heads, num_splits,
        DV=dv, SPLITS=triton.next_power_of_2(num_splits),
        SPLIT_TILE=min(merge_split_tile, triton.next_power_of_2(num_splits)),
        BLOCK_DV=min(merge_block_dv, triton.next_power_of_2(dv)),
        num_warps=4,
    )
    return stage1


class TritonMLASplitKV:
    """Split-KV absorbed-MLA decode of DCP rows: planned per forward, run per
    layer, with the usage of ``FlashInferSm90MLA``::

        mla = TritonMLASplitKV(num_heads=H, sm_scale=s, dtype=torch.bfloat16,
                               max_rows=N, max_local_len=L, device="cuda")
        mla.plan(flat.seq_lens, flat.block_table, num_rows=T,   # per forward
                 rows_per_program=q_len, row_to_req=flat.row_to_req)
        out, lse = mla.run(q, kv_cache)                          # per layer

    ``plan`` takes host ints and the rows' persistent device buffers (kept by
    reference: a graph captured over ``run`` reads them at replay), makes no
    device-to-host sync, and picks ``num_splits`` with ``choose_num_splits``
    from the row count, the rows per program and ``max_local_len`` only. The
    partial buffers are allocated here, for the most rows x splits any plan
    up to ``max_rows`` rows and ``max_rows_per_program`` asks for, so they
    never move under a captured graph.

    ``rows_per_program`` G > 1 (a uniform batch of G-token queries: each G
    rows from row 0 are one request's, padding rows after them) lets one
    program attend G rows over one key tile, so a causal verify block or a
    DSpark draft block reads its request's keys once.

    Args:
        num_heads: H query heads on this rank.
        sm_scale: softmax scale applied to ``q . k``.
        dtype: query and KV dtype (bf16 / fp16; fp32 for tests).
        kv_lora_rank: Dv, the latent (value) width.
        rope_dim: Dr, the rope width (key = Dv + Dr).
        max_rows: most rows one plan may have.
        max_local_len: the rank's share of the longest sequence (keys); sets
            the split count with ``num_sms``.
        device: where the buffers live.
        num_sms: SMs of the device (default: read from a CUDA device,
            ``SM90_NUM_SMS`` otherwise).
        max_rows_per_program: the largest ``rows_per_program`` of a plan.
        max_partials: rows x splits capacity of the partial buffers (default:
            the most any automatic plan up to ``max_rows`` needs); raise it to
            force larger ``num_splits`` in ``plan``.
        block_n, block_h, block_m, num_warps, num_stages, min_split_keys, min_chunk,
        programs_per_sm, max_splits: kernel and split-count knobs (see
            ``split_kv_decode`` and ``choose_num_splits``). The defaults are
            the fastest of the H200 sweep (``benchmarks/split_kv_sweep.py``,
            run 10): 64-key tiles, 64 MMA rows on 8 warps (wgmma, 255
            registers, no spills), one program per SM and split, and a
            64-key floor per split (one key tile) so that short rows leave
            the surplus splits empty rather than reading slivers.
    """

    def __init__(
        self,
        *,
        num_heads: int,
        sm_scale: float,
        dtype: torch.dtype = torch.bfloat16,
        kv_lora_rank: int = 512,
        rope_dim: int = 64,
        max_rows: int,
        max_local_len: int,
        device: torch.device | str = "cuda",
        num_sms: int | None = None,
        max_rows_per_program: int = 1,
        max_partials: int | None = None,
        block_n: int = 64,
        block_h: int = 16,
        block_m: int = 64,
        num_warps: int | None = None,
        num_stages: int = 2,
        min_split_keys: int = 64,
        min_chunk: int = 256,
        programs_per_sm: int = 1,
        max_splits: int = 256,
    ) -> None:
        self.device = torch.device(device)
        if num_sms is None:
            num_sms = (torch.cuda.get_device_properties(self.device).multi_processor_count
                       if self.device.type == "cuda" else SM90_NUM_SMS)
        self.num_heads = num_heads
        self.sm_scale = sm_scale
        self.dtype = dtype
        self.kv_lora_rank = kv_lora_rank
        self.rope_dim = rope_dim
        self.max_rows = max_rows
        self.max_local_len = max_local_len
        self.num_sms = num_sms
        self.kernel_args = dict(block_n=block_n, block_h=block_h, block_m=block_m,
                                num_warps=num_warps, num_stages=num_stages,
                                min_split_keys=min_split_keys)
        self.block_h, self.block_m = block_h, block_m
        self.split_args = dict(min_chunk=min_chunk, programs_per_sm=programs_per_sm,
                               max_splits=max_splits)
        self.max_rows_per_program = max(max_rows_per_program, 1)
        if max_partials is None:
            max_partials = max(
                (n * self.splits_for(n, g) for n in range(1, max_rows + 1)
                 for g in range(1, self.max_rows_per_program + 1)), default=1)
        self.max_partials = max(max_partials, 1)
        self._part_out = torch.empty(self.max_partials * num_heads * kv_lora_rank,
                                     dtype=torch.float32, device=self.device)
        self._part_lse = torch.empty(self.max_partials * num_heads,
                                     dtype=torch.float32, device=self.device)
        self.num_tokens = 0
        self.num_splits = 1
        self.rows_per_program = 1
        self._rows: tuple | None = None

    def splits_for(self, num_rows: int, rows_per_program: int = 1) -> int:
        """The split count ``plan`` uses for ``num_rows`` rows."""
        heads = heads_per_program(self.num_heads, rows_per_program,
                                  block_h=self.block_h, block_m=self.block_m)
        return choose_num_splits(num_rows, self.num_heads, self.max_local_len,
                                 self.num_sms, rows_per_program=rows_per_program,
                                 block_h=heads, **self.split_args)

    def plan(
        self,
        row_lens: torch.Tensor,
        row_block_table: torch.Tensor,
        *,
        num_rows: int,
        rows_per_program: int = 1,
        row_to_req: torch.Tensor | None = None,
        num_splits: int | None = None,
    ) -> None:
        """Plan T rows (host work only; the tensors are kept by reference).

        Args:
            row_lens: int32 [>= T] exact local KV tokens of every row
                (``FlatDecode.seq_lens``; 0 on padding rows).
            row_block_table: int32 [>= T, B] local block table of every row.
            num_rows: T, the rows every ``run`` of this forward gets.
            rows_per_program: G, 1 or the query length of a uniform batch
                (see the class docstring); at most ``max_rows_per_program``.
            row_to_req: int32 [>= T] request of each row
                (``FlatDecode.row_to_req``), needed when G > 1: rows of two
                requests grouped by a wrong G give NaN, not a wrong answer.
            num_splits: force a split count (benchmarks); default
                ``splits_for(num_rows, rows_per_program)``.
        """
        if not 1 <= rows_per_program <= self.max_rows_per_program:
            raise ValueError(
                f"split-KV MLA plan of {rows_per_program} rows per program; "
                f"this kernel object allows 1..{self.max_rows_per_program}")
        if rows_per_program > 1 and row_to_req is None:
            raise ValueError("split-KV MLA with rows_per_program > 1 needs row_to_req")
        splits = (self.splits_for(num_rows, rows_per_program) if num_splits is None
                  else num_splits)
        if num_rows > self.max_rows or num_rows * splits > self.max_partials:
            raise ValueError(
                f"split-KV MLA plan of {num_rows} rows x {splits} splits exceeds "
                f"the buffers sized at start-up ({self.max_rows} rows, "
                f"{self.max_partials} rows x splits)")
        if splits < 1:
            raise ValueError(f"split-KV MLA needs num_splits >= 1, got {splits}")
        self.num_tokens = num_rows
        self.num_splits = splits
        self.rows_per_program = rows_per_program
        self._rows = (row_lens, row_block_table, row_to_req)

    def run(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        *,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of the planned rows for one layer (no host sync).

        Args:
            q: [T, H, Dv + Dr] queries; T must be the planned row count.
            kv_cache: [P, page, Dv + Dr] paged latent cache of this rank.
            out, lse: optional [T, H, Dv] / float32 [T, H] outputs.

        Returns:
            ``(out [T, H, Dv] in q's dtype, lse [T, H] float32, natural
            log)``; rows without local keys: out 0, lse -inf.
        """
        num_tokens = q.shape[0]
        if self._rows is None or num_tokens != self.num_tokens:
            raise ValueError(
                f"split-KV MLA run of {num_tokens} rows, but the last plan was "
                f"for {self.num_tokens}: plan every forward's rows before running")
        if (q.shape[1] != self.num_heads or q.dtype != self.dtype
                or q.shape[2] != self.kv_lora_rank + self.rope_dim):
            raise ValueError(
                f"split-KV MLA planned for {self.num_heads} heads x "
                f"{self.kv_lora_rank}+{self.rope_dim} of {self.dtype}, got "
                f"{tuple(q.shape[1:])} of {q.dtype}")
        if q.stride(2) != 1 or kv_cache.stride(2) != 1 or kv_cache.dtype != q.dtype:
            raise ValueError("split-KV MLA needs q and kv_cache of one dtype with "
                             "a contiguous last dim")
        if out is None:
            out = q.new_empty(num_tokens, self.num_heads, self.kv_lora_rank)
        if lse is None:
            lse = torch.empty(num_tokens, self.num_heads, dtype=torch.float32,
                              device=q.device)
        row_lens, row_table, row_to_req = self._rows
        split_kv_decode(q, kv_cache, row_table, row_lens, self._part_out,
                        self._part_lse, out, lse, num_splits=self.num_splits,
                        sm_scale=self.sm_scale,
                        rows_per_program=self.rows_per_program,
                        row_to_req=row_to_req, **self.kernel_args)
        return out, lse
