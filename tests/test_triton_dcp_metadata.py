# SPDX-License-Identifier: Apache-2.0
"""The Triton DCP row builder against the torch reference (bit-equal).

GPU tests skip without CUDA; ``test_triton_dcp_metadata_interpreted`` runs the
same kernel under Triton's interpreter on every CI run.
"""

from __future__ import annotations

import itertools

import pytest
import torch

FLAT_FIELDS = ("seq_lens", "row_to_req", "empty")

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
    for name in ("seq_lens", "block_table", "row_to_req"):
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
    assert torch.equal(ref.row_to_req, out.row_to_req[:num_rows])


@pytest.mark.parametrize("seed", range(20))
def test_local_bounds_step_by_0_or_1_within_a_request(seed):
    """The premise of the sm90 prefix+tail plan: a request's per-token local
    bounds never decrease and step by at most 1 (causal) or are equal
    (non-causal), so its first token's bound is a prefix every token sees and
    each tail holds at most q_len - 1 keys."""
    gen = torch.Generator().manual_seed(1000 + seed)
    seq_lens, qsl, table = random_batch(gen)
    world, interleave = [(2, 1), (4, 16), (8, 1), (1, 1), (2, 3)][seed % 5]
    num_rows = int(qsl[-1]) + 3
    for rank, causal in itertools.product(range(world), (True, False)):
        flat = dcp.build_flat_decode(seq_lens, qsl, table,
                                     layout=DCPLayout(world, rank, interleave),
                                     causal=causal, num_rows=num_rows)
        lens = flat.seq_lens.tolist()
        for start, end in zip(qsl[:-1].tolist(), qsl[1:].tolist()):
            steps = [b - a for a, b in zip(lens[start:end], lens[start + 1:end])]
            assert all(s in ((0, 1) if causal else (0,)) for s in steps), (
                rank, causal, steps)
