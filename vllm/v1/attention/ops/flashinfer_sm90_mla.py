# SPDX-License-Identifier: Apache-2.0
"""FlashInfer's Hopper (FA3) MLA decode on DCP rows: prefix segments + tails.

``flashinfer.mla.BatchMLAPagedAttentionWrapper(workspace, backend="fa3")``
takes ragged query offsets and paged-KV CSR metadata and returns the LSE.
Under DCP a request's per-token local bounds step by 0 or 1, so every token
sees its request's first local keys: the deployed plan
(``plan_prefix_tail_host`` from host data, then
``FlashInferSm90MLA.plan_prefix_tail``) gives FA3 one non-causal segment per
request over a host-known lower bound of those keys (the KV is read once, as
in FlashInfer's own multi-token decode), and ``run`` finishes every row with
``mla_tail_merge.tail_merge`` (its remaining keys from the device's exact
bounds, natural-log LSE, empty rows masked). The plan covers every row the
layers run (FlashInfer >= 0.7.4 runs only planned rows), writes its device
tensors into persistent buffers, and uses FlashInfer's CUDA-graph wrapper
for every segment count planned for a CUDA graph, so that a captured graph
of ``run`` calls replays correctly after every later plan (``run`` refuses
to be captured over a plan on the plain wrapper).

FlashInfer's own no-DCP decode (the benchmarks' baseline) and an eager plan
from device rows live beside the benchmarks (``tests/support/fa3_native.py``).

``run`` returns ``(out [T, H, Dv], lse [T, H])`` per query row with the LSE
in natural log, ready for ``dcp_decode.merge_partials``. flashinfer is
imported lazily (inside the class). From vllm only this package's own ops
modules are imported.

Shapes: T query rows, R requests, S planned segments, H heads,
Dv = kv_lora_rank (512), Dr = rope dim (64), P pages, page = tokens per page,
B block-table columns.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from itertools import accumulate, chain, repeat

import torch

from vllm.v1.attention.ops.dcp_decode import DCPLayout, FlatDecode
from vllm.v1.attention.ops.mla_tail_merge import tail_merge

__all__ = [
    "FlashInferSm90MLA",
    "PrefixTailPlan",
    "TailRows",
    "host_prefix_lens",
    "plan_fa3_csr",
    "plan_prefix_tail_host",
]


@dataclass
class PrefixTailPlan:
    """Host-side (CPU) plan of one forward pass's prefix+tail decode.

    Every one of the T query rows ``run`` receives is covered by a segment, as
    FlashInfer >= 0.7.4 requires (the rows run must be the rows planned):
    one segment per request with query tokens, over the request's prefix,
    then the padding rows in segments of the batch's largest query length,
    with no KV. For a uniform batch every segment has the same query length,
    so FA3's launch shape (which follows the mean packed query rows per
    segment) is the same for every batch of one CUDA-graph size.

    Attributes:
        qo_indptr: int32 [S + 1], segment query offsets; ``qo_indptr[-1] == T``.
        kv_lens: int32 [S], prefix KV tokens of each segment (local).
        kv_indptr: int32 [S + 1], ``cumsum(ceil(kv_lens / page))``.
        seg_to_req: int64 [S], block-table row (request) of each segment
            (0 for padding segments, which read no page).
        row_prefix: int32 [T], prefix KV tokens of each row's segment.
    """

    qo_indptr: torch.Tensor
    kv_lens: torch.Tensor
    kv_indptr: torch.Tensor
    seg_to_req: torch.Tensor
    row_prefix: torch.Tensor

    @property
    def num_rows(self) -> int:
        return self.row_prefix.shape[0]

    @property
    def num_segments(self) -> int:
        return self.kv_lens.shape[0]


@dataclass
class TailRows:
    """Per-row inputs of the tail kernel, fixed by ``plan_prefix_tail`` for
    every ``run`` of the forward (views of the caller's row metadata and of
    the adapter's persistent prefix buffer, so a captured graph reads each
    later plan's values).

    Attributes:
        block_table: int32 [>= T, B] local block table of every query row.
        row_lens: int32 [>= T] exact local KV tokens of every row (0 on
            empty and padding rows).
        prefix_lens: int32 [>= T] local KV tokens of the row's FA3 segment
            (``PrefixTailPlan.row_prefix`` on the device); the tail is
            ``[prefix_lens, row_lens)``.
    """

    block_table: torch.Tensor
    row_lens: torch.Tensor
    prefix_lens: torch.Tensor


def plan_prefix_tail_host(
    query_start_loc: torch.Tensor,
    prefix_lens: torch.Tensor,
    *,
    num_rows: int,
    page_size: int,
    whole_pages: bool = True,
) -> PrefixTailPlan:
    """Segments of a prefix+tail decode, from host data only.

    With ``whole_pages`` each segment's prefix is rounded down to whole
    pages (the tail kernel attends the rest, fewer than ``page_size`` keys
    more per row). FA3's schedule depends on the segments' query and KV
    lengths only, so it then stays the same until a request fills a page,
    and ``FlashInferSm90MLA.plan_prefix_tail`` skips FlashInfer's host plan
    (milliseconds, benchmarks/RESULTS.md) while it does.

    Args:
        query_start_loc: int CPU [R + 1], the decode requests' query offsets;
            rows from ``query_start_loc[-1]`` to ``num_rows`` are padding.
        prefix_lens: int CPU [R], local KV tokens that every query token of
            the request sees (a lower bound of each token's local bound;
            negative values count as 0).
        num_rows: T, query rows of the layers' input.
        page_size: tokens per KV page.
        whole_pages: round each prefix down to a multiple of ``page_size``.
    """
    # Python ints and one tensor: torch's per-op cost on small CPU tensors
    # would dominate the builder's host time.
    qsl = query_start_loc.tolist()
    prefix = prefix_lens.tolist()
    num_tokens = min(qsl[-1], num_rows)
    reqs = [req for req, (start, end) in enumerate(zip(qsl, qsl[1:]))
            if start < end and start < num_tokens]
    keys = [max(prefix[req], 0) for req in reqs]
    if whole_pages:
        keys = [n - n % page_size for n in keys]
    pad_len = max(max((end - start for start, end in zip(qsl, qsl[1:])), default=0), 1)
    pads = list(range(num_tokens, num_rows, pad_len))
    qo_indptr = [qsl[req] for req in reqs] + pads + [num_rows]
    kv_lens = keys + [0] * len(pads)
    kv_indptr = list(accumulate([-(-n // page_size) for n in kv_lens], initial=0))
    seg_q_lens = [end - start for start, end in zip(qo_indptr, qo_indptr[1:])]
    row_prefix = list(chain.from_iterable(map(repeat, kv_lens, seg_q_lens)))
    num_segs = len(kv_lens)
    packed = torch.frombuffer(array("i", qo_indptr + kv_lens + kv_indptr + row_prefix),
                              dtype=torch.int32)
    qo, kv, indptr, rows = packed.split([num_segs + 1, num_segs, num_segs + 1,
                                         len(row_prefix)])
    return PrefixTailPlan(qo_indptr=qo, kv_lens=kv, kv_indptr=indptr,
                          seg_to_req=torch.tensor(reqs + [0] * len(pads)),
                          row_prefix=rows)


def host_prefix_lens(
    global_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    causal: bool,
    slack: int,
    layout: DCPLayout,
) -> torch.Tensor:
    """Local KV tokens that every query token of each request sees, from host
    data only.

    A request of global length ``L`` and ``n`` query tokens: token ``t`` sees
    ``L - n + 1 + t`` tokens (causal) or ``L`` (non-causal), so all see the
    first token's bound. vLLM's host lengths may exceed the device's by up to
    ``slack`` tokens (draft tokens not yet known to be rejected, under async
    speculative decoding), so the bound is taken ``slack`` lower; the tail
    kernel covers the rest from the device's exact per-row bounds.

    Args:
        global_lens: int CPU [>= R], host global lengths (an upper bound of
            the exact ones by at most ``slack``).
        query_start_loc: int CPU [R + 1], the requests' query offsets.
        layout: the DCP split, seen from this rank.

    Returns:
        int64 CPU [R], local lengths on ``layout.rank`` (0 where the bound
        is <= 0).
    """
    num_reqs = query_start_loc.shape[0] - 1
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).to(torch.int64)
    first = global_lens[:num_reqs].to(torch.int64) - slack
    if causal:
        first = first - (q_lens - 1)
    return layout.local_seq_lens(first.clamp(min=0))


def plan_fa3_csr(wrapper, shape, qo_indptr, kv_indptr, kv_indices, kv_lens, *,
                 causal: bool) -> None:
    """Plan FlashInfer's FA3 MLA wrapper over S segments given in CSR form.

    Args:
        wrapper: a ``flashinfer.mla.BatchMLAPagedAttentionWrapper``
            (``backend="fa3"``).
        shape: what the plan is for: ``num_heads``, ``kv_lora_rank``,
            ``rope_dim``, ``page_size``, ``sm_scale``, ``dtype`` attributes
            (a ``FlashInferSm90MLA``, or a baseline with the same fields).
        qo_indptr: int CPU [S + 1] segment query offsets.
        kv_indptr: int CPU [S + 1] segment page offsets.
        kv_indices: int32 [>= kv_indptr[-1]] page ids, on the device.
        kv_lens: int CPU [S] KV tokens of each segment.
        causal: bottom-right aligned causal mask within each segment.

    The LSE ``run`` then returns is base 2 (``lse_mode="base2"``).
    """
    from flashinfer.mla import MLAPlanMetadata

    wrapper.plan(
        metadata=MLAPlanMetadata.csr(
            qo_indptr=qo_indptr.to(torch.int32),
            kv_indptr=kv_indptr.to(torch.int32),
            kv_indices=kv_indices,
            kv_len_arr=kv_lens.to(torch.int32),
        ),
        num_heads=shape.num_heads,
        head_dim_ckv=shape.kv_lora_rank,
        head_dim_kpe=shape.rope_dim,
        page_size=shape.page_size,
        causal=causal,
        sm_scale=shape.sm_scale,
        q_data_type=shape.dtype,
        kv_data_type=shape.dtype,
        lse_mode="base2",
    )


def _capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on ``device``'s current stream."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host-to-device copy without a device-to-host sync."""
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


class FlashInferSm90MLA:
    """Absorbed-MLA decode on sm90 through FlashInfer's FA3 MLA wrapper.

    One plan per forward pass, one ``run`` per layer::

        mla = FlashInferSm90MLA(workspace, num_heads=H, page_size=64,
                                sm_scale=s, dtype=torch.bfloat16,
                                max_rows=T, max_cols=B)
        mla.plan_prefix_tail(host_plan, block_table, row_lens, row_tables)
        out, lse = mla.run(q, kv_cache)     # per layer

    ``plan_prefix_tail`` takes the segments from host data
    (``plan_prefix_tail_host``) and makes no device-to-host sync of its own;
    its device tensors go into persistent buffers, so that a CUDA graph
    captured over ``run`` replays correctly after every later plan of a batch
    with the same row count and segment shape.

    Args:
        workspace: uint8 CUDA buffer for FlashInfer (128 MiB is usual).
        num_heads: H query heads on this rank.
        page_size: tokens per KV page.
        sm_scale: softmax scale applied to ``q . k``.
        dtype: query and KV dtype (bf16 / fp16).
        kv_lora_rank: Dv, the latent (value) width.
        rope_dim: Dr, the rope width (key = Dv + Dr).
        max_rows, max_cols: capacity of the persistent plan buffers (query
            rows and block-table columns), fixed: a captured graph keeps
            their addresses.
        tail_keys_per_step, tail_num_stages: the tail kernel's keys per
            loop step and pipelining stages (``mla_tail_merge.tail_merge``);
            64 keys take a whole-page tail in one or two steps (benchmarks/
            RESULTS.md, run 14).

    A wrapper whose last FlashInfer plan had the same schedule (segment
    query offsets, page offsets and KV lengths) is not planned again: FA3
    reads the page ids from the persistent index buffer when it runs, and
    ``plan_prefix_tail`` rewrites that buffer every forward. ``fa3_plans``
    counts the FlashInfer plans made.
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
        max_rows: int,
        max_cols: int,
        tail_keys_per_step: int = 64,
        tail_num_stages: int = 2,
    ) -> None:
        from flashinfer.mla import BatchMLAPagedAttentionWrapper

        self._wrapper_cls = BatchMLAPagedAttentionWrapper
        self._workspace = workspace
        self._eager_wrapper = BatchMLAPagedAttentionWrapper(workspace, backend="fa3")
        self._wrapper = self._eager_wrapper
        self._graph_wrappers: dict[int, object] = {}
        # Segment counts S planned ``for_graph``: their plans go through a
        # FlashInfer CUDA-graph wrapper (one per S, made on first use, with
        # reserved metadata buffers and an integer workspace that every later
        # plan of that S rewrites in place); other plans use the plain
        # wrapper, which a CUDA graph must never capture (it allocates a new
        # workspace per plan: ``run`` refuses it while capturing).
        self._graph_segment_counts: set[int] = set()
        self.device = workspace.device
        self.num_heads = num_heads
        self.page_size = page_size
        self.sm_scale = sm_scale
        self.dtype = dtype
        self.kv_lora_rank = kv_lora_rank
        self.rope_dim = rope_dim
        self.num_tokens = 0
        self.tail: TailRows | None = None
        self.tail_args = dict(keys_per_step=tail_keys_per_step,
                              num_stages=tail_num_stages)
        self.fa3_plans = 0
        self.planned_forward_id = 0  # ``plan_rows``' forward_id
        # id(wrapper) -> (qo_indptr, kv_indptr, kv_lens) of its last plan.
        self._schedules: dict[int, tuple[torch.Tensor, ...]] = {}
        self._max_rows, self._max_cols = max_rows, max_cols
        # Segments <= rows; one spare slot takes the scatter of dead columns.
        self._kv_indices = torch.zeros(max_rows * max_cols + 1, dtype=torch.int32,
                                       device=self.device)
        self._row_prefix = torch.zeros(max_rows, dtype=torch.int32,
                                       device=self.device)

    def _check_capacity(self, num_rows: int, num_cols: int) -> None:
        if num_rows > self._max_rows or num_cols > self._max_cols:
            raise ValueError(
                f"FA3 MLA plan of {num_rows} rows x {num_cols} block-table "
                f"columns exceeds the buffers sized at start-up "
                f"({self._max_rows} x {self._max_cols}); raise --max-num-seqs "
                f"or --max-model-len consistently")

    def _on_graph_wrapper(self, num_segments: int) -> bool:
        """Whether plans of S segments go through a CUDA-graph wrapper."""
        return num_segments in self._graph_segment_counts

    def _wrapper_for(self, num_segments: int):
        """The CUDA-graph wrapper of S segments (FlashInfer keeps its
        metadata pointers and integer workspace fixed across its replans),
        or the plain one where S is not a graph's segment count."""
        if not self._on_graph_wrapper(num_segments):
            return self._eager_wrapper
        wrapper = self._graph_wrappers.get(num_segments)
        if wrapper is None:
            i32 = dict(dtype=torch.int32, device=self.device)
            wrapper = self._wrapper_cls(
                self._workspace, use_cuda_graph=True,
                qo_indptr=torch.zeros(num_segments + 1, **i32),
                kv_indptr=torch.zeros(num_segments + 1, **i32),
                kv_indices=self._kv_indices[:-1],
                kv_len_arr=torch.zeros(num_segments, **i32),
                backend="fa3")
            self._graph_wrappers[num_segments] = wrapper
        return wrapper

    # ---------------------------------------------------------------- plans
    def plan_rows(
        self,
        query_start_loc: torch.Tensor,
        host_seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        rows: FlatDecode,
        *,
        num_rows: int,
        causal: bool,
        slack: int,
        layout: DCPLayout,
        for_graph: bool = False,
        forward_id: int = 0,
    ) -> None:
        """The backend's per-forward plan, from host data: each request's
        prefix (``host_prefix_lens``, ``slack`` below vLLM's host lengths),
        its whole-page segments (``plan_prefix_tail_host``), then
        ``plan_prefix_tail``.

        Args:
            query_start_loc: int CPU [R + 1], the decode requests' query
                offsets (equal to the device's).
            host_seq_lens: int CPU [>= R], vLLM's host global lengths, an
                upper bound of the device's by at most ``slack``.
            block_table: int32 [R, B] local block table of the requests.
            rows: the forward's ``FlatDecode`` (``seq_lens``, ``block_table``
                of every row, on the device).
            num_rows: T, query rows the layers run (padding included).
            forward_id: the caller's id of this forward, kept as
                ``planned_forward_id`` for the layers to check.
        """
        prefix = host_prefix_lens(host_seq_lens, query_start_loc, causal=causal,
                                  slack=slack, layout=layout)
        plan = plan_prefix_tail_host(query_start_loc, prefix, num_rows=num_rows,
                                     page_size=self.page_size)
        self.plan_prefix_tail(plan, block_table, rows.seq_lens, rows.block_table,
                              for_graph=for_graph)
        self.planned_forward_id = forward_id

    def plan_prefix_tail(
        self,
        plan: PrefixTailPlan,
        block_table: torch.Tensor,
        row_lens: torch.Tensor,
        row_block_table: torch.Tensor,
        *,
        for_graph: bool = False,
    ) -> None:
        """Plan FA3 over the prefix segments; ``run`` adds the tails.

        Args:
            plan: the host plan (``plan_prefix_tail_host``) of T rows.
            block_table: int32 [R, B] local block table of the requests.
            row_lens: int32 [>= T] exact local KV tokens of every row
                (``FlatDecode.seq_lens``; 0 on padding rows).
            row_block_table: int32 [>= T, B] local block table of every row.
            for_graph: the forward will be captured in a CUDA graph (and this
                segment count replayed): plan it, and every later plan of
                the same segment count, on a CUDA-graph wrapper.
        """
        num_rows, num_segs = plan.num_rows, plan.num_segments
        if for_graph:
            self._graph_segment_counts.add(num_segs)
        num_cols = block_table.shape[1]
        self._check_capacity(num_rows, num_cols)
        device = self.device
        # Page list of every segment, written into the persistent index
        # buffer on the device (FlashInfer keeps its pointer for the run).
        seg_to_req = _to_device(plan.seg_to_req, device)
        kv_indptr_dev = _to_device(plan.kv_indptr, device)
        pages = kv_indptr_dev[1:] - kv_indptr_dev[:-1]
        cols = torch.arange(num_cols, dtype=torch.int32, device=device)
        live = cols[None, :] < pages[:, None]
        spare = self._kv_indices.shape[0] - 1
        dest = torch.where(live, kv_indptr_dev[:-1, None] + cols[None, :], spare)
        tables = block_table.index_select(0, seg_to_req)
        self._kv_indices.scatter_(0, dest.reshape(-1).long(),
                                  tables.to(torch.int32).reshape(-1))
        self._row_prefix[:num_rows].copy_(_to_device(plan.row_prefix, device))
        self._wrapper = self._wrapper_for(num_segs)
        schedule = (plan.qo_indptr, plan.kv_indptr, plan.kv_lens)
        last = self._schedules.get(id(self._wrapper))
        if last is None or not all(map(torch.equal, last, schedule)):
            plan_fa3_csr(self._wrapper, self, plan.qo_indptr, plan.kv_indptr,
                         self._kv_indices[:spare], plan.kv_lens, causal=False)
            self._schedules[id(self._wrapper)] = schedule
            self.fa3_plans += 1
        self.num_tokens = num_rows
        self.tail = TailRows(block_table=row_block_table, row_lens=row_lens,
                             prefix_lens=self._row_prefix)

    # ------------------------------------------------------------------ run
    def run(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        *,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of the planned rows for one layer (no host sync).

        FA3 writes every row's prefix partial, then ``tail_merge`` adds the
        row's tail keys, converts the LSE to natural log and masks rows with
        no local KV (padding included): out 0, lse -inf.

        Args:
            q: [T, H, Dv + Dr] queries (absorbed latent part, then rope part);
                T must be the planned row count.
            kv_cache: [P, page, Dv + Dr] paged latent cache of this rank.
            out, lse: optional [T, H, Dv] / float32 [T, H] contiguous outputs.

        Returns:
            ``(out [T, H, Dv] in q's dtype, lse [T, H] float32, natural log)``.
        """
        num_tokens = q.shape[0]
        if self.tail is None or num_tokens != self.num_tokens:
            raise ValueError(
                f"FA3 MLA run of {num_tokens} rows, but the last plan was for "
                f"{self.num_tokens}: plan every forward's rows before running")
        if self._wrapper is self._eager_wrapper and _capturing(q.device):
            raise RuntimeError(
                f"FA3 MLA: a CUDA graph is being captured over a plan of "
                f"{self.num_tokens} rows on FlashInfer's plain wrapper, whose "
                f"workspace the next plan frees; plan graph shapes with "
                f"for_graph=True (the metadata builder's "
                f"build_for_cudagraph_capture does)")
        if q.shape[1] != self.num_heads or q.dtype != self.dtype:
            raise ValueError(
                f"FA3 MLA planned for {self.num_heads} heads of {self.dtype}, "
                f"got {q.shape[1]} of {q.dtype}")
        if out is None:
            out = q.new_empty(num_tokens, q.shape[1], self.kv_lora_rank)
        if lse is None:
            lse = torch.empty(num_tokens, q.shape[1], dtype=torch.float32,
                              device=q.device)
        self._wrapper.run(query=q, kv_cache=kv_cache, out=out, lse=lse,
                          return_lse=True)
        tail = self.tail
        tail_merge(q, kv_cache, tail.block_table, tail.row_lens[:num_tokens],
                   tail.prefix_lens[:num_tokens], out, lse,
                   sm_scale=self.sm_scale, lse_in_base2=True, **self.tail_args)
        return out, lse
