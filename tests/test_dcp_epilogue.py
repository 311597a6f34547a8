# SPDX-License-Identifier: Apache-2.0
"""The row-masked DCP combine against vLLM's per-request-masked one."""

from __future__ import annotations

from types import SimpleNamespace
from unittest import mock

import torch

from tests.support.dense_reference import KV_LORA_RANK, full_attention, random_decode_batch
from vllm.v1.attention.backends.mla.dcp_epilogue import (
    mask_empty_rows_,
    route_combine_through_rows,
)
from vllm.v1.attention.ops import dcp_decode
from vllm.v1.attention.ops.dcp_decode import DCPLayout
from vllm.v1.attention.ops.dcp import _lse_weighted_combine, mask_dcp_empty_shards_
from tools.dcp_simulated_ranks import shard_paged_kv


def _partials(batch, world_size, interleave, *, causal):
    """Each rank's (out, lse, rows, local per-request lens), with finite
    garbage where the kernel's result is undefined (no local KV for the row)."""
    shards = shard_paged_kv(batch.kv_cache, batch.block_table, batch.seq_lens,
                            layout=DCPLayout(world_size, interleave=interleave))
    result = []
    for rank, (cache, table) in enumerate(shards):
        rows = dcp_decode.build_flat_decode(
            batch.seq_lens, batch.query_start_loc, table,
            layout=DCPLayout(world_size, rank, interleave), causal=causal)
        out, lse = dcp_decode.mla_decode_reference(
            batch.q, cache, rows.block_table, rows.seq_lens,
            kv_lora_rank=KV_LORA_RANK, scale=batch.scale)
        out[rows.empty] = 7.0
        lse[rows.empty] = 0.0
        local = DCPLayout(world_size, rank, interleave).local_seq_lens(
            batch.seq_lens)
        result.append((out, lse, rows, local))
    return result


def test_rows_mask_catches_what_the_request_mask_misses():
    # seq 5 with a 4-token verify block on W = 4: token 0 sees 2 tokens, so
    # rank 3 holds nothing for tokens 0 and 1 but 1 token of the request.
    batch = random_decode_batch([5], [4], block_size=16, seed=0)
    (_, _, _, (out, lse, rows, local)) = _partials(batch, 4, 1, causal=True)
    assert local.tolist() == [1] and rows.empty.tolist() == [True, True, False, False]
    upstream_lse = lse.clone()
    mask_dcp_empty_shards_(upstream_lse, local, batch.query_start_loc)
    assert torch.all(upstream_lse[:2] == 0), "vLLM's mask leaves these rows in"
    mask_empty_rows_(out, lse, rows)
    assert torch.all(lse[:2] == float("-inf")) and torch.all(out[:2] == 0)
    assert torch.isfinite(lse[2:]).all()


def test_row_masked_combine_equals_full_attention_and_vllm_where_right():
    batch = random_decode_batch([5, 37, 3, 130], [4, 4, 2, 4], block_size=16, seed=1)
    ref_out, ref_lse = full_attention(batch, causal=True)
    parts = _partials(batch, 4, 1, causal=True)
    upstream_outs, upstream_lses, outs, lses = [], [], [], []
    blind = torch.zeros(ref_out.shape[0], dtype=torch.bool)
    for out, lse, rows, local in parts:
        up_lse = lse.clone()
        mask_dcp_empty_shards_(up_lse, local, batch.query_start_loc)
        blind |= rows.empty & (up_lse[:, 0] != float("-inf"))
        upstream_outs.append(out.clone())
        upstream_lses.append(up_lse)
        mask_empty_rows_(out, lse, rows)
        outs.append(out)
        lses.append(lse)
    ours, our_lse = _lse_weighted_combine(torch.stack(outs), torch.stack(lses),
                                          return_lse=True, is_lse_base_on_e=True)
    torch.testing.assert_close(ours, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(our_lse, ref_lse, atol=1e-5, rtol=1e-5)
    theirs, their_lse = _lse_weighted_combine(
        torch.stack(upstream_outs), torch.stack(upstream_lses), return_lse=True,
        is_lse_base_on_e=True)
    assert blind.any(), "the case must hit vLLM's blind spot"
    assert not torch.allclose(theirs[blind], ref_out[blind], atol=1e-3)
    torch.testing.assert_close(ours[~blind], theirs[~blind], atol=1e-6, rtol=1e-6)


def test_mask_covers_padding_rows_past_the_metadata():
    rows = dcp_decode.build_flat_decode(
        torch.tensor([9], dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32),
        torch.ones(1, 1, dtype=torch.int32), layout=DCPLayout(2, 1, 1),
        causal=True)
    out = torch.randn(4, 2, 3)
    lse = torch.randn(4, 2)
    mask_empty_rows_(out, lse, rows)
    assert torch.isfinite(lse[:2]).all()
    assert torch.all(lse[2:] == float("-inf")) and torch.all(out[2:] == 0)


def test_layer_combine_drops_the_per_layer_mask_once():
    collective = mock.Mock(return_value="merged")
    layer = SimpleNamespace(dcp_manager=SimpleNamespace(combine=collective))
    route_combine_through_rows(layer)
    route_combine_through_rows(layer)  # idempotent: wrapped once
    out, lse = torch.zeros(2, 1, 1), torch.zeros(2, 1)
    assert layer.dcp_manager.combine(out, lse, seq_lens=torch.ones(1),
                                     query_start_loc=torch.zeros(2)) == "merged"
    collective.assert_called_once_with(out, lse)
