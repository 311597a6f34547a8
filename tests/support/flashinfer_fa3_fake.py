# SPDX-License-Identifier: Apache-2.0
"""A fake ``flashinfer.mla`` whose FA3 wrapper honours the plan it is given.

``FakeFA3Wrapper`` stands in for ``BatchMLAPagedAttentionWrapper(backend=
"fa3")`` on CPU: each planned segment attends to the pages and length of its
CSR entry (the index tensor read at run time, as the real kernel reads device
memory), FlashInfer 0.7.4's planned-shape contract enforced (the rows run
must be the rows planned), a base-2 LSE returned and NaN left on segments
without KV. ``flashinfer_mla_faked()`` puts it where vLLM's modules import
it from, for the duration of a ``with``.
"""

from __future__ import annotations

import contextlib
import math
import sys
import types

import torch


class FakeFA3Wrapper:
    """Stand-in for BatchMLAPagedAttentionWrapper(backend="fa3").

    Computes each planned segment's non-causal attention over the pages its
    CSR entry lists (``kv_indices`` read when ``run`` is called) with the ops
    layer's reference; returns a base-2 LSE like FlashInfer and NaN on
    segments without KV, as a real kernel may leave them.
    """

    calls: list = []

    def __init__(self, workspace, backend="auto", **kwargs):
        FakeFA3Wrapper.calls.append(("init", dict(backend=backend, **kwargs)))
        self.meta = None
        # CUDA-graph mode: reserved metadata buffers, rewritten by every plan.
        self.graph = kwargs.get("use_cuda_graph", False)
        self.reserved = {k: kwargs.get(k) for k in ("qo_indptr", "kv_indptr",
                                                     "kv_indices", "kv_len_arr")}

    def plan(self, **kwargs):
        FakeFA3Wrapper.calls.append(("plan", kwargs))
        meta = kwargs["metadata"]
        if kwargs["causal"]:
            raise NotImplementedError("the adapter plans non-causal segments")
        # What FlashInfer reads on the host at plan time.
        self.qo = meta.qo_indptr.cpu().long()
        self.kv_indptr = meta.kv_indptr.cpu().long()
        self.kv_lens = meta.kv_len_arr.cpu().long()
        assert self.qo.shape[0] == self.kv_lens.shape[0] + 1
        self.kv_indices = meta.kv_indices  # read at run time
        if self.graph:  # as FlashInfer: exact shapes, indices may be larger
            for name in ("qo_indptr", "kv_indptr", "kv_len_arr"):
                src, dst = getattr(meta, name), self.reserved[name]
                if dst.shape != src.shape:
                    raise ValueError(f"CUDA graph reserved {name} buffer has "
                                     "insufficient or incompatible capacity.")
                dst.copy_(src)
            src, dst = meta.kv_indices, self.reserved["kv_indices"]
            if dst.shape[0] < src.shape[0]:
                raise ValueError("kv_indices capacity")
            if src.data_ptr() != dst.data_ptr():
                dst[: src.shape[0]].copy_(src)
            self.kv_indices = dst
        self.planned_shape = (int(self.qo[-1]), kwargs["num_heads"])
        self.kw = kwargs

    def run(self, **kwargs):
        FakeFA3Wrapper.calls.append(("run", kwargs))
        q, kv = kwargs["query"], kwargs["kv_cache"]
        if tuple(q.shape[:2]) != self.planned_shape:  # FlashInfer 0.7.4
            raise ValueError("q_nope rows and heads must match the planned query shape.")
        out, lse = kwargs["out"], kwargs["lse"]
        indices = self.kv_indices.cpu().long()
        page = self.kw["page_size"]
        for s in range(self.kv_lens.shape[0]):
            rows = slice(int(self.qo[s]), int(self.qo[s + 1]))
            n = int(self.kv_lens[s])
            if n == 0:
                out[rows] = float("nan")
                lse[rows] = float("nan")
                continue
            pages = indices[int(self.kv_indptr[s]):int(self.kv_indptr[s + 1])]
            assert pages.numel() == -(-n // page)
            keys = kv[pages.to(kv.device)].reshape(-1, kv.shape[-1])[:n].double()
            scores = torch.einsum("thd,kd->thk", q[rows].double(), keys)
            scores = scores * self.kw["sm_scale"]
            seg_lse = torch.logsumexp(scores, dim=-1)
            out[rows] = (torch.softmax(scores, dim=-1) @ keys[:, :512]).to(out.dtype)
            lse[rows] = (seg_lse / math.log(2.0)).float()
        return out, lse


class FakePlanMetadata:
    def __init__(self, **kw):
        self.__dict__.update(kw)

    @classmethod
    def csr(cls, qo_indptr, kv_indptr, kv_indices, kv_len_arr):
        return cls(qo_indptr=qo_indptr, kv_indptr=kv_indptr,
                   kv_indices=kv_indices, kv_len_arr=kv_len_arr)


def fake_flashinfer_package() -> types.ModuleType:
    """A ``flashinfer`` package whose ``mla`` module's FA3 wrapper is the
    plan-honouring fake."""
    pkg = types.ModuleType("flashinfer")
    pkg.mla = types.ModuleType("flashinfer.mla")
    pkg.mla.BatchMLAPagedAttentionWrapper = FakeFA3Wrapper
    pkg.mla.MLAPlanMetadata = FakePlanMetadata
    return pkg


@contextlib.contextmanager
def flashinfer_mla_as(module: types.ModuleType):
    """``sys.modules["flashinfer.mla"]`` is ``module`` inside the ``with``;
    only that key is restored after (modules first imported inside stay)."""
    missing = object()
    before = sys.modules.get("flashinfer.mla", missing)
    sys.modules["flashinfer.mla"] = module
    try:
        yield
    finally:
        if before is missing:
            sys.modules.pop("flashinfer.mla", None)
        else:
            sys.modules["flashinfer.mla"] = before


@contextlib.contextmanager
def flashinfer_mla_faked():
    """``flashinfer.mla`` is the fake inside the ``with`` (``flashinfer_mla_as``)."""
    FakeFA3Wrapper.calls = []
    with flashinfer_mla_as(fake_flashinfer_package().mla):
        yield FakeFA3Wrapper
