# SPDX-License-Identifier: Apache-2.0
"""vLLM's FlashMLA decode kernel on a rank's DCP rows: one call per layer over
each request's shared local prefix, plus the causal tails.

FlashMLA (``flash_mla_with_kvcache``, bf16; ``flash_mla_with_kvcache_fp8``)
keeps a request's query tokens in one tile: q [R, s, H, D], one cache length
per request, and either no mask (every token sees ``cache_seqlens``) or a
causal mask aligned to the end of the whole sequence, which is wrong for a
rank's interleaved shard of it. Under DCP every token of a request sees the
local keys its first token sees (the bounds grow with the token, or are all
equal in a non-causal DSpark block), so:

- FlashMLA runs ``causal=False`` over that shared prefix, the first token's
  local bound (``DCPDecodeMetadata.flat.seq_lens`` of the request's first
  row, read on the device);
- a causal verify block's later tokens add their remaining local keys, at
  most ``s - 1`` of them, through ``mla_tail_merge.tail_merge``, which also
  merges the two partials, reads FlashMLA's LSE layout into vLLM's and
  zeroes rows with no local key: one launch after FlashMLA's for every row.
  A draft block has no tail (every token's bound is the prefix): the same
  launch, built without the tail code, only finishes its rows.

vLLM's scheduler cuts verify blocks short when a step's token budget runs
out (and near ``max_model_len``), so a decode batch may be ragged: request
``r`` has ``n_r <= s`` query tokens, ``s`` the longest. Such a batch runs on
tiles padded to ``s`` tokens: the rows are gathered into the tiles by the
device query offsets, a padded token repeats a real row (its output is never
read back), FlashMLA attends every tile token over the request's prefix, and
each row's partial is read back from its tile before the tail launch. vLLM
captures only uniform decode batches in its CUDA graphs (``UNIFORM_BATCH``),
so a ragged batch runs eagerly and its index tensors are made per forward.

Everything is read from device tensors written once per forward into
persistent buffers (``FlashMLARowPlanner``): no host data, nothing to go
stale under async scheduling, and a CUDA graph captured over ``run``
replays each later plan. bf16: FlashMLA's scheduler metadata is made on the
device by the forward's first layer and reused by the others (FlashMLA's own
contract: same shapes and lengths), inside the graph when captured; fp8: the
planner makes it (``get_mla_metadata_dense_fp8``) into persistent buffers, as
vLLM's FLASHMLA builder does.

A uniform DSpark block (every token sees its request's prefix) is given to
FlashMLA with its s tokens as s x H heads of one token: the same tiles, and
the output and LSE come out in vLLM's layout, so only the rows with no
local key are masked after it (``flashmla_token_rows.mask_empty_rows``).

A lone bf16 request's block runs FlashInfer's FA3 instead where the builder
gives the planner ``FA3RowPlans`` (``flashmla_fa3_rows``: faster there on an
H100), with its plan made on the device and the same finishing launch.

Where FlashMLA's 64-row tiles allow it and it measured faster
(``flashmla_token_rows``: fp8, the heads a multiple of 64), every row is
given to FlashMLA as a request of one token over exactly its local keys
instead: no tails, the output already in vLLM's layout, and only the rows
with no local key masked after it.

The kernels are vLLM's (``vllm.v1.attention.ops.flashmla``), imported when a
plan is made; nothing of vllm is imported at module level.

Shapes: R decode requests, s query tokens per FlashMLA tile (the longest
request's), T rows (R * s in a uniform batch), H heads, D = Dv + Dr
(512 + 64), P pages of 64.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from vllm.v1.attention.ops.dcp_decode import FlatDecode
from vllm.v1.attention.ops.flashmla_fa3_rows import FA3RowPlans, fa3_rows_preferred
from vllm.v1.attention.ops.flashmla_pieces import PiecePlanner, pieces_for
from vllm.v1.attention.ops.flashmla_token_rows import (
    MAX_REQS as SMALL_BATCH,
    mask_empty_rows,
    token_rows_preferred,
)
from vllm.v1.attention.ops.mla_tail_merge import tail_merge

__all__ = ["FlashMLARowPlan", "FlashMLARowPlanner", "TILE_METADATA_WIDTH"]

# FlashMLA's TileSchedulerMetaDataSize: int32 entries per SM partition.
TILE_METADATA_WIDTH = 8


def _flashmla_ops():
    from vllm.v1.attention.ops import flashmla

    return flashmla


@dataclass
class FlashMLARowPlan:
    """One forward's FlashMLA decode of a rank's rows, run by every layer.

    Attributes:
        num_reqs: R, decode requests (CUDA-graph padding included).
        query_len: s, tokens of each request's FlashMLA tile (the longest
            request's query length).
        num_rows: T, the forward's decode query rows (R * s when uniform).
        causal: a speculative verify block (tails); False: a DSpark block.
        block_table: int32 [R, B] local block table of the requests.
        prefix_lens: int32 [R] local keys every token of the request sees.
        kernel_lens: int32 [R] the lengths FlashMLA is given: ``prefix_lens``,
            or (fp8) at least 1: vLLM's fp8 FlashMLA faults on the H200 when
            no request has a key (a rank's share of a short CUDA-graph
            capture batch); the extra key's partial is never read, as
            ``row_prefix_lens`` stays exact (``tail_merge`` ignores a prefix
            of 0 and zeroes a row with no key).
        rows: the forward's rows (``seq_lens``, ``block_table`` [>= T]).
        row_prefix_lens: int32 [T] ``prefix_lens`` of each row's request.
        sched_meta: bf16: FlashMLA's ``FlashMLASchedMeta`` (filled by the
            first layer's call); fp8: ``(tile_scheduler_metadata [n, 8],
            num_splits [R + 1])`` made by the planner.
        fp8: the cache and queries are fp8 e4m3 (``flash_mla_with_kvcache_fp8``).
        kv_lora_rank: Dv, the value (latent) width; the rest of D is rope.
        planned_forward_id: the ``DCPDecodeMetadata.forward_id`` planned.
        planner: the planner whose persistent buffers the plan reads.
        tile_rows: int64 [R * s] the row each tile token reads its query
            from (a padded token repeats a real row); None when uniform.
        row_tiles: int64 [T] the tile token each row's partial is read
            back from; None when uniform.
        pieces: N, pieces of each request's prefix FlashMLA attends as
            requests of their own (``flashmla_pieces``: a lone bf16 request;
            else 1); ``piece_table`` int32 [R * N, B] / ``piece_lens`` int32
            [R * N] their block table and keys (None with one piece).
        fa3: the planned ``FlashInferSm90DevicePlan`` that runs the rows
            instead of FlashMLA (``FA3RowPlans``), or None.
        token_rows: FlashMLA takes the T rows as T requests of one token
            (``flashmla_token_rows``): ``kernel_lens`` int32 [T] are the
            rows' local bounds (fp8: at least 1), ``sched_meta`` made for
            them; ``num_reqs`` and ``query_len`` still describe the batch.
        block_heads: a uniform DSpark block on one piece is given to
            FlashMLA as R requests of one token x s * H heads (its output
            already vLLM's layout: only the empty rows masked after it);
            False: the s-token tiles and the finishing launch. Planned for
            at most ``flashmla_token_rows.MAX_REQS`` requests (measured).
    """

    num_reqs: int
    query_len: int
    num_rows: int
    causal: bool
    block_table: torch.Tensor
    prefix_lens: torch.Tensor
    kernel_lens: torch.Tensor
    rows: FlatDecode
    row_prefix_lens: torch.Tensor
    sched_meta: Any
    fp8: bool
    kv_lora_rank: int
    planned_forward_id: int
    planner: "FlashMLARowPlanner"
    tile_rows: torch.Tensor | None = None
    row_tiles: torch.Tensor | None = None
    pieces: int = 1
    piece_table: torch.Tensor | None = None
    piece_lens: torch.Tensor | None = None
    fa3: Any = None
    token_rows: bool = False
    block_heads: bool = True

    @property
    def is_current(self) -> bool:
        """Whether no later plan has rewritten the buffers it reads."""
        return self.planner.planned_forward_id == self.planned_forward_id

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor, *, sm_scale: float,
            q_scale: torch.Tensor | None = None,
            k_scale: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's decode of the planned rows (no host sync).

        Args:
            q: [T, H, D] queries (bf16/fp16, or fp8 e4m3 with ``fp8``).
            kv_cache: [P, 64, D] this rank's paged latent cache, same dtype
                family as q.
            sm_scale: the layer's softmax scale.
            q_scale, k_scale: float32 [1] descales of the fp8 q and cache
                (the layer's ``_q_scale`` / ``_k_scale``); None for bf16.

        Returns:
            ``(out [T, H, Dv] bf16/fp16, lse [T, H] float32 natural log)``,
            final: tails merged, rows with no local key out 0, LSE -inf.
        """
        num_rows, num_heads = q.shape[0], q.shape[1]
        if num_rows != self.num_rows:
            raise ValueError(
                f"FLASHMLA under DCP planned {self.num_rows} rows "
                f"({self.num_reqs} requests, tiles of {self.query_len}), the "
                f"layer runs {num_rows}")
        if self.fa3 is not None:
            if sm_scale != self.fa3.sm_scale:
                raise ValueError(f"FLASHMLA under DCP planned FA3 with softmax scale "
                                 f"{self.fa3.sm_scale}, the layer has {sm_scale}")
            return self.fa3.run(q, kv_cache)
        if self.token_rows:
            return self._run_token_rows(q, kv_cache, sm_scale=sm_scale,
                                        q_scale=q_scale, k_scale=k_scale)
        if (self.block_heads and not self.causal and self.tile_rows is None
                and self.pieces == 1 and q.stride(0) == num_heads * q.stride(1)):
            return self._run_block_as_heads(q, kv_cache, sm_scale=sm_scale,
                                            q_scale=q_scale, k_scale=k_scale)
        ops = _flashmla_ops()
        q_tiles = q if self.tile_rows is None else _gather_rows(q, self.tile_rows)
        q_tiles = q_tiles.view(self.num_reqs, self.query_len, num_heads, q.shape[-1])
        cache = kv_cache.unsqueeze(-2)  # FlashMLA's one KV head
        head_dim_v = self.kv_lora_rank
        block_table, prefix_lens = self.block_table, self.prefix_lens
        if self.pieces > 1:  # one q seen by every piece (batch stride 0)
            q_tiles = q_tiles.expand(self.pieces, *q_tiles.shape[1:])
            block_table, prefix_lens = self.piece_table, self.piece_lens
        if self.fp8:
            tile_metadata, num_splits = self.sched_meta
            out, lse = ops.flash_mla_with_kvcache_fp8(
                q=q_tiles, k_cache=cache, block_table=self.block_table,
                cache_seqlens=self.kernel_lens, head_dim_v=head_dim_v,
                tile_scheduler_metadata=tile_metadata, num_splits=num_splits,
                softmax_scale=sm_scale, causal=False,
                descale_q=q_scale.reshape(1), descale_k=k_scale.reshape(1))
        else:
            out, lse = ops.flash_mla_with_kvcache(
                q=q_tiles, k_cache=cache, block_table=block_table,
                cache_seqlens=prefix_lens, head_dim_v=head_dim_v,
                tile_scheduler_metadata=self.sched_meta, softmax_scale=sm_scale,
                causal=False)
        pieces_out = pieces_lens = lse_tiles = None
        if self.row_tiles is not None:  # ragged: each row's partial from its tile
            tiles = self.num_reqs * self.query_len
            out = out.view(tiles, num_heads, head_dim_v).index_select(0, self.row_tiles)
            lse_rows = lse.transpose(1, 2).reshape(tiles, num_heads).index_select(
                0, self.row_tiles)
        else:
            lse_rows = lse.new_empty(num_rows, num_heads)
            lse_tiles = lse  # read by the launch in FlashMLA's [R, H, s]
            if self.pieces > 1:  # merged into a new out by the launch below
                pieces_out, pieces_lens = out, self.piece_lens
                out = out.new_empty(num_rows, num_heads, head_dim_v)
            out = out.view(num_rows, num_heads, head_dim_v)
        # One launch finishes every row: the verify tails merged, the LSE
        # read from FlashMLA's [R, H, s] into vLLM's [T, H], rows with no
        # local key (padding included) out 0 and LSE -inf.
        tail_merge(q, kv_cache, self.rows.block_table[:num_rows],
                   self.rows.seq_lens[:num_rows], self.row_prefix_lens[:num_rows],
                   out, lse_rows, sm_scale=sm_scale, lse_in_base2=False,
                   lse_in=lse_tiles, q_scale=q_scale if self.fp8 else None,
                   k_scale=k_scale if self.fp8 else None, keys_per_step=16,
                   has_tails=self.causal, out_in=pieces_out, piece_lens=pieces_lens)
        return out, lse_rows

    def _run_block_as_heads(self, q, kv_cache, *, sm_scale, q_scale, k_scale):
        """A DSpark block (every token of a request sees its prefix): the s
        tokens x H heads given to FlashMLA as one token of s x H heads (q
        [R, 1, s * H, D], a view; FlashMLA tiles the same s x H rows in the
        same order), so its out [R, 1, s * H, Dv] and LSE [R, s * H, 1] are
        vLLM's [T, H, Dv] / [T, H]; then the empty rows masked (rows whose
        bound is not their prefix, which a DSpark block never has, NaN)."""
        ops = _flashmla_ops()
        num_rows, num_heads = q.shape[0], q.shape[1]
        q_block = q.view(self.num_reqs, 1, self.query_len * num_heads, q.shape[-1])
        cache = kv_cache.unsqueeze(-2)  # FlashMLA's one KV head
        if self.fp8:
            tile_metadata, num_splits = self.sched_meta
            out, lse = ops.flash_mla_with_kvcache_fp8(
                q=q_block, k_cache=cache, block_table=self.block_table,
                cache_seqlens=self.kernel_lens, head_dim_v=self.kv_lora_rank,
                tile_scheduler_metadata=tile_metadata, num_splits=num_splits,
                softmax_scale=sm_scale, causal=False,
                descale_q=q_scale.reshape(1), descale_k=k_scale.reshape(1))
        else:
            out, lse = ops.flash_mla_with_kvcache(
                q=q_block, k_cache=cache, block_table=self.block_table,
                cache_seqlens=self.prefix_lens, head_dim_v=self.kv_lora_rank,
                tile_scheduler_metadata=self.sched_meta, softmax_scale=sm_scale,
                causal=False)
        out = out.reshape(num_rows, num_heads, self.kv_lora_rank)
        lse = lse.reshape(num_rows, num_heads)
        mask_empty_rows(out, lse, self.rows.seq_lens[:num_rows],
                        prefix_lens=self.row_prefix_lens[:num_rows])
        return out, lse

    def _run_token_rows(self, q, kv_cache, *, sm_scale, q_scale, k_scale):
        """FlashMLA over T requests of one token each (every row its own
        local bound and block table), then the empty rows masked."""
        ops = _flashmla_ops()
        num_rows, num_heads = q.shape[0], q.shape[1]
        q_rows = q.unsqueeze(1)  # [T, 1, H, D]
        cache = kv_cache.unsqueeze(-2)  # FlashMLA's one KV head
        table = self.rows.block_table[:num_rows]
        if self.fp8:
            tile_metadata, num_splits = self.sched_meta
            out, lse = ops.flash_mla_with_kvcache_fp8(
                q=q_rows, k_cache=cache, block_table=table,
                cache_seqlens=self.kernel_lens, head_dim_v=self.kv_lora_rank,
                tile_scheduler_metadata=tile_metadata, num_splits=num_splits,
                softmax_scale=sm_scale, causal=False,
                descale_q=q_scale.reshape(1), descale_k=k_scale.reshape(1))
        else:
            out, lse = ops.flash_mla_with_kvcache(
                q=q_rows, k_cache=cache, block_table=table,
                cache_seqlens=self.kernel_lens, head_dim_v=self.kv_lora_rank,
                tile_scheduler_metadata=self.sched_meta, softmax_scale=sm_scale,
                causal=False)
        out = out.reshape(num_rows, num_heads, self.kv_lora_rank)
        lse = lse.reshape(num_rows, num_heads)
        mask_empty_rows(out, lse, self.rows.seq_lens[:num_rows])
        return out, lse


class FlashMLARowPlanner:
    """Plans a KV-cache group's FlashMLA rows once per forward, on the device.

    Owned by the metadata builder; its buffers are sized once, before any
    CUDA graph is captured, and every plan writes into them.

    Args:
        max_reqs: most decode requests of one forward (padding included).
        max_rows: most decode query rows of one forward.
        num_heads: H, query heads a rank attends (after DCP's query gather).
        kv_lora_rank: Dv, the latent (value) width (512 for FlashMLA).
        fp8: the group's cache is fp8 (the planner makes the fp8 kernel's
            scheduler metadata).
        num_sms: the GPU's SM count (bounds FlashMLA's SM partitions).
        device: the group's device.
        fa3: where a lone bf16 request runs FA3 (``fa3_rows_preferred``);
            None: FlashMLA for every batch.
        token_rows: whether FlashMLA takes a multi-token block's rows as
            one-token requests (``flashmla_token_rows``); None: where
            ``token_rows_preferred`` says so.
        block_heads: a uniform DSpark block's tokens given to FlashMLA as
            heads (``FlashMLARowPlan.block_heads``); False: as tokens, with
            the finishing launch (the rows before).
    """

    def __init__(self, *, max_reqs: int, max_rows: int, num_heads: int,
                 kv_lora_rank: int, fp8: bool, num_sms: int,
                 device: torch.device, fa3: FA3RowPlans | None = None,
                 token_rows: bool | None = None, block_heads: bool = True) -> None:
        i32 = dict(dtype=torch.int32, device=device)
        self.num_heads = num_heads
        self.kv_lora_rank = kv_lora_rank
        self.planned_forward_id = 0  # of the last plan
        self.fp8 = fp8
        self._prefix_lens = torch.zeros(max_reqs, **i32)
        self._kernel_lens = torch.zeros(max(max_reqs, max_rows), **i32)
        self._row_prefix_lens = torch.zeros(max_rows, **i32)
        self._tile_metadata = torch.zeros(num_sms, TILE_METADATA_WIDTH, **i32)
        self._num_splits = torch.zeros(max(max_reqs, max_rows) + 1, **i32)
        self._num_sms = num_sms
        self._pieces = PiecePlanner(device)
        self._fa3 = fa3
        self._token_rows = token_rows
        self._block_heads = block_heads

    def plan(self, rows: FlatDecode, block_table: torch.Tensor, *,
             query_start_loc: torch.Tensor, query_start_loc_cpu: torch.Tensor,
             num_rows: int, causal: bool, forward_id: int,
             sm_scale: Callable[[], float] | None = None) -> FlashMLARowPlan:
        """This forward's plan.

        Args:
            rows: the forward's rows (``seq_lens`` [>= T] on the device: each
                query token's local bound, 0 on padding rows; ``row_to_req``).
            block_table: int32 [R, B] local block table of the requests.
            query_start_loc: int32 [R + 1] the requests' query offsets on the
                device (what the rows were built from).
            query_start_loc_cpu: the same offsets on the host (exact: the
                rows refuse host/device query-length mismatches); they choose
                the tile length s and whether the batch is uniform.
            num_rows: T, the decode query rows (CUDA-graph padding included).
            causal: verify (tails) or a DSpark block.
            forward_id: the metadata's ``forward_id``.
            sm_scale: the group's softmax scale, read where FA3 is planned.
        """
        offsets = query_start_loc_cpu.tolist()
        num_reqs = len(offsets) - 1
        query_lens = [end - start for start, end in zip(offsets, offsets[1:])]
        query_len = max(query_lens, default=0)
        if num_reqs < 1 or query_len < 1 or num_rows > num_reqs * query_len:
            raise ValueError(
                f"FLASHMLA under DCP: {num_rows} query rows do not fit "
                f"{num_reqs} requests of at most {query_len} tokens")
        if num_reqs > self._prefix_lens.shape[0] or num_rows > self._row_prefix_lens.shape[0]:
            raise ValueError(
                f"FLASHMLA under DCP: {num_reqs} requests / {num_rows} rows exceed "
                f"the buffers sized at start-up ({self._prefix_lens.shape[0]} / "
                f"{self._row_prefix_lens.shape[0]}): raise --max-num-seqs")
        self.planned_forward_id = forward_id
        if self._takes_token_rows(num_reqs=num_reqs, query_len=query_len):
            return self._plan_token_rows(rows, block_table, num_reqs=num_reqs,
                                         query_len=query_len, num_rows=num_rows,
                                         causal=causal, forward_id=forward_id)
        prefix = self._prefix_lens[:num_reqs]
        row_prefix = self._row_prefix_lens[:num_rows]
        tile_rows = row_tiles = None
        if num_rows == num_reqs * query_len and _tiles_are_rows(query_lens, query_len):
            # The first token's bound is the least of the request's tokens'.
            prefix.copy_(rows.seq_lens[:num_rows].view(num_reqs, query_len)[:, 0])
            row_prefix.view(num_reqs, query_len).copy_(
                prefix[:, None].expand(-1, query_len))
        else:
            tile_rows, row_tiles = _ragged_tiles(rows, query_start_loc, prefix,
                                                 row_prefix, query_len=query_len,
                                                 num_reqs=num_reqs, num_rows=num_rows)
        if (self._fa3 is not None and tile_rows is None and fa3_rows_preferred(
                num_reqs=num_reqs, query_len=query_len, fp8=self.fp8)):
            if sm_scale is None:
                raise ValueError("FLASHMLA under DCP: FA3 rows need the softmax scale")
            fa3 = self._fa3.plan(rows, block_table, num_reqs=num_reqs,
                                 query_len=query_len, causal=causal,
                                 sm_scale=sm_scale())
            return FlashMLARowPlan(
                num_reqs=num_reqs, query_len=query_len, num_rows=num_rows,
                causal=causal, block_table=block_table, prefix_lens=prefix,
                kernel_lens=prefix, rows=rows, row_prefix_lens=row_prefix,
                sched_meta=None, fp8=False, kv_lora_rank=self.kv_lora_rank,
                planned_forward_id=forward_id, planner=self, fa3=fa3)
        kernel_lens, sched_meta = self._kernel_plan(prefix, query_len * self.num_heads)
        pieces = 1 if tile_rows is not None else pieces_for(
            num_reqs=num_reqs, fp8=self.fp8, rows_per_request=query_len * self.num_heads,
            num_sms=self._num_sms)
        piece_table = piece_lens = None
        if pieces > 1:
            piece_table, piece_lens = self._pieces.plan(prefix, block_table, pieces)
        return FlashMLARowPlan(
            num_reqs=num_reqs, query_len=query_len, num_rows=num_rows, causal=causal,
            block_table=block_table, prefix_lens=prefix, kernel_lens=kernel_lens,
            rows=rows,
            row_prefix_lens=row_prefix, sched_meta=sched_meta, fp8=self.fp8,
            kv_lora_rank=self.kv_lora_rank, planned_forward_id=forward_id,
            planner=self, tile_rows=tile_rows, row_tiles=row_tiles, pieces=pieces,
            piece_table=piece_table, piece_lens=piece_lens,
            block_heads=self._block_heads and num_reqs <= SMALL_BATCH)

    def _takes_token_rows(self, *, num_reqs: int, query_len: int) -> bool:
        """By batch shape only (one CUDA-graph size runs one kernel); a lone
        bf16 request that FA3 takes keeps FA3."""
        if self._fa3 is not None and fa3_rows_preferred(
                num_reqs=num_reqs, query_len=query_len, fp8=self.fp8):
            return False
        if self._token_rows is not None:
            return self._token_rows and query_len >= 2
        return token_rows_preferred(num_heads=self.num_heads, query_len=query_len,
                                    fp8=self.fp8, num_reqs=num_reqs)

    def _kernel_plan(self, lens: torch.Tensor, rows_per_request: int):
        """FlashMLA's lengths and scheduler metadata for requests of
        ``lens`` keys: bf16 the lengths and an empty ``FlashMLASchedMeta``
        (the first layer fills it); fp8 the lengths raised to 1 (the
        kernel faults with no key anywhere) in a persistent buffer and the
        metadata made here, copied into persistent buffers."""
        ops = _flashmla_ops()
        if not self.fp8:
            return lens, ops.get_mla_metadata()[0]
        count = lens.shape[0]
        kernel_lens = self._kernel_lens[:count]
        torch.clamp(lens, min=1, out=kernel_lens)
        tile_metadata, num_splits = ops.get_mla_metadata_dense_fp8(
            kernel_lens, rows_per_request, 1)
        parts = tile_metadata.shape[0]
        if parts > self._tile_metadata.shape[0]:
            raise RuntimeError(f"FlashMLA made {parts} SM partitions, more "
                               f"than the GPU's {self._tile_metadata.shape[0]} SMs")
        self._tile_metadata[:parts].copy_(tile_metadata)
        self._num_splits[:count + 1].copy_(num_splits)
        return kernel_lens, (self._tile_metadata[:parts], self._num_splits[:count + 1])

    def _plan_token_rows(self, rows: FlatDecode, block_table: torch.Tensor, *,
                         num_reqs: int, query_len: int, num_rows: int, causal: bool,
                         forward_id: int) -> FlashMLARowPlan:
        """Every row a FlashMLA request of one token over its own bound."""
        row_lens = rows.seq_lens[:num_rows]
        kernel_lens, sched_meta = self._kernel_plan(row_lens, self.num_heads)
        return FlashMLARowPlan(
            num_reqs=num_reqs, query_len=query_len, num_rows=num_rows, causal=causal,
            block_table=block_table, prefix_lens=row_lens, kernel_lens=kernel_lens,
            rows=rows, row_prefix_lens=row_lens, sched_meta=sched_meta, fp8=self.fp8,
            kv_lora_rank=self.kv_lora_rank, planned_forward_id=forward_id,
            planner=self, token_rows=True)


def _tiles_are_rows(query_lens: list[int], query_len: int) -> bool:
    """Whether row ``r * s + t`` is token ``t`` of request ``r``: every
    request has ``s`` tokens, but for zero-length padding requests after
    the last real one (a padded CUDA-graph batch, whose padding rows are
    empty)."""
    num_real = sum(1 for n in query_lens if n)
    return all(n == query_len for n in query_lens[:num_real]) and not any(
        query_lens[num_real:])


def _ragged_tiles(rows: FlatDecode, query_start_loc: torch.Tensor,
                  prefix: torch.Tensor, row_prefix: torch.Tensor, *,
                  query_len: int, num_reqs: int, num_rows: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Tiles of ``query_len`` tokens for a ragged batch, from device offsets.

    Writes ``prefix`` [R] (the request's first row's bound; 0 for a request
    with no query token) and ``row_prefix`` [T] (0 on padding rows, whose
    bound is 0). Returns ``(tile_rows [R * s], row_tiles [T])``, int64: the
    row a tile token reads its query from (a padded token repeats a row) and
    the tile token a row is read back from (any, for a padding row: the tail
    launch zeroes it).
    """
    device = query_start_loc.device
    starts = query_start_loc[:num_reqs].long()
    query_lens = query_start_loc[1:num_reqs + 1].long() - starts
    first_rows = starts.clamp(max=num_rows - 1)
    torch.where(query_lens > 0, rows.seq_lens[first_rows],
                torch.zeros_like(prefix), out=prefix)
    tokens = torch.arange(query_len, device=device)
    tile_rows = (starts[:, None] + tokens).clamp_(max=num_rows - 1).view(-1)
    row_req = rows.row_to_req[:num_rows].long()
    row_tiles = (row_req * query_len + torch.arange(num_rows, device=device)
                 - starts[row_req]).clamp_(max=num_reqs * query_len - 1)
    # A real row's bound is at least its request's prefix; a padding row's is 0.
    torch.minimum(prefix.index_select(0, row_req), rows.seq_lens[:num_rows],
                  out=row_prefix)
    return tile_rows, row_tiles


def _gather_rows(q: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``q[index]`` along rows; fp8 moved as bytes (index kernels need not
    take float8 dtypes)."""
    if q.element_size() == 1:
        return q.view(torch.uint8).index_select(0, index).view(q.dtype)
    return q.index_select(0, index)
