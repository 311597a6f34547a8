# SPDX-License-Identifier: Apache-2.0
"""Decode context parallelism (DCP) math for multi-token MLA decode.

Pure torch: this module must not import vllm, so that it runs on machines where
vLLM cannot be installed (the GPU benchmark host) as well as inside vLLM.

Layout (vLLM's, bit-exact, ``DCPLayout``): with W = DCP world size and
I = interleave size, global token position ``p`` lives on rank
``(p // I) % W`` at local index ``(p // (W * I)) * I + p % I``.

Shapes use these names:
  R  requests, N  flattened rows (one per query token), B  max blocks per
  request, H  heads, D  latent width (kv_lora_rank + rope dim), Dv  kv_lora_rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = [
    "DCPLayout",
    "FlatDecode",
    "alloc_flat_decode",
    "build_flat_decode",
    "merge_partials",
    "mla_decode_reference",
]


@dataclass(frozen=True)
class DCPLayout:
    """How the KV cache is split over the DCP ranks, seen from one rank.

    Global token position ``p`` lives on rank ``(p // I) % W`` at local index
    ``(p // (W * I)) * I + p % I``.

    Attributes:
        world_size: W, the DCP world size (``-dcp``).
        rank: r, the rank this layout is seen from (0 <= r < W).
        interleave: I, consecutive tokens stored on one rank
            (``--cp-kv-cache-interleave-size``).
    """

    world_size: int = 1
    rank: int = 0
    interleave: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.interleave < 1:
            raise ValueError(
                f"DCP world size ({self.world_size}) and interleave "
                f"({self.interleave}) must be at least 1")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"DCP rank {self.rank} is outside world size {self.world_size}")

    @property
    def span(self) -> int:
        """W * I: global tokens per round over every rank."""
        return self.world_size * self.interleave

    def with_rank(self, rank: int) -> "DCPLayout":
        """The same split seen from ``rank``."""
        return DCPLayout(self.world_size, rank, self.interleave)

    def ranks(self) -> list["DCPLayout"]:
        """The split seen from each rank 0..W-1."""
        return [self.with_rank(rank) for rank in range(self.world_size)]

    def local_seq_lens(
        self, global_lens: torch.Tensor, rank: torch.Tensor | None = None
    ) -> torch.Tensor:
        """KV tokens of each sequence held on this rank (or on ``rank``).

        ``local(L, r) = (L // (W*I)) * I + clamp(L % (W*I) - r*I, 0, I)``.

        Args:
            global_lens: int tensor [...], global sequence lengths (tokens).
            rank: int tensor broadcastable against ``global_lens`` to ask for
                several ranks at once (e.g. ``arange(W)[:, None]``); default
                this layout's rank.

        Returns:
            Tensor of ``global_lens``' dtype (broadcast shape): local lengths.
        """
        rank = self.rank if rank is None else rank
        remainder = global_lens % self.span - rank * self.interleave
        local = ((global_lens // self.span) * self.interleave
                 + remainder.clamp(0, self.interleave))
        return local.to(global_lens.dtype)

    def owner(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Owner rank and local index of global token positions.

        Returns:
            ``(owner_rank, local_index)``, both of ``positions``' shape and dtype.
        """
        owner = (positions // self.interleave) % self.world_size
        local_index = ((positions // self.span) * self.interleave
                       + positions % self.interleave)
        return owner, local_index


@dataclass
class FlatDecode:
    """Per-rank decode metadata, one row per query token.

    Attributes:
        seq_lens: int32 [N], local KV tokens row ``n`` may attend to on this rank.
        block_table: int32 [N, B], the row's request's (local) block table.
        row_to_req: int32 [N], request index of each row.
        empty: bool [N], True where this rank holds no KV for the row (its
            partial output is undefined and must not enter the combine).
    """

    seq_lens: torch.Tensor
    block_table: torch.Tensor
    row_to_req: torch.Tensor
    empty: torch.Tensor

    @property
    def num_rows(self) -> int:
        return self.seq_lens.shape[0]

    def slice(self, num_rows: int, num_blocks: int | None = None) -> "FlatDecode":
        """Views of the first ``num_rows`` rows and, if given, the first
        ``num_blocks`` block-table columns."""
        return FlatDecode(
            seq_lens=self.seq_lens[:num_rows],
            block_table=self.block_table[:num_rows, :num_blocks],
            row_to_req=self.row_to_req[:num_rows],
            empty=self.empty[:num_rows],
        )


def alloc_flat_decode(
    max_rows: int, max_blocks: int, device: torch.device | str = "cpu"
) -> FlatDecode:
    """Persistent buffers for ``build_flat_decode(..., out=...)``.

    Size them for the largest CUDA graph (max decode tokens) so that a captured
    graph replays the build into the same memory.
    """
    i32 = dict(dtype=torch.int32, device=device)
    return FlatDecode(
        seq_lens=torch.zeros(max_rows, **i32),
        block_table=torch.zeros(max_rows, max_blocks, **i32),
        row_to_req=torch.zeros(max_rows, **i32),
        empty=torch.ones(max_rows, dtype=torch.bool, device=device),
    )


def build_flat_decode(
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    block_table: torch.Tensor,
    *,
    layout: DCPLayout,
    causal: bool,
    num_rows: int | None = None,
    out: FlatDecode | None = None,
) -> FlatDecode:
    """Flatten a multi-token decode batch into one row per query token.

    Request ``i`` with global length ``L`` (its ``n`` new tokens included) and
    query token ``t`` in ``0..n-1`` may see ``g_t = L - n + 1 + t`` global
    tokens when ``causal`` (speculative verify) and ``g_t = L`` otherwise
    (a DSpark draft block sees the whole block), clamped at 0 (``L < n``
    leaves the first tokens nothing to see: empty rows). On this rank that
    is ``layout.local_seq_lens(g_t)`` local tokens.

    Vectorised and free of host syncs when ``num_rows`` is given, so it can be
    captured in a CUDA graph together with ``out``.

    Args:
        seq_lens: int32 [R], global sequence lengths (tokens, query included).
        query_start_loc: int32 [R + 1], cumulative query lengths. Requests of
            query length 0 (padding) produce no rows.
        block_table: int32 [R, B], each request's block table (local blocks).
        layout: the DCP split, seen from the rank the rows are built for.
        causal: causal verify (True) or non-causal draft block (False).
        num_rows: N, rows to produce. Rows at or beyond ``query_start_loc[-1]``
            are padding: ``empty`` with seq len 0. Defaults to
            ``query_start_loc[-1]`` (one host sync).
        out: buffers from ``alloc_flat_decode`` with at least ``N`` rows and
            ``B`` columns; the result is a view of them.

    Returns:
        FlatDecode with N rows.
    """
    if num_rows is None:
        num_rows = int(query_start_loc[-1])
    device = seq_lens.device
    num_reqs = seq_lens.shape[0]

    rows = torch.arange(num_rows, dtype=torch.int32, device=device)
    # Zero-length requests are skipped: right-searchsorted over the end offsets
    # lands on the first request whose end lies past the row.
    req = torch.searchsorted(query_start_loc[1:], rows, right=True, out_int32=True)
    is_real = req < num_reqs
    req = req.clamp_(max=max(num_reqs - 1, 0))

    req_start = query_start_loc[req]
    query_len = query_start_loc[req + 1] - req_start
    req_len = seq_lens[req]
    if causal:
        bound = req_len - query_len + 1 + (rows - req_start)
    else:
        bound = req_len
    # A request shorter than its query (seq len < q_len) gives its first
    # tokens a bound below 1: they see nothing, on every rank.
    bound = torch.where(is_real, bound, 0).clamp_(min=0).to(torch.int32)
    local = layout.local_seq_lens(bound)

    if out is None:
        out = alloc_flat_decode(num_rows, block_table.shape[1], device)
    flat = out.slice(num_rows, block_table.shape[1])
    flat.row_to_req.copy_(req)
    flat.seq_lens.copy_(local)
    torch.eq(local, 0, out=flat.empty)
    if num_reqs > 0:
        flat.block_table.copy_(block_table.index_select(0, req))
    else:
        flat.block_table.zero_()
    return flat


def merge_partials(
    outs: torch.Tensor, lses: torch.Tensor, *, lse_base_e: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """LSE-weighted merge of the W ranks' partial attention outputs.

    Args:
        outs: [W, N, H, Dv] partial outputs, any float dtype.
        lses: [W, N, H] partial log-sum-exps, natural log if ``lse_base_e``
            else base 2. -inf, +inf and NaN mark a partial that contributes
            nothing (an empty shard).
        lse_base_e: the base of ``lses``; the returned LSE has the same base.

    Returns:
        ``(out [N, H, Dv] of outs' dtype, lse [N, H] float32)``. Rows whose
        partials are all empty get ``out = 0`` and ``lse = -inf``.
    """
    lse = lses.float()
    if not lse_base_e:
        lse = lse * math.log(2.0)
    lse = torch.where(torch.isfinite(lse), lse, float("-inf"))
    lse_max = lse.amax(dim=0)
    lse_max = torch.where(torch.isfinite(lse_max), lse_max, 0.0)
    weight = torch.exp(lse - lse_max)  # [W, N, H], 0 for empty partials
    total = weight.sum(dim=0)
    merged_lse = lse_max + torch.log(total)  # -inf where every partial is empty
    scale = weight / torch.where(total > 0, total, 1.0)
    partial = torch.where(scale[..., None] > 0, outs.float(), 0.0)
    merged = (scale[..., None] * partial).sum(dim=0).to(outs.dtype)
    if not lse_base_e:
        merged_lse = merged_lse / math.log(2.0)
    return merged, merged_lse


def mla_decode_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    kv_lora_rank: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed-MLA decode in plain torch, one query token per row.

    Row ``n`` attends to the first ``seq_lens[n]`` tokens of its paged latent
    cache; the value is the first ``kv_lora_rank`` columns of the latent.

    Args:
        q: [N, H, D] queries (latent ``q_nope @ W_UK`` then rope part).
        kv_cache: [num_blocks, block_size, D] latent cache.
        block_table: int [N, B] block ids of each row.
        seq_lens: int [N] tokens each row may see (0 allowed).
        kv_lora_rank: Dv, the value width.
        scale: softmax scale applied to ``q . k``.

    Returns:
        ``(out [N, H, Dv] in q's dtype, lse [N, H] float32 natural log)``;
        rows with ``seq_lens == 0`` give out 0 and lse -inf.
    """
    num_rows, num_heads, _ = q.shape
    block_size = kv_cache.shape[1]
    max_len = int(seq_lens.max()) if num_rows else 0
    out = q.new_zeros(num_rows, num_heads, kv_lora_rank)
    lse = torch.full((num_rows, num_heads), float("-inf"), device=q.device)
    if max_len == 0:
        return out, lse
    pos = torch.arange(max_len, device=q.device)
    blocks = block_table[:, pos // block_size].long()  # [N, T]
    kv = kv_cache[blocks, pos % block_size].float()  # [N, T, D]
    visible = pos[None, :] < seq_lens[:, None]  # [N, T]
    kv = torch.where(visible[..., None], kv, 0.0)
    scores = torch.einsum("nhd,ntd->nht", q.float(), kv) * scale
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    row_lse = torch.logsumexp(scores, dim=-1)  # [N, H]
    has_kv = seq_lens > 0
    probs = torch.exp(scores - torch.where(has_kv[:, None], row_lse, 0.0)[..., None])
    row_out = torch.einsum("nht,ntv->nhv", probs, kv[..., :kv_lora_rank])
    out[has_kv] = row_out[has_kv].to(q.dtype)
    lse[has_kv] = row_lse[has_kv]
    return out, lse

