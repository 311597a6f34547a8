# SPDX-License-Identifier: Apache-2.0
"""FlashInfer sm90 MLA adapter: plan contract, call signature, prefix+tail.

CPU-safe: a fake ``flashinfer.mla`` stands in for FA3. It honours the plan it
is given (each segment attends to the pages and length of its CSR entry, read
at run time from the index tensor the plan handed over, as the real kernel
reads device memory) and enforces FlashInfer 0.7.4's planned-shape contract
(the rows run must be the rows planned). The installed flashinfer's
signatures are bound with ``inspect.signature``. Tests whose name holds
``triton_path`` launch the tail-merge Triton kernel: they run directly on CUDA
or under ``TRITON_INTERPRET=1``, and ``test_interpreter_runs_triton_path_tests`` runs
them in a subprocess with the interpreter on every CI run.
"""

from __future__ import annotations

import importlib
import inspect
import math
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st


from tests.support import fa3_native
from tests.support.flashinfer_fa3_fake import FakeFA3Wrapper, fake_flashinfer_package
from tests.support.fa3_native import FlashInferSm90MLAGraphed as GraphedFA3
from tests.support.triton_interpreted import (
    DEVICE, needs_triton, run_triton_path_tests, runs_where_triton_cannot)
from vllm.v1.attention.ops import dcp_decode as dcp
from vllm.v1.attention.ops.dcp_decode import DCPLayout
from vllm.v1.attention.ops import flashinfer_sm90_mla as fsm
from tools.dcp_simulated_ranks import (decode_on_simulated_ranks,
                                       random_paged_kv)

try:  # flashinfer asks the GPU for its properties at import
    from tests.support.kernel_stubs import import_on_cpu

    real_fi_mla = (importlib.import_module("flashinfer.mla")
                   if torch.cuda.is_available() else import_on_cpu("flashinfer.mla"))
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
def test_native_paged_kv_csr_matches_python(seed):
    """The benchmarks' no-DCP baseline plans these page lists."""
    gen = torch.Generator().manual_seed(seed)
    segs = int(torch.randint(1, 30, (), generator=gen))
    page = [1, 16, 64][seed % 3]
    cols = int(torch.randint(1, 12, (), generator=gen))
    kv_lens = torch.randint(0, page * cols + 1, (segs,), generator=gen).int()
    kv_lens[torch.rand(segs, generator=gen) < 0.2] = 0
    table = torch.randint(1, 5000, (segs, cols), generator=gen).int()
    kv_indptr, kv_indices = fa3_native.paged_kv_csr(kv_lens, table, page)
    indptr, indices = _csr_python(kv_lens, table, page)
    assert kv_indptr.tolist() == indptr
    assert kv_indices.tolist() == indices
    assert kv_indptr.dtype == torch.int32 == kv_indices.dtype


@pytest.fixture
def fake_flashinfer(monkeypatch):
    pkg = fake_flashinfer_package()
    monkeypatch.setitem(sys.modules, "flashinfer", pkg)
    monkeypatch.setitem(sys.modules, "flashinfer.mla", pkg.mla)
    FakeFA3Wrapper.calls = []
    return FakeFA3Wrapper


def _dcp_case(seed, causal, page=16, lens=(3, 40, 70, 9, 2)):
    """A ragged batch: q_len 0 request, prefix-0 requests, 2 padding rows."""
    gen = torch.Generator().manual_seed(seed)
    heads = 2
    q_lens = [2, 4, 0, 3, 2] if causal else [3, 3, 0, 3, 2]
    lens = list(lens)
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    cache, table, seq = random_paged_kv(lens, page, generator=gen)
    q = torch.randn(int(qsl[-1]) + 2, heads, 576, generator=gen)  # 2 pad rows
    return cache, table, seq, qsl, q, page, heads




