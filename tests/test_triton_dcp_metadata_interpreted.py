# SPDX-License-Identifier: Apache-2.0
"""The fused Triton metadata kernel, run by Triton's interpreter on CPU.

The GPU tests in ``test_triton_dcp_metadata.py`` need CUDA; this runs the same
kernel (``TRITON_INTERPRET=1``, in a subprocess) on every CI run and checks it
bit-equal to the torch path on random batches with padding rows, zero-length
requests, W 1/2/4/8 and I 1/16/64, writing into oversized persistent buffers.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

FIELDS = ("seq_lens", "block_table", "row_to_req", "empty")


def _compare_all() -> int:
    from vllm.v1.attention.ops import dcp_decode
    from vllm.v1.attention.ops.dcp_decode import DCPLayout
    from vllm.v1.attention.ops.triton_dcp_metadata import build_flat_decode_triton

    gen = torch.Generator().manual_seed(0)
    checked = 0
    for case in range(24):
        num_reqs = int(torch.randint(1, 8, (), generator=gen))
        query_lens = torch.randint(0, 9, (num_reqs,), generator=gen)
        # Every third case: short requests, some shorter than their query.
        low, high = (-9, 6) if case % 3 == 0 else (0, 300)
        seq_lens = (query_lens + torch.randint(low, high, (num_reqs,), generator=gen)
                    ).clamp(min=0).int()
        qsl = torch.zeros(num_reqs + 1, dtype=torch.int32)
        qsl[1:] = torch.cumsum(query_lens, 0)
        table = torch.randint(0, 99, (num_reqs, 7), dtype=torch.int32, generator=gen)
        world, interleave = (1, 2, 4, 8)[case % 4], (1, 16, 64)[case % 3]
        causal, num_rows = bool(case % 2), int(qsl[-1]) + 3
        for rank in range(world):
            args = dict(layout=DCPLayout(world, rank, interleave), causal=causal,
                        num_rows=num_rows)
            ref = dcp_decode.build_flat_decode(seq_lens, qsl, table, **args)
            buffers = dcp_decode.alloc_flat_decode(num_rows + 5, 9)
            for field in ("seq_lens", "row_to_req", "block_table"):
                getattr(buffers, field).fill_(-7)  # poison
            got = build_flat_decode_triton(seq_lens, qsl, table, out=buffers, **args)
            for field in FIELDS:
                assert torch.equal(getattr(ref, field), getattr(got, field)), (
                    case, rank, field)
            assert (got.seq_lens >= 0).all()
            checked += 1
    checked += _check_short_requests(build_flat_decode_triton)
    return checked


def _check_short_requests(build) -> int:
    """seq 0 / q_len 4 and seq 2 / q_len 4: bounds clamp at 0, rows empty."""
    from vllm.v1.attention.ops.dcp_decode import DCPLayout

    seq_lens = torch.tensor([0, 2], dtype=torch.int32)
    qsl = torch.tensor([0, 4, 8], dtype=torch.int32)
    table = torch.arange(1, 5, dtype=torch.int32).view(2, 2)
    for causal in (True, False):
        expected = [0, 0, 0, 0, 0, 0, 1, 2] if causal else [0] * 4 + [2] * 4
        whole = build(seq_lens, qsl, table, layout=DCPLayout(), causal=causal,
                      num_rows=8)
        assert whole.seq_lens.tolist() == expected, causal
        for rank in (0, 1):
            got = build(seq_lens, qsl, table, layout=DCPLayout(2, rank, 1),
                        causal=causal, num_rows=8)
            local = [(g // 2) + min(max(g % 2 - rank, 0), 1) for g in expected]
            assert got.seq_lens.tolist() == local, (causal, rank)
            assert got.empty.tolist() == [n == 0 for n in local], (causal, rank)
    return 1


def test_triton_kernel_bit_equal_to_torch_path():
    # TRITON_INTERPRET is read when Triton is imported: a fresh interpreter
    # runs this file's checks.
    code = ("import runpy; print('checked', runpy.run_path(%r)['_compare_all']())"
            % __file__)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(os.environ, TRITON_INTERPRET="1"), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert int(proc.stdout.split("checked")[-1]) >= 24
