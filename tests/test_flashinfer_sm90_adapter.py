# SPDX-License-Identifier: Apache-2.0
"""FlashInfer sm90 MLA adapter: plan arguments, call signature, masking.

CPU-safe: a fake ``flashinfer.mla`` records the calls; the real signature is
checked with ``inspect.signature`` when flashinfer imports; a GPU DCP check
runs when CUDA and flashinfer are both there.
"""

from __future__ import annotations

import inspect
import math
import os
import sys
import types

import pytest
import torch


from vllm.v1.attention.ops import dcp_decode as dcp
from vllm.v1.attention.ops import flashinfer_sm90_mla as fsm

try:
    import flashinfer.mla as real_fi_mla  # noqa: F401
    HAVE_FLASHINFER = True
except Exception:  # ImportError, or a CUDA-less import failure
    HAVE_FLASHINFER = False


def _csr_python(kv_lens, table, page):
    indptr, indices = [0], []
    for n, row in zip(kv_lens.tolist(), table.tolist()):
        pages = -(-n // page)
        indices += row[:pages]
        indptr.append(indptr[-1] + pages)
    return indptr, indices


@pytest.mark.parametrize("seed", range(15))
def test_paged_kv_csr_matches_python(seed):
    gen = torch.Generator().manual_seed(seed)
    segs = int(torch.randint(1, 30, (), generator=gen))
    page = [1, 16, 64][seed % 3]
    cols = int(torch.randint(1, 12, (), generator=gen))
    kv_lens = torch.randint(0, page * cols + 1, (segs,), generator=gen).int()
    kv_lens[torch.rand(segs, generator=gen) < 0.2] = 0
    table = torch.randint(1, 5000, (segs, cols), generator=gen).int()
    csr = fsm.build_paged_kv_csr(kv_lens, table, page)
    indptr, indices = _csr_python(kv_lens, table, page)
    assert csr.kv_indptr.tolist() == indptr
    assert csr.kv_indices.shape[0] == segs * cols
    assert csr.kv_indices[: indptr[-1]].tolist() == indices
    assert bool((csr.kv_indices[indptr[-1]:] == 0).all())
    assert csr.kv_indptr.dtype == torch.int32 == csr.kv_indices.dtype


def test_token_empty_mask_matches_python():
    qsl = torch.tensor([0, 3, 3, 4, 9], dtype=torch.int32)
    kv = torch.tensor([5, 0, 0, 7], dtype=torch.int32)
    got = fsm.token_empty_mask(qsl, kv, 11).tolist()
    want = [False] * 3 + [True] + [False] * 5 + [True, True]
    assert got == want


class _FakeWrapper:
    """Stand-in for BatchMLAPagedAttentionWrapper; computes with the torch
    reference and returns a base-2 LSE like FlashInfer."""

    calls: list = []

    def __init__(self, workspace, backend="auto", **kwargs):
        _FakeWrapper.calls.append(("init", dict(backend=backend, **kwargs)))

    def plan(self, **kwargs):
        _FakeWrapper.calls.append(("plan", kwargs))
        self.meta = kwargs["metadata"]
        self.kw = kwargs

    def run(self, **kwargs):
        _FakeWrapper.calls.append(("run", kwargs))
        m = self.meta
        q, kv = kwargs["query"], kwargs["kv_cache"]
        tokens = q.shape[0]
        qo = m.qo_indptr.cpu()
        seg = torch.searchsorted(qo[1:].contiguous(), torch.arange(tokens).int(),
                                 right=True)
        seg = seg.clamp(max=m.kv_len_arr.numel() - 1)
        # Rebuild a dense table from the CSR to feed the reference.
        m = types.SimpleNamespace(**{k: getattr(m, k).cpu() for k in (
            "qo_indptr", "kv_indptr", "kv_indices", "kv_len_arr")})
        pages = m.kv_indptr[1:] - m.kv_indptr[:-1]
        width = max(int(pages.max()), 1)
        table = torch.zeros(m.kv_len_arr.numel(), width, dtype=torch.int32)
        for s in range(table.shape[0]):
            p = int(pages[s])
            table[s, :p] = m.kv_indices[int(m.kv_indptr[s]):int(m.kv_indptr[s]) + p]
        dev = q.device
        seg_lens = m.kv_len_arr.cpu()[seg].to(dev)
        out, lse = dcp.mla_decode_reference(
            q, kv, table[seg].to(dev), seg_lens, kv_lora_rank=512,
            scale=self.kw["sm_scale"])
        kwargs["out"].copy_(out)
        # Garbage on empty rows, as a real kernel may leave.
        kwargs["lse"].copy_(torch.where(seg_lens[:, None] > 0,
                                        lse / math.log(2.0), float("nan")))
        kwargs["out"][seg_lens == 0] = float("nan")
        return kwargs["out"], kwargs["lse"]


class _FakeMeta:
    def __init__(self, **kw):
        self.__dict__.update(kw)

    @classmethod
    def csr(cls, qo_indptr, kv_indptr, kv_indices, kv_len_arr):
        return cls(qo_indptr=qo_indptr, kv_indptr=kv_indptr,
                   kv_indices=kv_indices, kv_len_arr=kv_len_arr)


@pytest.fixture
def fake_flashinfer(monkeypatch):
    pkg = types.ModuleType("flashinfer")
    mla = types.ModuleType("flashinfer.mla")
    mla.BatchMLAPagedAttentionWrapper = _FakeWrapper
    mla.MLAPlanMetadata = _FakeMeta
    pkg.mla = mla
    monkeypatch.setitem(sys.modules, "flashinfer", pkg)
    monkeypatch.setitem(sys.modules, "flashinfer.mla", mla)
    _FakeWrapper.calls = []
    return _FakeWrapper


def _dcp_case(seed, world, interleave, causal):
    gen = torch.Generator().manual_seed(seed)
    page, heads = 16, 2
    lens = [3, 40, 70, 9]
    q_lens = [2, 4, 0, 3] if causal else [3, 3, 0, 3]
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    blocks = [-(-n // page) for n in lens]
    cache = torch.randn(sum(blocks) + 1, page, 576, generator=gen)
    cache[0] = float("nan")
    ids = torch.randperm(sum(blocks), generator=gen) + 1
    table = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    start = 0
    for i, n in enumerate(blocks):
        table[i, :n] = ids[start:start + n]
        start += n
    seq = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(int(qsl[-1]) + 2, heads, 576, generator=gen)  # 2 pad rows
    return cache, table, seq, qsl, q, page, heads


# The prefix+tail path launches a Triton kernel: CUDA, or TRITON_INTERPRET=1.
CAN_RUN_TRITON = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.parametrize("mode", ["flat", "grouped", "prefix"])
@pytest.mark.parametrize("causal", [True, False])
def test_adapter_dcp_merge_with_fake(fake_flashinfer, causal, mode):
    grouped = mode == "grouped"
    tdm = None
    if grouped:
        tdm = pytest.importorskip("vllm.v1.attention.ops.triton_dcp_metadata")
    if mode == "prefix" and not CAN_RUN_TRITON:
        pytest.skip("prefix+tail needs CUDA or TRITON_INTERPRET=1")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    world, interleave = 4, 8
    cache, table, seq, qsl, q, page, heads = _dcp_case(0, world, interleave, causal)
    rows = q.shape[0]
    scale = 0.07
    full = dcp.build_flat_decode(seq, qsl, table, world_size=1, rank=0,
                                 interleave=1, causal=causal, num_rows=rows)
    ref_out, ref_lse = dcp.mla_decode_reference(q, cache, full.block_table,
                                                full.seq_lens,
                                                kv_lora_rank=512, scale=scale)
    shards = dcp.shard_paged_kv(cache, table, seq, world_size=world,
                                interleave=interleave,
                                generator=torch.Generator().manual_seed(1))
    outs, lses = [], []
    for rank, (lc, lt) in enumerate(shards):
        flat = dcp.build_flat_decode(seq, qsl, lt, world_size=world, rank=rank,
                                     interleave=interleave, causal=causal,
                                     num_rows=rows)
        mla = fsm.FlashInferSm90MLA(torch.empty(8, dtype=torch.uint8),
                                    num_heads=heads, page_size=page,
                                    sm_scale=scale, dtype=torch.float32)
        if grouped:
            mla.plan_grouped(tdm.build_grouped_decode_reference(flat, qsl, lt),
                             num_tokens=rows)
        elif mode == "prefix":
            mla.plan_causal_prefix(flat, qsl)
        else:
            mla.plan_flat(flat)
        if mode == "prefix":
            if mla.tail is not None:
                mla.tail = tuple(x.to(device) if torch.is_tensor(x) else x
                                 for x in mla.tail)
            mla.token_empty = mla.token_empty.to(device)
            mla.empty_rows = mla.empty_rows.to(device)
            out, lse = mla.run(q.to(device), lc.to(device))
            out, lse = out.cpu(), lse.cpu()
        else:
            out, lse = mla.run(q, lc)
        assert not torch.isnan(out).any() and not torch.isnan(lse).any()
        outs.append(out)
        lses.append(lse)
    out, lse = dcp.merge_partials(torch.stack(outs), torch.stack(lses))
    assert torch.allclose(out, ref_out, atol=1e-4, rtol=1e-4)
    assert torch.allclose(lse, ref_lse, atol=1e-4)
    # The adapter's calls use keyword / MLAPlanMetadata forms.
    kinds = [c[0] for c in fake_flashinfer.calls]
    assert kinds[0] == "init" and fake_flashinfer.calls[0][1]["backend"] == "fa3"
    plan = next(c[1] for c in fake_flashinfer.calls if c[0] == "plan")
    assert plan["causal"] is False and plan["lse_mode"] == "base2"
    assert plan["head_dim_ckv"] == 512 and plan["head_dim_kpe"] == 64


@pytest.mark.skipif(not HAVE_FLASHINFER, reason="flashinfer not importable")
def test_calls_bind_to_installed_flashinfer(fake_flashinfer):
    # The fixture swapped sys.modules; _REAL_MLA was imported before it.
    cache, table, seq, qsl, q, page, heads = _dcp_case(3, 2, 1, True)
    flat = dcp.build_flat_decode(seq, qsl, table, world_size=2, rank=0,
                                 interleave=1, causal=True, num_rows=q.shape[0])
    mla = fsm.FlashInferSm90MLA(torch.empty(8, dtype=torch.uint8),
                                num_heads=heads, page_size=page, sm_scale=0.1,
                                dtype=torch.float32)
    mla.plan_flat(flat)
    mla.run(q, cache)
    calls = {k: v for k, v in fake_flashinfer.calls}
    installed = _REAL_MLA
    wrapper = installed.BatchMLAPagedAttentionWrapper
    sig_init = inspect.signature(wrapper.__init__)
    sig_init.bind(None, torch.empty(1), **calls["init"])
    inspect.signature(inspect.unwrap(wrapper.plan)).bind(None, **calls["plan"])
    inspect.signature(inspect.unwrap(wrapper.run)).bind(None, **calls["run"])
    inspect.signature(installed.MLAPlanMetadata.csr).bind(
        qo_indptr=1, kv_indptr=1, kv_indices=1, kv_len_arr=1)
    for name in ("metadata", "lse_mode", "page_size", "sm_scale"):
        assert name in inspect.signature(inspect.unwrap(wrapper.plan)).parameters


_REAL_MLA = real_fi_mla if HAVE_FLASHINFER else None


@pytest.mark.skipif(not CAN_RUN_TRITON, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_tail_merge_matches_reference(dtype):
    """Prefix partial (natural LSE, poisoned where empty) + tail == full."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(5)
    tokens, heads, page = 7, 20, 4
    cache = torch.randn(12, page, 576, generator=gen).to(dtype)
    table = torch.randint(1, 12, (tokens, 5), generator=gen).int()
    row_lens = torch.tensor([5, 6, 7, 3, 0, 9, 2]).int()
    prefix = torch.tensor([5, 5, 5, 0, 0, 7, 2]).int()
    q = torch.randn(tokens, heads, 576, generator=gen).to(dtype)
    scale = 0.05
    pre_out, pre_lse = dcp.mla_decode_reference(q.float(), cache.float(), table,
                                                prefix, kv_lora_rank=512,
                                                scale=scale)
    ref_out, ref_lse = dcp.mla_decode_reference(q.float(), cache.float(), table,
                                                row_lens, kv_lora_rank=512,
                                                scale=scale)
    out = pre_out.to(dtype).clone()
    lse = pre_lse.clone()
    out[prefix == 0] = float("nan")
    lse[prefix == 0] = float("nan")
    args = [x.to(device) for x in (q, cache, table, row_lens, prefix, out, lse)]
    fsm.causal_tail_merge(*args, sm_scale=scale, max_tail=4)
    got_out, got_lse = args[5].cpu().float(), args[6].cpu()
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert torch.allclose(got_out, ref_out, atol=tol, rtol=tol)
    assert torch.equal(torch.isinf(got_lse), torch.isinf(ref_lse))
    fin = torch.isfinite(ref_lse)
    assert torch.allclose(got_lse[fin], ref_lse[fin], atol=1e-3)
    assert bool((got_out[row_lens == 0] == 0).all())
