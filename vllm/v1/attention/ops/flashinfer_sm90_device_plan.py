# SPDX-License-Identifier: Apache-2.0
"""FlashInfer's Hopper (FA3) MLA for a few uniform requests, planned on the device.

FlashInfer's FA3 MLA plan (``MLAPlan`` in ``attention/scheduler.cuh``) runs
on the host: it splits every request's packed query rows (``q_len x H``)
into tiles of a cluster (128 rows where ``q_len x H > 64``), cuts each
tile's keys into chunks of ``kv_len_limit`` keys, deals the (tile, chunk)
works to the clusters and stages per-work and merge arrays into an integer
workspace. The kernel
(``mla_hopper.cuh``) reads those arrays when it runs; its grid (``num_blks_x
x num_blks_y``), its partial buffers and its merge stage follow the plan.

For R requests of q_len s each, non-causal over a prefix of ``L_r`` keys
(the decode rows' shared local prefix), the structure of FlashInfer's plan
depends on L only through the number of chunks per tile, bounded by
``ceil(num_clusters / tiles)``. So this module plans once on the host a
*template* (every request at a length that reaches that bound: every tile
split into the most chunks), keeps FlashInfer's offsets, and per forward
rewrites only the per-work key ranges (``kv_len``, ``kv_start``,
``kv_end``) from the device lengths with one Triton launch, with chunks of
FlashInfer's own ``kv_len_limit`` for L (so that a plan equals FlashInfer's
host plan for L, up to the order in which works sit on clusters, wherever
FlashInfer's plan has the template's chunk count and every request has the
same length; for unequal lengths each request's chunk follows its own length,
where FlashInfer's host plan takes one chunk from their total: still at most
the template's chunks per tile). Chunks past the end of L
become empty works (``kv_start == kv_end == 0``: no key tile; the kernel
writes a partial of lse -inf that its merge skips). The launch, the grid and
the partial / merge offsets stay what was captured: a CUDA graph of
``plan`` + ``run`` replays for any lengths.

``plan`` also copies each request's page list into the persistent
``kv_indices`` buffer FlashInfer reads (request r's pages at
``r * page_stride``) and sets each row's prefix (its request's first row's
local bound); ``run`` is FA3 then ``mla_tail_merge.tail_merge`` (each row's
remaining keys, natural-log LSE, empty rows masked), as
``flashinfer_sm90_mla`` does.

On an H100 (benchmarks/RESULTS.md, run 23) a lone q_len 4 bf16 request runs
at the host plan's speed, 0.72-0.99 of the FLASHMLA rows' time at 16-64K local
keys, with a 1.5-2.2 us plan launch per forward instead of 0.6-1.7 ms of host
work. Not selected by any backend yet.

Imports no vllm module at the top; flashinfer is imported inside the class.
Shapes: T = R x s query rows, H heads, W works, Dv = kv_lora_rank (512),
Dr = rope dim (64), P pages, page = tokens per page, B block-table columns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the device plan needs Triton
    triton = None

__all__ = [
    "FA3WorkTemplate",
    "FlashInferSm90DevicePlan",
    "MLA_PLAN_FIELDS",
    "fa3_chunk_keys",
    "fa3_cluster_size",
    "fa3_layout",
    "plan_works",
    "read_plan_arrays",
    "template_kv_len",
]

# MLAPlanInfo::ToVector's order (scheduler.cuh).
MLA_PLAN_FIELDS = (
    "num_blks_x", "num_blks_y", "q_indptr", "kv_indptr", "partial_indptr",
    "merge_packed_offset_start", "merge_packed_offset_end",
    "merge_partial_packed_offset_start", "merge_partial_packed_offset_end",
    "merge_partial_stride", "q_len", "kv_len", "q_start", "kv_start", "kv_end",
    "work_indptr", "partial_o", "partial_lse")
WORK_FIELDS = ("q_indptr", "kv_indptr", "partial_indptr", "q_len", "kv_len",
               "q_start", "kv_start", "kv_end")
MERGE_FIELDS = ("merge_packed_offset_start", "merge_packed_offset_end",
                "merge_partial_packed_offset_start", "merge_partial_packed_offset_end",
                "merge_partial_stride")
CTA_TILE_Q = 64  # packed query rows per CTA of FlashInfer's sm90 MLA kernel


def fa3_cluster_size(q_len: int, num_heads: int) -> int:
    """CTAs per cluster in FlashInfer's plan: 2 where a request's packed query
    rows (``q_len x H``) exceed one CTA's tile, else 1."""
    return 2 if q_len * num_heads > CTA_TILE_Q else 1


