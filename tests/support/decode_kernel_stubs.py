# SPDX-License-Identifier: Apache-2.0
"""CPU stand-ins of the sm90 decode kernels a recipe's decode steps call, at
their contracts, in plain float64 torch (nothing of the code under test):

* ``tail_merge``: the project's Triton prefix+tail finishing launch
  (``vllm.v1.attention.ops.mla_tail_merge.tail_merge``), at its docstring's
  contract; the kernel itself is run against a reference under Triton's
  interpreter by ``tests/test_flashinfer_sm90_mla.py``'s triton_path tests;
* ``FlashAttnMLAReference``: vLLM's FlashAttention 3 varlen call as vLLM's
  ``FLASH_ATTN_MLA`` decode makes it (``q`` the rope part, ``q_v`` the
  latent part, paged ``k`` / ``v`` of one KV head), with vllm-flash-attn's
  DCP arguments;
* ``decode_attention_fwd``: vLLM's Triton MLA decode (``TRITON_MLA``, the
  Hopper draft's backend at ``-dcp 1``), one query row per program.

The other decode kernels' stand-ins are ``kernel_stubs``'s.
"""

from __future__ import annotations

import math

import torch

FP8 = torch.float8_e4m3fn
F64 = torch.float64


def _as_values(x: torch.Tensor) -> torch.Tensor:
    return (x.view(FP8) if x.dtype == torch.uint8 else x).double()


def _merge(parts):
    """LSE-weighted merge of (out [H, D], natural-log lse [H]) partials."""
    lses = torch.stack([lse for _, lse in parts])  # [n, H]
    top = lses.max(dim=0).values
    weights = torch.exp(lses - top)
    out = sum(w[:, None] * o for w, (o, _) in zip(weights, parts)) / weights.sum(0)[:, None]
    return out, top + torch.log(weights.sum(0))


def mask_empty_rows(out, lse, seq_lens, prefix_lens=None):
    """``flashmla_token_rows.mask_empty_rows`` in torch: rows with no local
    key out 0 / LSE -inf, rows whose bound is not ``prefix_lens`` NaN, the
    rest untouched."""
    num_rows = out.shape[0]
    lens = seq_lens[:num_rows].long()
    bad = (lens != prefix_lens[:num_rows].long() if prefix_lens is not None
           else torch.zeros_like(lens, dtype=torch.bool))
    empty = (lens == 0) & ~bad
    out[empty] = 0
    lse[empty] = float("-inf")
    out[bad] = float("nan")
    lse[bad] = float("nan")