def _merged_dcp(causal, world, interleave, *, seed=0, lens=(3, 40, 70, 9, 2),
                page=16):
    """Every rank planned as the backend plans (prefix+tail), run, merged;
    and float64-accumulated full attention without DCP."""
    cache, table, seq, qsl, q, page, heads = _dcp_case(seed, causal, page, lens)
    rows, scale = q.shape[0], 0.07
    full = dcp.build_flat_decode(seq, qsl, table, layout=DCPLayout(), causal=causal,
                                 num_rows=rows)
    ref = dcp.mla_decode_reference(q, cache, full.block_table, full.seq_lens,
                                   kv_lora_rank=512, scale=scale)

    def decode_rank(layout, lc, lt):
        flat = dcp.build_flat_decode(seq.to(DEVICE), qsl.to(DEVICE), lt.to(DEVICE),
                                     layout=layout,
                                     causal=causal,
                                     num_rows=rows)
        mla = GraphedFA3(torch.empty(8, dtype=torch.uint8, device=DEVICE),
                         num_heads=heads, page_size=page,
                         sm_scale=scale, dtype=torch.float32,
                         max_rows=rows, max_cols=lt.shape[1])
        fa3_native.plan_prefix_tail_from_rows(mla, flat, qsl.to(DEVICE))
        out, lse = mla.run(q.to(DEVICE), lc.to(DEVICE))
        assert not torch.isnan(out).any() and not torch.isnan(lse).any()
        return out.cpu(), lse.cpu()

    merged = decode_on_simulated_ranks(cache, table, seq, decode_rank,
                                       layout=DCPLayout(world, interleave=interleave),
                                       generator=torch.Generator().manual_seed(1))
    return merged, ref


@needs_triton
@pytest.mark.parametrize("world,interleave", [(1, 1), (2, 1), (4, 8), (8, 16)])
@pytest.mark.parametrize("causal", [True, False])
def test_triton_path_prefix_tail_merges_to_full(fake_flashinfer, causal, world,
                                                interleave):
    """Ragged, padded, a q_len-0 request, prefix-0 rows with tails, page 4 so
    that tails cross local pages; FA3 is made and planned as the backend needs
    it (fa3 backend, non-causal segments, base-2 LSE, 512 + 64 wide)."""
    (out, lse), (ref_out, ref_lse) = _merged_dcp(
        causal, world, interleave, lens=(3, 40, 70, 9, 2), page=4)
    torch.testing.assert_close(out, ref_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=0)
    kinds = [c[0] for c in fake_flashinfer.calls]
    assert kinds[0] == "init" and fake_flashinfer.calls[0][1]["backend"] == "fa3"
    plans = [c[1] for c in fake_flashinfer.calls if c[0] == "plan"]
    assert len(plans) == world
    for plan in plans:
        assert plan["causal"] is False and plan["lse_mode"] == "base2"
        assert plan["head_dim_ckv"] == 512 and plan["head_dim_kpe"] == 64


def test_plan_prefix_tail_host_segments():
    """Segments: one per request with tokens, padding in q_len chunks."""
    qsl = torch.tensor([0, 4, 4, 8, 12], dtype=torch.int32)  # request 1: q_len 0
    prefix = torch.tensor([70, 5, -3, 0])
    plan = fsm.plan_prefix_tail_host(qsl, prefix, num_rows=21, page_size=16,
                                     whole_pages=False)
    assert plan.qo_indptr.tolist() == [0, 4, 8, 12, 16, 20, 21]
    assert plan.kv_lens.tolist() == [70, 0, 0, 0, 0, 0]
    assert plan.kv_indptr.tolist() == [0, 5, 5, 5, 5, 5, 5]
    assert plan.seg_to_req.tolist() == [0, 2, 3, 0, 0, 0]
    assert plan.row_prefix.tolist() == [70] * 4 + [0] * 17
    # Whole pages (the default): 70 -> 64, 5 -> 0 keys.
    paged = fsm.plan_prefix_tail_host(qsl, torch.tensor([70, 5, 21, 16]),
                                      num_rows=21, page_size=16)
    assert paged.kv_lens.tolist() == [64, 16, 16, 0, 0, 0]
    assert paged.kv_indptr.tolist() == [0, 4, 5, 6, 6, 6, 6]
    assert paged.row_prefix.tolist() == [64] * 4 + [16] * 8 + [0] * 9
    # Fewer rows than tokens (the layers run a prefix of the batch).
    plan = fsm.plan_prefix_tail_host(qsl, prefix, num_rows=6, page_size=16,
                                     whole_pages=False)
    assert plan.qo_indptr.tolist() == [0, 4, 6]
    assert plan.row_prefix.tolist() == [70] * 4 + [0] * 2
    for p in (plan, paged):
        assert p.qo_indptr.dtype == p.kv_lens.dtype == p.kv_indptr.dtype == torch.int32
        assert p.qo_indptr.device.type == "cpu"


