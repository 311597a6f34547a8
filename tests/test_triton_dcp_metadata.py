# SPDX-License-Identifier: Apache-2.0
"""Triton DCP metadata builders against the torch reference (bit-equal).

GPU tests skip without CUDA. The grouped-rows torch reference is also checked
on the CPU against a plain-Python construction.
"""

from __future__ import annotations

import pytest
import torch

FLAT_FIELDS = ("seq_lens", "query_start_loc", "row_to_req", "global_seq_lens",
               "empty")
GROUP_FIELDS = ("seq_lens", "query_start_loc", "row_to_req", "empty",
                "num_groups", "block_table")

from vllm.v1.attention.ops import dcp_decode as dcp
from vllm.v1.attention.ops.dcp_decode import DCPLayout

try:
    from vllm.v1.attention.ops import triton_dcp_metadata as tdm
except ImportError as e:  # no triton on this machine
    tdm = None
    _why = str(e)

needs_triton = pytest.mark.skipif(tdm is None, reason="triton not importable")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs CUDA")


def random_batch(gen: torch.Generator, device: str = "cpu"):
    num_reqs = int(torch.randint(1, 12, (), generator=gen))
    q_lens = torch.randint(0, 9, (num_reqs,), generator=gen)
    q_lens[torch.rand(num_reqs, generator=gen) < 0.2] = 0
    qsl = torch.zeros(num_reqs + 1, dtype=torch.int32)
    qsl[1:] = q_lens.cumsum(0)
    seq_lens = (q_lens + torch.randint(0, 300, (num_reqs,), generator=gen))
    num_cols = int(torch.randint(1, 9, (), generator=gen))
    table = torch.randint(1, 10_000, (num_reqs, num_cols), dtype=torch.int32,
                          generator=gen)
    return (seq_lens.int().to(device), qsl.to(device), table.to(device))


def _poisoned_flat(rows: int, cols: int, device: str):
    out = dcp.alloc_flat_decode(rows, cols, device)
    for name in ("seq_lens", "query_start_loc", "block_table", "row_to_req",
                 "global_seq_lens"):
        getattr(out, name).fill_(-7)
    out.empty.fill_(True)
    return out


