# SPDX-License-Identifier: Apache-2.0
"""FA3 MLA with its plan made on the device (``flashinfer_sm90_device_plan``).

CPU-safe. ``tests.support.fa3_plan_interpreter.run_plan`` executes a plan's
arrays as FlashInfer's sm90 MLA kernel does (works into partials, merges by
LSE), in float64. The planner's launch (Triton) rewrites a template plan for
each prefix length L; the ``triton_path`` tests run it directly on CUDA or
under ``TRITON_INTERPRET=1`` (``test_interpreter_runs_triton_path_tests``
runs them in a subprocess on every CI run) and check:

- a template with FlashInfer's layout, rewritten for L from 0 keys to at
  most 2500 (the float64 reference's time; chunks empty and cut short, and
  all used on 24 SMs, where 2500 reaches the template's length), executed,
  equals float64 attention over each request's first L keys (R 1 and 2, 96
  and 128 heads, a small SM count and an H100's 132);
- FlashInfer's own plans recorded on an H100 (``tests/data/
  fa3_plans_h100.json``: the template FlashInfer made, and its host plans
  at several L): the device plan of the recorded template has the same
  non-empty works as FlashInfer's host plan at every recorded L, and
  executed at L = 2048 equals float64 attention.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.support.fa3_plan_interpreter import run_plan, uniform_template
from tests.support.triton_interpreted import (DEVICE, needs_triton,
                                              run_triton_path_tests,
                                              runs_where_triton_cannot)
from vllm.v1.attention.ops import flashinfer_sm90_device_plan as dp

DV, DR, PAGE = 512, 64, 64
RECORDED = Path(__file__).parent / "data" / "fa3_plans_h100.json"


@pytest.fixture(autouse=True)
def _one_thread():
    """The float64 executor and references are many small ops: one CPU
    thread runs them 3-10x faster than two contending on a loaded machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _workspace(arrays: dict) -> torch.Tensor:
    """An int32 workspace holding ``arrays`` at their offsets (as FlashInfer's)."""
    size = max(at + len(arrays[name]) for name, at in arrays["offsets"].items()) + 16
    words = torch.full((size,), -99, dtype=torch.int32)
    for name, at in arrays["offsets"].items():
        words[at:at + len(arrays[name])] = torch.tensor(arrays[name], dtype=torch.int32)
    return words.to(DEVICE)


def _table(num_reqs, num_cols, pages, gen) -> torch.Tensor:
    """int32 [R, num_cols]: distinct pages 1.. for each request's first
    ``pages`` columns (the ones read), page 0 after them."""
    table = torch.zeros(num_reqs, num_cols, dtype=torch.int32)
    table[:, :pages] = (torch.randperm(num_reqs * pages, generator=gen) + 1).view(
        num_reqs, pages)
    return table


def _device_plan(arrays, template, lens, table, *, q_len, page_stride):
    """``plan_works`` for per-request prefixes ``lens``; the rewritten arrays,
    the rows' prefixes and the page list, on the host."""
    num_reqs = len(lens)
    row_lens = torch.tensor([n for n in lens for _ in range(q_len)],
                            dtype=torch.int32, device=DEVICE)
    words = _workspace(arrays)
    before = words.cpu().clone()  # .cpu() of a CPU tensor is itself
    row_prefix = torch.full((num_reqs * q_len,), -1, dtype=torch.int32, device=DEVICE)
    kv_indices = torch.full((num_reqs * page_stride,), -1, dtype=torch.int32,
                            device=DEVICE)
    i32 = dict(dtype=torch.int32, device=DEVICE)
    dp.plan_works(template, row_lens, table.to(DEVICE), words,
                  torch.tensor(template.work_req, **i32),
                  torch.tensor(template.work_chunk, **i32), row_prefix, kv_indices,
                  q_len=q_len, page_stride=page_stride)
    words = words.cpu()
    # The launch writes only the works' three key fields in FlashInfer's
    # workspace (its merge arrays, indptrs and the rest stay the template's)
    # and only the block table's columns of each request's page slots.
    rewritten = torch.zeros_like(before, dtype=torch.bool)
    for at in (template.kv_len_at, template.kv_start_at, template.kv_end_at):
        rewritten[at:at + template.num_works] = True
    assert torch.equal(words[~rewritten], before[~rewritten]), "a stray workspace write"
    unread = kv_indices.cpu().view(num_reqs, page_stride)[:, table.shape[1]:]
    assert (unread == -1).all(), "a page slot past the block table written"
    planned = dict(arrays)
    for name, at in (("kv_len", template.kv_len_at), ("kv_start", template.kv_start_at),
                     ("kv_end", template.kv_end_at)):
        planned[name] = words[at:at + template.num_works].tolist()
    return planned, row_prefix.cpu(), kv_indices.cpu()