def tail_merge(q, kv_cache, block_table, row_lens, prefix_lens, out, lse, *,
               sm_scale, lse_in_base2=True, lse_in=None, q_scale=None, k_scale=None,
               has_tails=True, out_in=None, piece_lens=None, **tuning):
    """Row ``t`` attends local keys ``[0, row_lens[t])``: its prefix partial
    over ``[0, prefix_lens[t])`` (``out`` / ``lse``, or ``lse_in`` [R, H, s],
    or pieces ``out_in`` [R * N, s, H, Dv] / ``lse_in`` [R * N, H, s] with
    ``piece_lens``; base 2 with ``lse_in_base2``) merged with the keys
    ``[prefix_lens[t], row_lens[t])`` read through ``block_table[t]``.
    Writes the final ``out`` and natural-log ``lse`` of every row: 0 / -inf
    with no key, NaN where ``row_lens < prefix_lens`` or, without
    ``has_tails``, where a row has a tail."""
    num_rows = q.shape[0]
    if num_rows == 0:
        return
    assert (q_scale is None) == (k_scale is None)
    q_values = _as_values(q) * (float(q_scale) if q_scale is not None else 1.0)
    cache = _as_values(kv_cache) * (float(k_scale) if k_scale is not None else 1.0)
    page, dv = cache.shape[1], out.shape[-1]
    base = math.log(2.0) if lse_in_base2 else 1.0
    tile = (out_in.shape[1] if out_in is not None
            else lse_in.shape[2] if lse_in is not None else 1)
    pieces = 1 if out_in is None else out_in.shape[0] * tile // num_rows
    results = []
    for t in range(num_rows):
        total, prefix = int(row_lens[t]), int(prefix_lens[t])
        if total < prefix or (not has_tails and total > prefix):
            results.append((torch.full((q.shape[1], dv), float("nan"), dtype=F64),
                            torch.full((q.shape[1],), float("nan"), dtype=F64)))
            continue
        if total == 0:
            results.append((torch.zeros(q.shape[1], dv, dtype=F64),
                            torch.full((q.shape[1],), float("-inf"), dtype=F64)))
            continue
        parts = []
        if prefix > 0:
            request, token = divmod(t, tile)
            if out_in is not None:
                for p in range(request * pieces, (request + 1) * pieces):
                    if int(piece_lens[p]) > 0:
                        parts.append((out_in[p, token].double(),
                                      lse_in[p, :, token].double() * base))
            elif lse_in is not None:
                parts.append((out[t].double(), lse_in[request, :, token].double() * base))
            else:
                parts.append((out[t].double(), lse[t].double() * base))
        if total > prefix:
            position = torch.arange(prefix, total)
            keys = cache[block_table[t, position // page].long(), position % page]
            scores = q_values[t] @ keys.T * sm_scale  # [H, keys]
            parts.append((torch.softmax(scores, -1) @ keys[:, :dv],
                          torch.logsumexp(scores, -1)))
        if not parts:  # a prefix no piece covers: a planner's error shows as NaN
            parts.append((torch.full((q.shape[1], dv), float("nan"), dtype=F64),
                          torch.full((q.shape[1],), float("nan"), dtype=F64)))
        results.append(_merge(parts))
    out.copy_(torch.stack([o for o, _ in results]).to(out.dtype))
    lse.copy_(torch.stack([l for _, l in results]).float())


class FlashAttnMLAReference:
    """vLLM's ``flash_attn_varlen_func`` (FlashAttention 3) as ``FLASH_ATTN_MLA``
    decodes with it, and its ``get_scheduler_metadata``.

    Scores ``(q . k + q_v . v) * softmax_scale`` over the paged keys of
    request ``b`` (``block_table``; ``k`` [P, page, 1, Dr], ``v`` [P, page, 1,
    Dv]); output ``softmax @ v`` [T, H, Dv], natural-log LSE [H, T]. DCP
    (vllm-flash-attn's ``cp_world_size`` / ``cp_rank`` /
    ``cp_tot_seqused_k``, token-striped: local key ``j`` of rank ``r`` is
    global position ``j * W + r``): token ``i`` of the ``n`` of request ``b``
    is at global position ``cp_tot_seqused_k[b] - n + i`` and, causal, sees
    the local keys (``j < seqused_k[b]``) at or before it. Without DCP it is
    aligned to the end of ``seqused_k[b]``.
    """

    def __init__(self):
        self.calls: list[dict] = []

    def get_scheduler_metadata(self, **kwargs):
        return torch.zeros(1, dtype=torch.int32)

    def flash_attn_varlen_func(self, q, k, v, max_seqlen_q, cu_seqlens_q,
                               max_seqlen_k, *, seqused_k, block_table, softmax_scale,
                               causal, q_v=None, return_softmax_lse=False,
                               fa_version=3, scheduler_metadata=None, num_splits=0,
                               cp_world_size=1, cp_rank=0, cp_tot_seqused_k=None,
                               **kwargs):
        assert fa_version == 3 and q_v is not None
        assert k.ndim == 4 and k.shape[2] == 1 and v.shape[2] == 1
        self.calls.append(dict(causal=causal, cp_world_size=cp_world_size,
                               rows=q.shape[0]))
        page = k.shape[1]
        heads = q.shape[1]
        out = torch.zeros(q.shape[0], heads, v.shape[-1], dtype=torch.float64)
        lse = torch.full((heads, q.shape[0]), float("-inf"), dtype=torch.float64)
        for b in range(cu_seqlens_q.shape[0] - 1):
            start, end = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
            local = int(seqused_k[b])
            j = torch.arange(local)
            keys_k = k[block_table[b, j // page].long(), j % page, 0].double()
            keys_v = v[block_table[b, j // page].long(), j % page, 0].double()
            if cp_world_size > 1:
                key_position, last = j * cp_world_size + cp_rank, int(cp_tot_seqused_k[b])
            else:
                key_position, last = j, local
            for i, t in enumerate(range(start, end)):
                seen = (key_position <= last - (end - start) + i if causal
                        else torch.ones_like(j, dtype=torch.bool))
                if not bool(seen.any()):
                    continue
                scores = (q[t].double() @ keys_k[seen].T
                          + q_v[t].double() @ keys_v[seen].T) * softmax_scale
                lse[:, t] = torch.logsumexp(scores, -1)
                out[t] = torch.softmax(scores, -1) @ keys_v[seen]
        out = out.to(q.dtype)
        return (out, lse.float()) if return_softmax_lse else out


def decode_attention_fwd(q, k_buffer, v_buffer, o, lse, req_to_token, b_seq_len,
                         attn_logits, num_kv_splits, sm_scale, page_size,
                         logit_cap=0.0, k_scale=None, v_scale=None, is_mla=False,
                         sliding_window=None):
    """vLLM's Triton ``decode_attention_fwd`` (``TRITON_MLA``'s decode), one
    query row per program: row ``b`` of ``q`` [B, H, D] attends the first
    ``b_seq_len[b]`` keys of ``k_buffer`` [P, page, 1, D] through its
    ``req_to_token`` row (block ids); values are ``v_buffer``'s first Dv
    columns; fp8 buffers times ``k_scale`` / ``v_scale``; vLLM 0.34's
    ``sliding_window``: only a row's last that many keys. Writes ``o``
    [B, H, Dv] and the natural-log ``lse`` [B, H]; NaN for a row without
    keys (the kernel's split reduction divides by an empty sum there)."""
    assert is_mla and logit_cap == 0.0
    assert attn_logits.shape[2] == num_kv_splits  # the kernel's own check
    keys = _as_values(k_buffer)[:, :, 0] * (float(k_scale) if k_scale is not None else 1.0)
    values = _as_values(v_buffer)[:, :, 0] * (float(v_scale) if v_scale is not None else 1.0)
    for b in range(q.shape[0]):
        length = int(b_seq_len[b])
        position = torch.arange(max(0, length - (sliding_window or length)), length)
        if position.numel() == 0:
            o[b], lse[b] = float("nan"), float("nan")
            continue
        blocks = req_to_token[b, position // page_size].long()
        scores = q[b].double() @ keys[blocks, position % page_size].T * sm_scale
        o[b] = (torch.softmax(scores, -1) @ values[blocks, position % page_size]).to(o.dtype)
        lse[b] = torch.logsumexp(scores, -1).to(lse.dtype)