@needs_triton
@needs_cuda
@pytest.mark.parametrize("seed", range(40))
def test_flat_triton_bit_equal(seed):
    gen = torch.Generator().manual_seed(seed)
    seq_lens, qsl, table = random_batch(gen, "cuda")
    world = [1, 2, 4, 8][seed % 4]
    interleave = [1, 16, 64, 3][(seed // 4) % 4]
    rank = int(torch.randint(0, world, (), generator=gen))
    causal = seed % 2 == 0
    num_rows = int(qsl[-1]) + int(torch.randint(0, 6, (), generator=gen))
    kw = dict(layout=DCPLayout(world, rank, interleave), causal=causal,
              num_rows=num_rows)
    ref = dcp.build_flat_decode(seq_lens, qsl, table, **kw)
    cols = table.shape[1]
    out = _poisoned_flat(num_rows + 5, cols + 3, "cuda")
    got = tdm.build_flat_decode_triton(seq_lens, qsl, table, **kw, out=out)
    for name in FLAT_FIELDS:
        assert torch.equal(getattr(ref, name), getattr(got, name)), name
    assert torch.equal(ref.block_table, got.block_table[:, :cols])
    # Columns past B and rows past N are left alone.
    assert bool((out.block_table[:num_rows, cols:] == -7).all())
    assert bool((out.seq_lens[num_rows:] == -7).all())


@needs_triton
@needs_cuda
def test_flat_triton_cuda_graph_replay():
    gen = torch.Generator().manual_seed(123)
    seq_lens, qsl, table = random_batch(gen, "cuda")
    num_rows = 96
    out = _poisoned_flat(num_rows, table.shape[1], "cuda")
    kw = dict(layout=DCPLayout(4, 1, 16), causal=True, num_rows=num_rows)
    tdm.build_flat_decode_triton(seq_lens, qsl, table, **kw, out=out)  # warm
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tdm.build_flat_decode_triton(seq_lens, qsl, table, **kw, out=out)
    # New inputs in the same memory, replay, compare.
    seq_lens.add_(37)
    out.seq_lens.fill_(-7)
    graph.replay()
    torch.cuda.synchronize()
    ref = dcp.build_flat_decode(seq_lens, qsl, table, **kw)
    assert torch.equal(ref.seq_lens, out.seq_lens[:num_rows])
    assert torch.equal(ref.global_seq_lens, out.global_seq_lens[:num_rows])


def _grouped_python(flat, qsl, table):
    """Independent construction of the grouped rows (plain Python)."""
    num_tokens = min(int(qsl[-1]), flat.num_rows)
    lens = flat.seq_lens.tolist()
    reqs = flat.row_to_req.tolist()
    groups = []  # (first token, local len, req)
    for t in range(num_tokens):
        if groups and reqs[t] == groups[-1][2] and lens[t] == groups[-1][1]:
            continue
        groups.append((t, lens[t], reqs[t]))
    return groups, num_tokens


@needs_triton
@pytest.mark.parametrize("seed", range(20))
def test_grouped_reference_matches_python(seed):
    gen = torch.Generator().manual_seed(1000 + seed)
    seq_lens, qsl, table = random_batch(gen)
    world, interleave = [(2, 1), (4, 16), (8, 1), (1, 1)][seed % 4]
    num_rows = int(qsl[-1]) + 3
    flat = dcp.build_flat_decode(seq_lens, qsl, table,
                                 layout=DCPLayout(world, seed % world, interleave),
                                 causal=seed % 2 == 0, num_rows=num_rows)
    grouped = tdm.build_grouped_decode_reference(flat, qsl, table)
    groups, num_tokens = _grouped_python(flat, qsl, table)
    count = len(groups)
    assert int(grouped.num_groups) == count
    assert grouped.query_start_loc[:count].tolist() == [g[0] for g in groups]
    assert bool((grouped.query_start_loc[count:] == num_tokens).all())
    assert grouped.seq_lens[:count].tolist() == [g[1] for g in groups]
    assert grouped.row_to_req[:count].tolist() == [g[2] for g in groups]
    assert bool((grouped.seq_lens[count:] == 0).all())
    assert torch.equal(grouped.empty, grouped.seq_lens == 0)
    # Non-causal: exactly one group per request with tokens.
    if seed % 2 == 1:
        assert count == int((qsl[1:] > qsl[:-1]).sum())
    # Local bounds step by 0 or 1 within a request (the premise of grouping).
    for a, b in zip(groups, groups[1:]):
        if a[2] == b[2]:
            assert b[1] == a[1] + 1


@needs_triton
@needs_cuda
@pytest.mark.parametrize("seed", range(20))
def test_grouped_triton_bit_equal(seed):
    gen = torch.Generator().manual_seed(2000 + seed)
    seq_lens, qsl, table = random_batch(gen, "cuda")
    world, interleave = [(2, 1), (4, 16), (8, 1), (8, 64)][seed % 4]
    num_rows = int(qsl[-1]) + seed % 4
    flat = tdm.build_flat_decode_triton(
        seq_lens, qsl, table, layout=DCPLayout(world, seed % world, interleave),
        causal=seed % 2 == 0, num_rows=num_rows)
    ref = tdm.build_grouped_decode_reference(flat, qsl, table)
    out = tdm.alloc_grouped_decode(num_rows + 2, table.shape[1], "cuda")
    for name in ("seq_lens", "query_start_loc", "block_table", "row_to_req",
                 "num_groups"):
        getattr(out, name).fill_(-7)
    got = tdm.build_grouped_decode(flat, qsl, table, out=out)
    for name in GROUP_FIELDS:
        assert torch.equal(getattr(ref, name), getattr(got, name)), name