def _check_against_dense(planned, kv_indices, lens, *, q_len, heads, page_stride,
                         gen) -> None:
    """Execute ``planned`` and compare every row with float64 attention over
    its request's first L keys (out 0 / lse -inf where L is 0)."""
    num_reqs = len(lens)
    pages = -(-max(max(lens), 1) // PAGE)
    kv_cache = torch.randn(int(kv_indices.max()) + 1, PAGE, DV + DR, generator=gen,
                           dtype=torch.float64)
    q = torch.randn(num_reqs * q_len, heads, DV + DR, generator=gen, dtype=torch.float64)
    scale = 1.0 / math.sqrt(DV + DR)
    out, lse = run_plan(planned, q, kv_cache, kv_indices, num_heads=heads,
                        page_size=PAGE, sm_scale=scale)
    for req, n in enumerate(lens):
        rows = slice(req * q_len, (req + 1) * q_len)
        if n == 0:
            assert (out[rows] == 0).all() and (lse[rows] == -math.inf).all(), req
            continue
        ids = kv_indices[req * page_stride:][:pages].long()
        keys = kv_cache[ids].reshape(-1, DV + DR)[:n]
        scores = torch.einsum("thd,kd->thk", q[rows], keys) * scale
        ref_lse = torch.logsumexp(scores, -1) / math.log(2.0)
        ref_out = torch.softmax(scores, -1) @ keys[:, :DV]
        torch.testing.assert_close(out[rows], ref_out, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(lse[rows], ref_lse, rtol=1e-9, atol=1e-9)


def test_no_prefix_needs_more_chunks_than_the_template_has():
    """What the device plan relies on: FlashInfer's chunk for any L cuts it
    into at most the template's chunks, and the template reaches them."""
    for clusters in (6, 57, 66):
        for tiles in range(1, 2 * clusters):
            most = -(-clusters // tiles)
            kv_len = dp.template_kv_len(tiles, clusters)
            assert -(-kv_len // dp.fa3_chunk_keys(kv_len, tiles, clusters)) == most
            for n in list(range(0, 3000, 7)) + [kv_len, 7 * kv_len + 5, 1 << 20]:
                assert -(-n // dp.fa3_chunk_keys(n, tiles, clusters)) <= most


def test_template_check_refuses_another_structure():
    arrays, kv_len = uniform_template(1, 4, 96, 132, page_stride=128)
    args = dict(num_reqs=1, q_len=4, num_heads=96, page_stride=128, kv_len=kv_len,
                tiles=3, clusters=66)
    template = dp.FA3WorkTemplate.from_plan(arrays, **args)
    assert (template.num_chunks, template.num_works) == (22, 66)
    for field, value in (("kv_len", kv_len - 1), ("kv_end", 1), ("kv_indptr", 5)):
        bad = {**arrays, field: [value] + arrays[field][1:]}
        with pytest.raises(ValueError, match="host plan"):
            dp.FA3WorkTemplate.from_plan(bad, **args)
    missing = {name: (values[1:] if isinstance(values, list)
                      and len(values) == template.num_works else values)
               for name, values in arrays.items()}
    with pytest.raises(ValueError, match="host plan"):
        dp.FA3WorkTemplate.from_plan(missing, **args)
    with pytest.raises(ValueError, match="grid"):
        dp.FA3WorkTemplate.from_plan({**arrays, "grid": [1, 66]}, **args)


def test_plan_refuses_buffers_of_another_batch():
    """One program per block-table row writes that request's rows and pages:
    a table of more requests than the template's would write past them."""
    arrays, kv_len = uniform_template(1, 4, 96, 132, page_stride=128)
    template = dp.FA3WorkTemplate.from_plan(
        arrays, num_reqs=1, q_len=4, num_heads=96, page_stride=128, kv_len=kv_len,
        tiles=3, clusters=66)
    i32 = dict(dtype=torch.int32)
    buffers = dict(row_lens=torch.zeros(8, **i32), block_table=torch.zeros(2, 16, **i32),
                   int_workspace=torch.zeros(1 << 16, **i32),
                   work_req=torch.zeros(66, **i32), work_chunk=torch.zeros(66, **i32),
                   row_prefix=torch.zeros(8, **i32), kv_indices=torch.zeros(256, **i32))
    with pytest.raises(ValueError, match="1 requests x 4 rows given a block table of 2"):
        dp.plan_works(template, **buffers, q_len=4, page_stride=128)


@needs_triton
@pytest.mark.parametrize("num_reqs,heads,num_sms", [
    (2, 128, 24), (1, 96, 132)])
def test_triton_path_device_plan_matches_dense_attention(num_reqs, heads, num_sms):
    q_len = 4
    gen = torch.Generator().manual_seed(num_reqs * heads + num_sms)
    arrays, kv_len = uniform_template(num_reqs, q_len, heads, num_sms, page_stride=0)
    page_stride = -(-kv_len // PAGE)
    arrays, kv_len = uniform_template(num_reqs, q_len, heads, num_sms,
                                      page_stride=page_stride)
    tiles, clusters = dp.fa3_layout(num_reqs, q_len, heads, num_sms)
    template = dp.FA3WorkTemplate.from_plan(
        arrays, num_reqs=num_reqs, q_len=q_len, num_heads=heads, page_stride=page_stride,
        kv_len=kv_len, tiles=tiles, clusters=clusters)
    # Keys bounded for the float64 reference's time: every chunk is used at
    # the template on 24 SMs (and in FlashInfer's recorded plans at 16K+).
    longest = min(kv_len, 2500)
    cases = [[0] * num_reqs, [longest] * num_reqs, [100, 0][:num_reqs],
             [longest - 17, 200][:num_reqs]]
    for lens in cases:
        table = _table(num_reqs, page_stride, -(-longest // PAGE), gen)
        planned, row_prefix, kv_indices = _device_plan(
            arrays, template, lens, table, q_len=q_len, page_stride=page_stride)
        assert row_prefix.tolist() == [n for n in lens for _ in range(q_len)]
        assert kv_indices.view(num_reqs, page_stride).tolist() == table.tolist()
        chunk = {n: dp.fa3_chunk_keys(n, tiles, clusters) for n in lens}
        for w, (req, c) in enumerate(zip(template.work_req, template.work_chunk)):
            n = lens[req]
            start = c * chunk[n]
            want = (start, min(start + chunk[n], n)) if start < n else (0, 0)
            assert (planned["kv_start"][w], planned["kv_end"][w]) == want, (lens, w)
            assert planned["kv_len"][w] == n
        _check_against_dense(planned, kv_indices, lens, q_len=q_len, heads=heads,
                             page_stride=page_stride, gen=gen)


def _recorded():
    if not RECORDED.exists():
        pytest.skip(f"{RECORDED.name} not recorded yet")
    return json.loads(RECORDED.read_text())


@needs_triton
def test_triton_path_device_plan_equals_flashinfers_host_plan():
    """FlashInfer's template and host plans, recorded on an H100: the device
    plan of the template at L has FlashInfer's own works at L (the empty
    ones aside; where FlashInfer cut fewer chunks its partial and merge
    offsets differ, so only the key ranges are compared), and executes to
    float64 attention."""
    gen = torch.Generator().manual_seed(7)
    record = _recorded()
    checked = 0
    for case in record["cases"]:
        arrays = case["template"]
        args = {k: case[k] for k in ("num_reqs", "q_len", "num_heads", "page_stride")}
        tiles, clusters = dp.fa3_layout(case["num_reqs"], case["q_len"],
                                        case["num_heads"], record["num_sms"])
        template = dp.FA3WorkTemplate.from_plan(
            arrays, **args, kv_len=case["template_kv_len"], tiles=tiles,
            clusters=clusters)
        q_len, page_stride = case["q_len"], case["page_stride"]
        for host in case["host_plans"]:
            lens = [host["kv_len"]] * case["num_reqs"]
            table = _table(case["num_reqs"], page_stride,
                           -(-min(host["kv_len"], 2048) // PAGE), gen)
            planned, _, kv_indices = _device_plan(arrays, template, lens, table,
                                                  q_len=q_len, page_stride=page_stride)

            def works(a):
                return sorted((a["q_indptr"][w], a["q_start"][w], a["kv_start"][w],
                               a["kv_end"][w], a["kv_len"][w])
                              for w in range(len(a["q_indptr"]))
                              if a["kv_end"][w] > a["kv_start"][w] or lens[0] == 0)

            ours = works(planned)
            theirs = works(host["arrays"])
            if lens[0] == 0:  # FlashInfer: one empty work per tile; ours: all
                ours = sorted(set(ours))
                theirs = sorted(set(theirs))
            assert ours == theirs, (case["num_heads"], host["kv_len"])
            if host["kv_len"] == 2048:
                _check_against_dense(planned, kv_indices, lens, q_len=q_len,
                                     heads=case["num_heads"], page_stride=page_stride,
                                     gen=gen)
            checked += 1
    assert checked >= 8


@runs_where_triton_cannot
def test_interpreter_runs_triton_path_tests():
    """Every CI run: the triton_path tests under Triton's interpreter."""
    run_triton_path_tests(__file__)