def _segments_reference(qsl, prefix, num_rows, page, whole_pages):
    """plan_prefix_tail_host's segments, written with torch ops (the form it
    had before it moved to Python ints)."""
    qsl = qsl.long()
    num_tokens = min(int(qsl[-1]), num_rows)
    q_lens = qsl[1:] - qsl[:-1]
    reqs = torch.nonzero((q_lens > 0) & (qsl[:-1] < num_tokens)).flatten()
    keys = prefix.long().clamp(min=0)
    if whole_pages:
        keys = keys - keys % page
    pad_len = max(int(q_lens.max()), 1) if q_lens.numel() else 1
    pads = torch.arange(num_tokens, num_rows, pad_len)
    qo = torch.cat([qsl[reqs], pads, torch.tensor([num_rows])])
    kv_lens = torch.cat([keys[reqs], torch.zeros_like(pads)])
    kv_indptr = torch.cat([torch.zeros(1, dtype=torch.long),
                           torch.cumsum((kv_lens + page - 1) // page, 0)])
    rows = torch.repeat_interleave(kv_lens, qo[1:] - qo[:-1])
    return qo, kv_lens, kv_indptr, torch.cat([reqs, torch.zeros_like(pads)]), rows


@given(q_lens=st.lists(st.integers(0, 8), min_size=0, max_size=12),
       data=st.data(), page=st.sampled_from([1, 16, 64]), whole_pages=st.booleans())
@settings(max_examples=300, deadline=None)
def test_plan_prefix_tail_host_matches_torch_reference(q_lens, data, page, whole_pages):
    """Random ragged batches: q_len-0 requests, negative and page-straddling
    prefixes, fewer or more rows than tokens."""
    qsl = torch.tensor([0] + q_lens).cumsum(0).int()
    prefix = torch.tensor(data.draw(st.lists(st.integers(-5, 300), min_size=len(q_lens),
                                             max_size=len(q_lens))), dtype=torch.int64)
    num_rows = data.draw(st.integers(0, int(qsl[-1]) + 6))
    plan = fsm.plan_prefix_tail_host(qsl, prefix, num_rows=num_rows, page_size=page,
                                     whole_pages=whole_pages)
    ref = _segments_reference(qsl, prefix, num_rows, page, whole_pages)
    got = (plan.qo_indptr, plan.kv_lens, plan.kv_indptr, plan.seg_to_req, plan.row_prefix)
    for name, g, r in zip(("qo_indptr", "kv_lens", "kv_indptr", "seg_to_req",
                           "row_prefix"), got, ref):
        assert g.tolist() == r.tolist(), name
    assert plan.num_rows == num_rows


def test_rows_run_are_rows_planned(fake_flashinfer):
    """FlashInfer 0.7.4 runs only the planned rows: the plan covers the
    padding rows too, from host offsets, and a run of another row count is
    refused."""
    cache, table, seq, qsl, q, page, heads = _dcp_case(2, True)
    rows = q.shape[0]
    flat = dcp.build_flat_decode(seq, qsl, table, layout=DCPLayout(2, 1, 1),
                                 causal=True, num_rows=rows)
    mla = GraphedFA3(torch.empty(8, dtype=torch.uint8), num_heads=heads,
                     page_size=page, sm_scale=0.1, dtype=torch.float32,
                     max_rows=rows, max_cols=table.shape[1])
    with pytest.raises(ValueError, match="plan every forward"):
        mla.run(q, cache)  # nothing planned yet
    host = fsm.plan_prefix_tail_host(qsl, seq, num_rows=rows, page_size=page)
    mla.plan_prefix_tail(host, table, flat.seq_lens, flat.block_table)
    plan = next(c[1] for c in reversed(fake_flashinfer.calls) if c[0] == "plan")
    qo = plan["metadata"].qo_indptr
    assert qo.device.type == "cpu" and int(qo[-1]) == rows
    assert plan["metadata"].kv_indptr.device.type == "cpu"
    assert plan["metadata"].kv_len_arr.device.type == "cpu"
    with pytest.raises(ValueError, match="rows"):
        mla.run(q[: rows - 1], cache)


def test_prefix_tail_plan_uses_persistent_buffers(fake_flashinfer):
    """Two plans of different batches hand FlashInfer the same index buffer
    (a captured graph keeps its pointer); capacity overflow is an error."""
    cache, table, seq, qsl, q, page, heads = _dcp_case(3, True)
    rows = q.shape[0]
    mla = fsm.FlashInferSm90MLA(torch.empty(8, dtype=torch.uint8), num_heads=heads,
                                page_size=page, sm_scale=0.1, dtype=torch.float32,
                                max_rows=rows, max_cols=table.shape[1])
    flat = dcp.build_flat_decode(seq, qsl, table, layout=DCPLayout(), causal=True,
                                 num_rows=rows)
    ptrs, wrappers = [], []
    # As the builder: the plan vLLM captures is for_graph, its replays reuse
    # the CUDA-graph wrapper of that segment count.
    for lens, for_graph in ((seq, True), (seq.flip(0), False)):
        host = fsm.plan_prefix_tail_host(qsl, lens.clamp(max=seq.min()),
                                         num_rows=rows, page_size=page,
                                         whole_pages=False)
        mla.plan_prefix_tail(host, table, flat.seq_lens, flat.block_table,
                             for_graph=for_graph)
        ptrs.append(fake_flashinfer.calls[-1][1]["metadata"].kv_indices.data_ptr())
        ptrs.append(mla.tail.prefix_lens.data_ptr())
        wrappers.append(mla._wrapper)
    assert ptrs[0] == ptrs[2] and ptrs[1] == ptrs[3]
    # One CUDA-graph wrapper for the segment count, replanned in place.
    assert wrappers[0] is wrappers[1] and wrappers[0].graph
    init = [c[1] for c in fake_flashinfer.calls if c[0] == "init"]
    assert [c.get("use_cuda_graph", False) for c in init] == [False, True]
    assert init[1]["kv_indices"].data_ptr() == ptrs[0]
    big = fsm.plan_prefix_tail_host(qsl, seq, num_rows=rows + 1, page_size=page)
    with pytest.raises(ValueError, match="max-num-seqs"):
        mla.plan_prefix_tail(big, table, flat.seq_lens, flat.block_table)


def _check_schedule_reuse(*, dtype, heads, page, tol):
    """Forwards of two causal requests through the graph wrappers, each
    checked against the reference decode of the same rows, with the FA3 plan
    count after each (see the tests below)."""
    cols, scale = 8, 0.07
    gen = torch.Generator().manual_seed(5)
    mla = GraphedFA3(torch.empty(128 << 20, dtype=torch.uint8, device=DEVICE),
                     num_heads=heads, page_size=page, sm_scale=scale,
                     dtype=dtype, max_rows=4, max_cols=cols)
    two, one = [0, 2, 4], [0, 1, 2]  # query offsets: 2 segments; 2 + 2 padding
    steps = [  # (global lengths in 1/16 pages, query offsets, FA3 plans so far)
        ((40, 70), two, 1),  # prefixes 39, 69 -> 32, 64 (page 16)
        ((40, 70), two, 1),  # new cache and pages, same lengths
        ((41, 71), two, 1),  # longer tails, same whole pages
        ((50, 71), two, 2),  # 49 -> 48: a page filled
        ((40, 70), two, 3),  # back: differs from the wrapper's last plan
        ((40, 70), one, 4),  # 1-token queries + 2 padding rows: 4 segments
        ((40, 70), two, 4),  # the 2-segment wrapper's last schedule again
    ]
    for lens, offsets, plans in steps:
        cache = torch.randn(2 * cols + 1, page, 576, generator=gen)
        table = (torch.randperm(2 * cols, generator=gen) + 1).int().view(2, cols)
        seq = torch.tensor(lens, dtype=torch.int32) * (page // 16)
        qsl = torch.tensor(offsets, dtype=torch.int32)
        q = torch.randn(4, heads, 576, generator=gen)
        flat = dcp.build_flat_decode(seq.to(DEVICE), qsl.to(DEVICE), table.to(DEVICE),
                                     layout=DCPLayout(), causal=True, num_rows=4)
        prefix = fsm.host_prefix_lens(seq, qsl, causal=True, slack=0,
                                      layout=DCPLayout())
        host = fsm.plan_prefix_tail_host(qsl, prefix, num_rows=4, page_size=page)
        mla.plan_prefix_tail(host, table.to(DEVICE), flat.seq_lens, flat.block_table)
        assert mla.fa3_plans == plans, (lens, offsets)
        q, cache = q.to(dtype).to(DEVICE), cache.to(dtype).to(DEVICE)
        out, lse = mla.run(q, cache)
        ref_out, ref_lse = dcp.mla_decode_reference(
            q.float(), cache.float(), flat.block_table, flat.seq_lens,
            kv_lora_rank=512, scale=scale)
        has = flat.seq_lens > 0
        torch.testing.assert_close(out.float()[has], ref_out[has], atol=tol, rtol=tol)
        torch.testing.assert_close(lse[has], ref_lse[has], atol=tol, rtol=0)


@needs_triton
def test_triton_path_unchanged_schedule_is_not_replanned(fake_flashinfer):
    """FlashInfer is planned again only where a wrapper's schedule (segment
    query offsets, whole-page prefixes) changed; every forward still reads
    its own pages, lengths and queries: new pages at the same lengths and
    longer tails within the same pages reuse the plan; a prefix that fills
    a page, a return to the old lengths, and another segment count plan;
    back at the first count, that wrapper's unchanged schedule is reused."""
    _check_schedule_reuse(dtype=torch.float32, heads=2, page=16, tol=1e-4)


@pytest.mark.skipif(DEVICE != "cuda" or not HAVE_FLASHINFER,
                    reason="FlashInfer's FA3 needs an sm90 GPU")
def test_unchanged_schedule_is_not_replanned_on_flashinfer_fa3():
    """The same forwards on FlashInfer's FA3 (page 64, bf16, 16 heads)."""
    _check_schedule_reuse(dtype=torch.bfloat16, heads=16, page=64, tol=2e-2)


def test_plan_beyond_the_start_up_buffers_names_the_flags(fake_flashinfer):
    """The plan buffers are fixed at construction (a captured graph keeps
    their addresses): a larger batch is refused, never reallocated."""
    cache, table, seq, qsl, q, page, heads = _dcp_case(2, True)
    rows = q.shape[0]
    flat = dcp.build_flat_decode(seq, qsl, table, layout=DCPLayout(2, 1, 1),
                                 causal=True, num_rows=rows)
    host = fsm.plan_prefix_tail_host(qsl, seq, num_rows=rows, page_size=page)
    for max_rows, max_cols in ((rows - 1, table.shape[1]), (rows, table.shape[1] - 1)):
        mla = fsm.FlashInferSm90MLA(torch.empty(8, dtype=torch.uint8),
                                    num_heads=heads, page_size=page, sm_scale=0.1,
                                    dtype=torch.float32, max_rows=max_rows,
                                    max_cols=max_cols)
        with pytest.raises(ValueError, match="--max-num-seqs"):
            mla.plan_prefix_tail(host, table, flat.seq_lens, flat.block_table)


@pytest.mark.skipif(not HAVE_FLASHINFER, reason="flashinfer not importable")
def test_calls_bind_to_installed_flashinfer(fake_flashinfer, monkeypatch):
    """The adapter's and the benchmarks' baseline's FlashInfer calls bind to
    the installed signatures (the tail kernel is not what this checks)."""
    # The fixture swapped sys.modules; _REAL_MLA was imported before it.
    monkeypatch.setattr(fsm, "tail_merge", lambda *args, **kwargs: None)
    cache, table, seq, qsl, q, page, heads = _dcp_case(3, True)
    flat = dcp.build_flat_decode(seq, qsl, table, layout=DCPLayout(2, 0, 1),
                                 causal=True, num_rows=q.shape[0])
    mla = GraphedFA3(torch.empty(8, dtype=torch.uint8),  # both wrappers bind
                     num_heads=heads, page_size=page, sm_scale=0.1,
                     dtype=torch.float32, max_rows=q.shape[0],
                     max_cols=table.shape[1])
    fa3_native.plan_prefix_tail_from_rows(mla, flat, qsl)
    mla.run(q, cache)
    native = fa3_native.NativeFA3MLA(torch.empty(8, dtype=torch.uint8),
                                     num_heads=heads, page_size=page,
                                     sm_scale=0.1, dtype=torch.float32)
    native.plan(qsl, seq, table, causal=False)
    native.run(q[: int(qsl[-1])], cache)
    installed = _REAL_MLA
    wrapper = installed.BatchMLAPagedAttentionWrapper
    sig_init = inspect.signature(wrapper.__init__)
    sig_plan = inspect.signature(inspect.unwrap(wrapper.plan))
    sig_run = inspect.signature(inspect.unwrap(wrapper.run))
    checked = {"init": 0, "plan": 0, "run": 0}
    for kind, kwargs in fake_flashinfer.calls:
        if kind == "init":
            sig_init.bind(None, torch.empty(1), **kwargs)
        else:
            (sig_plan if kind == "plan" else sig_run).bind(None, **kwargs)
        checked[kind] += 1
    # The adapter's plain and CUDA-graph wrappers, the baseline's wrapper.
    assert checked == {"init": 3, "plan": 2, "run": 2}
    inspect.signature(installed.MLAPlanMetadata.csr).bind(
        qo_indptr=1, kv_indptr=1, kv_indices=1, kv_len_arr=1)
    for name in ("metadata", "lse_mode", "page_size", "sm_scale"):
        assert name in sig_plan.parameters


_REAL_MLA = real_fi_mla if HAVE_FLASHINFER else None
TAIL_SCALE = 0.05


def _tail_case(seed, dtype, row_lens, prefix, *, heads=20, page=4):
    """Random q [T, heads, 576], cache [40, page, 576] and table [T, 12], and
    float32 attention of each row over its prefix keys and over all of its
    keys (``(out, lse)`` twice; sm_scale ``TAIL_SCALE``)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = row_lens.shape[0]
    cache = torch.randn(40, page, 576, generator=gen).to(dtype)
    table = torch.randint(1, 40, (tokens, 12), generator=gen).int()
    q = torch.randn(tokens, heads, 576, generator=gen).to(dtype)
    refs = [dcp.mla_decode_reference(q.float(), cache.float(), table, lens,
                                     kv_lora_rank=512, scale=TAIL_SCALE)
            for lens in (prefix.clamp(max=row_lens), row_lens)]
    return q, cache, table, *refs


def _assert_tail_merged(out, lse, ref_out, ref_lse, row_lens, prefix, dtype):
    """``tail_merge``'s output against float32 attention over each row's keys:
    NaN where the bound is below the prefix, 0 / -inf on empty rows."""
    got_out, got_lse = out.cpu().float(), lse.cpu()
    good = row_lens >= prefix
    assert bool(torch.isnan(got_out[~good]).all() and torch.isnan(got_lse[~good]).all())
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got_out[good], ref_out[good], atol=tol, rtol=tol)
    assert torch.equal(torch.isinf(got_lse[good]), torch.isinf(ref_lse[good]))
    fin = torch.isfinite(ref_lse) & good[:, None]
    torch.testing.assert_close(got_lse[fin], ref_lse[fin], atol=1e-3, rtol=0)
    assert bool((got_out[row_lens == 0] == 0).all())


@needs_triton
@pytest.mark.parametrize("keys,stages", [(16, 3), (32, 2), (32, 3), (64, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_path_tail_merge_matches_reference(dtype, keys, stages):
    """Prefix partial (base-2 LSE, poisoned where empty) + tail == full: long
    tails (several loop steps), tails crossing pages, prefix-0 rows, empty
    rows, and a row whose exact bound is below its prefix (NaN, loudly), at
    each loop shape the device sweep tried."""
    from vllm.v1.attention.ops.mla_tail_merge import tail_merge

    row_lens = torch.tensor([5, 6, 7, 3, 0, 9, 2, 45, 4]).int()
    prefix = torch.tensor([5, 5, 5, 0, 0, 7, 2, 3, 6]).int()  # last: bad plan
    q, cache, table, (pre_out, pre_lse), (ref_out, ref_lse) = _tail_case(
        5, dtype, row_lens, prefix)
    out = pre_out.to(dtype).clone()
    lse = pre_lse.clone() / math.log(2.0)
    out[prefix == 0] = float("nan")
    lse[prefix == 0] = float("nan")
    args = [x.to(DEVICE) for x in (q, cache, table, row_lens, prefix, out, lse)]
    tail_merge(*args, sm_scale=TAIL_SCALE, keys_per_step=keys, num_stages=stages)
    _assert_tail_merged(args[5], args[6], ref_out, ref_lse, row_lens, prefix, dtype)


@needs_triton
@pytest.mark.parametrize("column_blocks", [1, 2, 4, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_path_tail_merge_column_blocks_flashmla_layout(dtype, column_blocks):
    """The finishing launch as FLASHMLA's rows call it (the prefix LSE in
    FlashMLA's [R, H, s], natural log) with each (row, head block) cut into
    1, 2 or 4 programs along Dv (None: the launch's own choice, 4 at this
    size): tails of one and of several loop steps, a request with no prefix,
    an empty row, a row whose bound is below its prefix (NaN), against
    float32 attention over each row's keys."""
    from vllm.v1.attention.ops.mla_tail_merge import column_blocks_for, tail_merge

    reqs, s, heads = 3, 4, 20
    tokens = reqs * s
    prefix = torch.tensor([9, 0, 5]).int().repeat_interleave(s)
    row_lens = torch.tensor([9, 10, 11, 12, 0, 0, 1, 2, 5, 5, 3, 40]).int()
    q, cache, table, (pre_out, pre_lse), (ref_out, ref_lse) = _tail_case(
        11, dtype, row_lens, prefix, heads=heads)
    out = pre_out.to(dtype)
    out[prefix == 0] = float("nan")  # what a kernel may leave without keys
    lse_in = pre_lse.view(reqs, s, heads).transpose(1, 2).contiguous()
    lse = torch.full((tokens, heads), 7.0)  # only written
    args = [x.to(DEVICE) for x in (q, cache, table, row_lens, prefix, out, lse)]
    tail_merge(*args, sm_scale=TAIL_SCALE, lse_in_base2=False, lse_in=lse_in.to(DEVICE),
               column_blocks=column_blocks)
    _assert_tail_merged(args[5], args[6], ref_out, ref_lse, row_lens, prefix, dtype)
    # A lone q_len 4 request at 96 / 128 heads is cut; two requests are not.
    assert column_blocks_for(4 * 6) == column_blocks_for(4 * 8) == 4
    assert column_blocks_for(8 * 6) == 1 and column_blocks_for(tokens * 2) == 4


def test_tail_merge_column_blocks_are_refused_where_they_cannot_cut():
    """Dv cut only into 1, 2 or 4, and only with a separate prefix LSE (the
    first column block rewrites ``lse``, which the others would read)."""
    from vllm.v1.attention.ops.mla_tail_merge import tail_merge

    q, cache = torch.zeros(2, 16, 576), torch.zeros(4, 4, 576)
    table, lens = torch.ones(2, 2, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    out, lse = torch.zeros(2, 16, 512), torch.zeros(2, 16)
    with pytest.raises(ValueError, match="lse_in"):
        tail_merge(q, cache, table, lens, lens, out, lse, sm_scale=1.0, column_blocks=2)
    with pytest.raises(ValueError, match="column_blocks 3"):
        tail_merge(q, cache, table, lens, lens, out, lse, sm_scale=1.0,
                   lse_in=lse.view(2, 16, 1), column_blocks=3)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_path_tail_merge_without_tails(dtype):
    """A DSpark block's launch (``has_tails=False``, no tail code): rows with
    their prefix as bound come out as the tail launch leaves them (out kept
    bitwise, LSE read from FlashMLA's [R, H, s] layout), empty rows 0 / -inf
    whatever the kernel left there, and a row with a tail or a bound below its
    prefix NaN (loud, never silently short)."""
    from vllm.v1.attention.ops.mla_tail_merge import tail_merge

    gen = torch.Generator().manual_seed(7)
    reqs, s, heads, page = 3, 4, 20, 4
    tokens = reqs * s
    cache = torch.randn(30, page, 576, generator=gen).to(dtype)
    table = torch.randint(1, 30, (tokens, 6), generator=gen).int()
    prefix = torch.tensor([9, 9, 9, 9, 0, 0, 0, 0, 5, 5, 5, 5]).int()
    row_lens = prefix.clone()
    row_lens[9], row_lens[10] = 7, 3  # a tail, a bound below the prefix
    q = torch.randn(tokens, heads, 576, generator=gen).to(dtype)
    out_in = torch.randn(tokens, heads, 512, generator=gen).to(dtype)
    lse_in = torch.randn(reqs, heads, s, generator=gen) * 4  # FlashMLA's layout
    lse_in[1] = float("inf")  # what FlashMLA leaves on a request with no key
    base = [x.to(DEVICE) for x in (q, cache, table, row_lens, prefix)]
    with_tails = (out_in.clone().to(DEVICE), torch.empty(tokens, heads, device=DEVICE))
    no_tails = (out_in.clone().to(DEVICE), torch.empty(tokens, heads, device=DEVICE))
    for (out, lse), has_tails in ((with_tails, True), (no_tails, False)):
        tail_merge(*base, out, lse, sm_scale=0.05, lse_in_base2=False,
                   lse_in=lse_in.to(DEVICE), has_tails=has_tails)
    got_out, got_lse = no_tails[0].cpu(), no_tails[1].cpu()
    plain = torch.tensor([r < 4 or r in (8, 11) for r in range(tokens)])
    plain[4:8] = False
    assert torch.equal(got_out[plain], with_tails[0].cpu()[plain])
    assert torch.equal(got_lse[plain], with_tails[1].cpu()[plain])
    assert torch.equal(got_lse[plain], lse_in.transpose(1, 2).reshape(tokens, heads)[plain])
    assert bool((got_out[4:8] == 0).all()) and bool((got_lse[4:8] == float("-inf")).all())
    assert bool(torch.isnan(got_out[9:11].float()).all() and torch.isnan(got_lse[9:11]).all())


@runs_where_triton_cannot
def test_interpreter_runs_triton_path_tests():
    """Every CI run: the triton_path tests under Triton's interpreter."""
    run_triton_path_tests(__file__)