def fa3_layout(num_reqs: int, q_len: int, num_heads: int, num_sms: int) -> tuple[int, int]:
    """FlashInfer's cluster choice for R uniform requests: ``(tiles, clusters)``,
    the packed-row tiles of all requests and the clusters (grid rows)."""
    cluster = fa3_cluster_size(q_len, num_heads)
    tile = CTA_TILE_Q * cluster
    return num_reqs * -(-q_len * num_heads // tile), num_sms // cluster


def fa3_chunk_keys(kv_len: int, tiles: int, clusters: int) -> int:
    """FlashInfer's ``kv_len_limit`` when all ``tiles`` tiles have ``kv_len``
    keys: the keys per chunk (the mean keys per cluster, rounded up)."""
    mean = max(-(-tiles * kv_len // clusters), 1)
    for bound, keys in ((8, 32), (16, 64), (32, 128), (64, 192)):
        if mean <= bound:
            return keys
    return -(-mean // 256) * 256


def template_kv_len(tiles: int, clusters: int, at_least: int = 1) -> int:
    """The shortest prefix of at least ``at_least`` keys at which FlashInfer
    cuts every tile into the most chunks it ever does, ``ceil(clusters /
    tiles)`` (its chunk is at least ``tiles x L / clusters`` keys)."""
    most = -(-clusters // tiles)
    for units in range(max(1, -(-at_least // (most * 256))), 1 << 20):
        kv_len = most * 256 * units
        if -(-kv_len // fa3_chunk_keys(kv_len, tiles, clusters)) == most:
            return kv_len
    raise ValueError(f"no template length for {tiles} tiles on {clusters} clusters")


def read_plan_arrays(plan_info, int_workspace: torch.Tensor,
                     num_sms: int) -> dict[str, list[int]]:
    """FlashInfer's MLA plan arrays from its (host copy of the) int workspace.

    Args:
        plan_info: the 18 int64 of ``MLAPlanInfo`` (``MLA_PLAN_FIELDS``).
        int_workspace: uint8 CPU buffer the plan staged (byte offsets).
        num_sms: the device's SM count (length of the merge arrays).

    Returns:
        ``WORK_FIELDS`` ([W] each, W works), ``MERGE_FIELDS`` ([num_sms]
        each) and ``work_indptr`` ([clusters + 1]) as lists of ints, plus
        ``offsets``: each field's int32 element offset in the workspace.
    """
    info = dict(zip(MLA_PLAN_FIELDS, (int(v) for v in plan_info)))
    words = int_workspace.view(torch.int32)
    offsets = {name: info[name] // 4 for name in WORK_FIELDS + MERGE_FIELDS
               + ("work_indptr",)}
    clusters = info["num_blks_y"]
    work_indptr = words[offsets["work_indptr"]:][:clusters + 1].tolist()
    num_works = work_indptr[-1]
    arrays = {name: words[offsets[name]:][:num_works].tolist() for name in WORK_FIELDS}
    arrays.update({name: words[offsets[name]:][:num_sms].tolist()
                   for name in MERGE_FIELDS})
    arrays["work_indptr"] = work_indptr
    arrays["offsets"] = offsets
    arrays["grid"] = [info["num_blks_x"], clusters]
    return arrays


@dataclass(frozen=True)
class FA3WorkTemplate:
    """The works of a template plan and where the device rewrites them.

    Attributes:
        work_req: [W] request of each work. work_chunk: [W] its chunk index
            (chunk c of a tile covers keys ``[c x chunk, (c + 1) x chunk)``).
        num_chunks: chunks per tile, ``ceil(clusters / tiles)``.
        tiles, clusters: as ``fa3_layout``.
        kv_len_at, kv_start_at, kv_end_at: int32 element offsets of the
            three per-work arrays in FlashInfer's int workspace.
    """

    work_req: tuple[int, ...]
    work_chunk: tuple[int, ...]
    num_chunks: int
    tiles: int
    clusters: int
    kv_len_at: int
    kv_start_at: int
    kv_end_at: int

    @property
    def num_works(self) -> int:
        return len(self.work_req)

    @property
    def num_reqs(self) -> int:
        return max(self.work_req) + 1

    @classmethod
    def from_plan(cls, arrays: dict, *, num_reqs: int, q_len: int, num_heads: int,
                  page_stride: int, kv_len: int, tiles: int,
                  clusters: int) -> FA3WorkTemplate:
        """Check a template plan (``read_plan_arrays`` of FlashInfer's plan of
        R requests of ``kv_len`` keys, request r's pages at ``r x
        page_stride``) has the structure the device plan keeps, and take its
        works. Raises ValueError naming what differs."""
        cluster = fa3_cluster_size(q_len, num_heads)
        if list(arrays["grid"]) != [cluster, clusters]:
            raise ValueError(
                f"FA3 template plan's grid {arrays['grid']} is not [{cluster}, "
                f"{clusters}] for {q_len} x {num_heads} query rows: FlashInfer's MLA "
                f"plan changed; use the host plan (flashinfer_sm90_mla)")
        chunk = fa3_chunk_keys(kv_len, tiles, clusters)
        most = -(-clusters // tiles)
        seen: dict[tuple[int, int], list[int]] = {}
        reqs, chunks = [], []
        for w, work in enumerate(zip(*(arrays[name] for name in WORK_FIELDS))):
            q_at, kv_at, partial, ql, kl, q_start, start, end = work
            req = q_at // q_len
            problems = [
                q_at != req * q_len or req >= num_reqs,
                ql != q_len, kl != kv_len, kv_at != req * page_stride,
                partial < 0 and most > 1, start % chunk != 0,
                end != min(start + chunk, kv_len)]
            if any(problems):
                raise ValueError(
                    f"FA3 template work {w} ({dict(zip(WORK_FIELDS, work))}) "
                    f"is not a chunk of {chunk} keys of one of {num_reqs} requests "
                    f"of {q_len} rows and {kv_len} keys: FlashInfer's MLA plan "
                    f"changed; use the host plan (flashinfer_sm90_mla)")
            seen.setdefault((req, q_start), []).append(start // chunk)
            reqs.append(req)
            chunks.append(start // chunk)
        if len(seen) != tiles or any(sorted(c) != list(range(most)) for c in seen.values()):
            raise ValueError(
                f"FA3 template plan has tiles {sorted(seen)} with chunks "
                f"{[sorted(c) for c in seen.values()]}, not {tiles} tiles of "
                f"{most} chunks: use the host plan (flashinfer_sm90_mla)")
        offsets = arrays["offsets"]
        return cls(work_req=tuple(reqs), work_chunk=tuple(chunks), num_chunks=most,
                   tiles=tiles, clusters=clusters, kv_len_at=offsets["kv_len"],
                   kv_start_at=offsets["kv_start"], kv_end_at=offsets["kv_end"])


if triton is not None:

    @triton.jit
    def _plan_works_kernel(
        row_lens_ptr, table_ptr, table_stride,
        work_req_ptr, work_chunk_ptr,
        kv_len_ptr, kv_start_ptr, kv_end_ptr,
        row_prefix_ptr, kv_indices_ptr,
        num_works, q_len, num_cols, page_stride, tiles, clusters,
        BLOCK_W: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_C: tl.constexpr,
    ):
        """Program r: request r's prefix L (its first row's local bound), the
        key range of each of its works, its rows' prefix, its page list."""
        r = tl.program_id(0)
        prefix = tl.load(row_lens_ptr + r * q_len)
        # FlashInfer's kv_len_limit at L (fa3_chunk_keys).
        mean = tl.maximum((prefix * tiles + clusters - 1) // clusters, 1)
        chunk = tl.where(mean <= 8, 32, tl.where(mean <= 16, 64, tl.where(
            mean <= 32, 128, tl.where(mean <= 64, 192, (mean + 255) // 256 * 256))))
        w = tl.arange(0, BLOCK_W)
        mine = (w < num_works) & (tl.load(work_req_ptr + w, mask=w < num_works,
                                          other=-1) == r)
        start = tl.load(work_chunk_ptr + w, mask=mine, other=0) * chunk
        live = start < prefix
        end = tl.minimum(start + chunk, prefix)
        # A chunk past L: no keys, and no key tile (start a multiple of 64).
        tl.store(kv_start_ptr + w, tl.where(live, start, 0), mask=mine)
        tl.store(kv_end_ptr + w, tl.where(live, end, 0), mask=mine)
        tl.store(kv_len_ptr + w, tl.zeros_like(w) + prefix, mask=mine)
        rows = tl.arange(0, BLOCK_Q)
        tl.store(row_prefix_ptr + r * q_len + rows, tl.zeros_like(rows) + prefix,
                 mask=rows < q_len)
        for col0 in range(0, num_cols, BLOCK_C):
            cols = col0 + tl.arange(0, BLOCK_C)
            pages = tl.load(table_ptr + r * table_stride + cols, mask=cols < num_cols)
            tl.store(kv_indices_ptr + r * page_stride + cols, pages, mask=cols < num_cols)


def plan_works(template: FA3WorkTemplate, row_lens: torch.Tensor,
               block_table: torch.Tensor, int_workspace: torch.Tensor,
               work_req: torch.Tensor, work_chunk: torch.Tensor,
               row_prefix: torch.Tensor, kv_indices: torch.Tensor, *,
               q_len: int, page_stride: int) -> None:
    """Rewrite a template plan's works for the device lengths (one launch,
    no host sync).

    Args:
        template: the template's works and offsets.
        row_lens: int32 [>= R x s] exact local keys of each row; request r's
            prefix is its first row's, ``row_lens[r x s]`` (a request's
            bounds never fall along its rows).
        block_table: int32 [R, B] local pages of each request (row stride
            any, columns contiguous), B <= ``page_stride``.
        int_workspace: FlashInfer's int workspace on the device (any dtype;
            its int32 words at the template's offsets are rewritten).
        work_req, work_chunk: int32 [W] the template's works on the device.
        row_prefix: int32 [>= R x s] out: each row's prefix.
        kv_indices: int32 [>= R x page_stride] out: FlashInfer's page list.
        q_len: s, rows per request. page_stride: pages between requests in
            ``kv_indices`` (the template's ``kv_indptr`` step).
    """
    num_reqs, num_cols = block_table.shape
    if num_cols > page_stride:
        raise ValueError(f"FA3 device plan: {num_cols} block-table columns exceed "
                         f"the {page_stride} planned per request")
    # One program per block-table row writes that request's rows and pages.
    num_rows = template.num_reqs * q_len
    if (num_reqs != template.num_reqs or row_lens.numel() < num_rows
            or row_prefix.numel() < num_rows
            or kv_indices.numel() < num_reqs * page_stride):
        raise ValueError(
            f"FA3 device plan of {template.num_reqs} requests x {q_len} rows given a "
            f"block table of {num_reqs} rows, {row_lens.numel()} row lengths, "
            f"{row_prefix.numel()} row prefixes, {kv_indices.numel()} page slots")
    words = int_workspace.view(torch.int32)
    num_works = template.num_works
    _plan_works_kernel[(num_reqs,)](
        row_lens, block_table, block_table.stride(0), work_req, work_chunk,
        words[template.kv_len_at:], words[template.kv_start_at:],
        words[template.kv_end_at:], row_prefix, kv_indices,
        num_works, q_len, num_cols, page_stride, template.tiles, template.clusters,
        BLOCK_W=triton.next_power_of_2(num_works),
        BLOCK_Q=triton.next_power_of_2(q_len), BLOCK_C=256, num_warps=4)


class FlashInferSm90DevicePlan:
    """FA3 MLA decode of R uniform requests with a plan made on the device::

        mla = FlashInferSm90DevicePlan(workspace, num_reqs=1, q_len=4,
                                       num_heads=96, page_size=64,
                                       sm_scale=s, max_cols=B)
        mla.plan(row_lens, block_table, row_block_table)   # per forward
        out, lse = mla.run(q, kv_cache)                    # per layer

    The constructor makes FlashInfer's one host plan (the template) on a
    CUDA-graph wrapper; ``plan`` and ``run`` make no host sync and allocate
    nothing (``run`` given ``out`` and ``lse``), so both may be captured and
    replayed for any lengths up to ``max_cols`` pages per request.

    Args:
        workspace: uint8 CUDA buffer for FlashInfer (float workspace).
        num_reqs: R, requests (padding ones have no keys). q_len: s.
        num_heads: H. page_size: tokens per page. sm_scale: softmax scale.
        dtype: q and cache dtype (bf16 / fp16). max_cols: B, block-table
            columns of a request at most.
        num_sms: the device's SMs (FlashInfer's clusters follow them).
        has_tails: rows may see keys past their request's first row (a
            causal verify block under DCP); False for a block whose rows all
            have one bound (a DSpark block), where the finishing launch only
            converts the LSE and masks empty rows.
    """

    def __init__(self, workspace: torch.Tensor, *, num_reqs: int, q_len: int,
                 num_heads: int, page_size: int, sm_scale: float,
                 dtype: torch.dtype = torch.bfloat16, max_cols: int,
                 num_sms: int | None = None, kv_lora_rank: int = 512,
                 rope_dim: int = 64, has_tails: bool = True) -> None:
        from flashinfer.mla import BatchMLAPagedAttentionWrapper

        from vllm.v1.attention.ops.flashinfer_sm90_mla import plan_fa3_csr

        device = workspace.device
        if num_sms is None:
            num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        self.num_reqs, self.q_len, self.num_heads = num_reqs, q_len, num_heads
        self.page_size, self.sm_scale, self.dtype = page_size, sm_scale, dtype
        self.kv_lora_rank, self.rope_dim = kv_lora_rank, rope_dim
        self.has_tails = has_tails
        tiles, clusters = fa3_layout(num_reqs, q_len, num_heads, num_sms)
        # FlashInfer checks the template's page counts (ceil(L / page)), so
        # its length covers a request's whole block table.
        kv_len = template_kv_len(tiles, clusters, at_least=max_cols * page_size)
        self.page_stride = -(-kv_len // page_size)
        self.template_kv_len = kv_len
        i32 = dict(dtype=torch.int32, device=device)
        self.kv_indices = torch.zeros(num_reqs * self.page_stride, **i32)
        self.row_prefix = torch.zeros(num_reqs * q_len, **i32)
        self._wrapper = BatchMLAPagedAttentionWrapper(
            workspace, use_cuda_graph=True,
            qo_indptr=torch.zeros(num_reqs + 1, **i32),
            kv_indptr=torch.zeros(num_reqs + 1, **i32), kv_indices=self.kv_indices,
            kv_len_arr=torch.zeros(num_reqs, **i32), backend="fa3")
        reqs = torch.arange(num_reqs + 1, dtype=torch.int32)
        plan_fa3_csr(self._wrapper, self, reqs * q_len, reqs * self.page_stride,
                     self.kv_indices, torch.full((num_reqs,), kv_len, dtype=torch.int32),
                     causal=False)
        self._int_workspace = self._wrapper._int_workspace_buffer
        self.template_arrays = read_plan_arrays(
            self._wrapper._plan_info, self._wrapper._pin_memory_int_workspace_buffer,
            num_sms)
        self.template = FA3WorkTemplate.from_plan(
            self.template_arrays, num_reqs=num_reqs, q_len=q_len, num_heads=num_heads,
            page_stride=self.page_stride, kv_len=kv_len, tiles=tiles, clusters=clusters)
        self._work_req = torch.tensor(self.template.work_req, **i32)
        self._work_chunk = torch.tensor(self.template.work_chunk, **i32)
        self._tails: tuple[torch.Tensor, torch.Tensor] | None = None

    def plan(self, row_lens: torch.Tensor, block_table: torch.Tensor,
             row_block_table: torch.Tensor) -> None:
        """Plan a forward from device data (one launch).

        Args:
            row_lens: int32 [>= R x s] exact local keys of each row (0 on
                padding rows); read again by every ``run``.
            block_table: int32 [R, <= max_cols] local pages of each request.
            row_block_table: int32 [>= R x s, B] local pages of each row (for
                the tails).
        """
        plan_works(self.template, row_lens, block_table, self._int_workspace,
                   self._work_req, self._work_chunk, self.row_prefix, self.kv_indices,
                   q_len=self.q_len, page_stride=self.page_stride)
        self._tails = (row_lens, row_block_table)

    def work_arrays(self) -> dict[str, torch.Tensor]:
        """The device's current per-work key ranges (int32 [W] each)."""
        words = self._int_workspace.view(torch.int32)
        t = self.template
        return {name: words[at:at + t.num_works] for name, at in (
            ("kv_len", t.kv_len_at), ("kv_start", t.kv_start_at),
            ("kv_end", t.kv_end_at))}

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor, *,
            out: torch.Tensor | None = None,
            lse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer: FA3 over every request's prefix, then the tails.

        Args:
            q: [R x s, H, Dv + Dr]. kv_cache: [P, page, Dv + Dr].
            out, lse: optional [T, H, Dv] / float32 [T, H] outputs.

        Returns:
            ``(out [T, H, Dv] in q's dtype, lse [T, H] float32, natural log)``.
        """
        from vllm.v1.attention.ops.mla_tail_merge import tail_merge

        num_rows = self.num_reqs * self.q_len
        if self._tails is None or q.shape[0] != num_rows or q.shape[1] != self.num_heads:
            raise ValueError(
                f"FA3 device plan of {self.num_reqs} x {self.q_len} rows and "
                f"{self.num_heads} heads run on q {tuple(q.shape)}"
                + ("" if self._tails is not None else " before any plan"))
        if out is None:
            out = q.new_empty(num_rows, self.num_heads, self.kv_lora_rank)
        if lse is None:
            lse = torch.empty(num_rows, self.num_heads, dtype=torch.float32,
                              device=q.device)
        self._wrapper.run(query=q, kv_cache=kv_cache, out=out, lse=lse, return_lse=True)
        row_lens, row_block_table = self._tails
        tail_merge(q, kv_cache, row_block_table, row_lens[:num_rows],
                   self.row_prefix, out, lse, sm_scale=self.sm_scale,
                   lse_in_base2=True, has_tails=self.has_tails)
        return out, lse
