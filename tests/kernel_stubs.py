# SPDX-License-Identifier: Apache-2.0
"""Reference stand-ins for the sm100-only MLA decode kernels, on CPU.

Each adapter binds its call to the *installed* kernel's signature
(``inspect.signature(real).bind``), so a keyword the real kernel does not take,
or a missing required one, fails the test; it then checks the layouts and
dtypes the real kernel documents and computes the result with the ops layer's
``mla_decode_reference`` in the kernel's units (LSE base, output shape).
Rows the kernel leaves undefined (no local KV) come back as NaN, so only a
caller that masks them passes.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import math
import types
from unittest import mock

import torch

from vllm.v1.attention.ops.dcp_decode import dcp_local_seq_lens, mla_decode_reference

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float8_e4m3fn)


@contextlib.contextmanager
def cuda_properties_for_import(major: int = 10):
    """flashinfer queries the GPU at import time; answer as an sm100 would."""
    props = types.SimpleNamespace(multi_processor_count=148, major=major, minor=0,
                                  name="stub", total_memory=1 << 36)
    with mock.patch("torch.cuda.get_device_properties", return_value=props), \
            mock.patch("torch.cuda.get_device_capability", return_value=(major, 0)):
        yield


def import_on_cpu(module: str):
    with cuda_properties_for_import():
        return importlib.import_module(module)


def _bounds(query_len: int, req_lens: torch.Tensor, *, causal: bool) -> torch.Tensor:
    """[B, q_len] bounds: causal bottom-right aligned, else the whole length."""
    t = torch.arange(query_len)
    if causal:
        return req_lens[:, None] - query_len + 1 + t[None, :]
    return req_lens[:, None].expand(-1, query_len)


def _reference(query, kv_cache, block_tables, visible, scale, kv_lora_rank):
    """Per-token attention; returns out [B, q, H, Dv] (NaN where visible == 0)
    and natural-log lse [B, q, H]."""
    batch, query_len, heads, width = query.shape
    rows = query.reshape(batch * query_len, heads, width)
    table = block_tables.repeat_interleave(query_len, dim=0)
    lens = visible.reshape(-1).to(torch.int32)
    out, lse = mla_decode_reference(rows.float(), kv_cache.float(), table, lens,
                                    kv_lora_rank=kv_lora_rank, scale=scale)
    empty = lens == 0
    out[empty] = float("nan")
    lse[empty] = float("nan")
    return (out.view(batch, query_len, heads, kv_lora_rank),
            lse.view(batch, query_len, heads))


def _check_common(query, block_tables, seq_lens, kv_lora_rank, rope_dim):
    assert query.ndim == 4, "query must be [B, q_len, H, D]"
    assert query.dtype in KERNEL_DTYPES, query.dtype
    assert query.shape[-1] == kv_lora_rank + rope_dim
    assert block_tables.dtype == torch.int32 and block_tables.ndim == 2
    assert block_tables.shape[0] == query.shape[0]
    assert seq_lens.dtype == torch.int32 and seq_lens.shape == (query.shape[0],)


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
        _check_common(a["query"], a["block_tables"], a["seq_lens"], a["kv_lora_rank"],
                      a["qk_rope_head_dim"])
        return a


class TrtllmMLAReference(_SignatureBoundKernel):
    """``flashinfer.decode.trtllm_batch_decode_with_kv_cache_mla`` on CPU.

    Fixed-Q layout only (``cum_seq_lens_q`` unset): query [B, q_len, H, D],
    kv_cache [P, 1, page, D]; token ``t`` of request ``b`` sees
    ``seq_lens[b] - q_len + 1 + t`` local tokens (the kernel is causal), or,
    with ``enable_dcp``, the local part of the global causal bound on a
    token-striped (interleave 1) layout. Natural-log LSE [B, q_len, H].
    """

    def __init__(self):
        super().__init__("flashinfer.decode", "trtllm_batch_decode_with_kv_cache_mla")

    def __call__(self, *args, **kwargs):
        a = self._bind(args, kwargs)
        query, kv_cache = a["query"], a["kv_cache"]
        assert kv_cache.ndim == 4 and kv_cache.shape[1] == 1, "kv_cache [P, 1, page, D]"
        assert kv_cache.dtype == query.dtype
        assert a["cum_seq_lens_q"] is None, "stub covers the fixed-Q layout"
        assert int(a["seq_lens"].max()) <= a["max_seq_len"]
        query_len = query.shape[1]
        if a["enable_dcp"]:
            assert a["return_lse"], "DCP requires return_lse=True"
            causal_global = a["causal_seqlens_kv_global"]
            visible = dcp_local_seq_lens(
                _bounds(query_len, causal_global, causal=True), a["cp_world"],
                a["cp_rank"], 1)
        else:
            visible = _bounds(query_len, a["seq_lens"], causal=True)
        scale = float(a["bmm1_scale"])
        out, lse = _reference(query, kv_cache[:, 0], a["block_tables"], visible,
                              scale, a["kv_lora_rank"])
        out = (out * float(a["bmm2_scale"])).to(torch.bfloat16
                                                if query.dtype == torch.float8_e4m3fn
                                                else query.dtype)
        return (out, lse) if a["return_lse"] else out


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
            visible = dcp_local_seq_lens(global_bound, a["cp_world"], a["cp_rank"],
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
