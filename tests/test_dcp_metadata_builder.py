# SPDX-License-Identifier: Apache-2.0
"""DCPDecodeBuilderMixin through vLLM 0.32.0's real MLA metadata builder."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

from builder_harness import common_metadata, fake_dcp_group, make_builder, make_vllm_config
from dense_reference import KV_LORA_RANK, full_attention, random_decode_batch
from vllm.model_executor.layers.attention.mla_attention import (
    MLACommonDecodeMetadata,
    MLACommonMetadataBuilder,
    QueryLenSupport,
)
from vllm.v1.attention.backends.mla.dcp_metadata import (
    DCPDecodeBuilderMixin,
    DCPDecodeMetadata,
)
from vllm.v1.attention.ops import dcp_decode


class VarlenDCPBuilder(DCPDecodeBuilderMixin, MLACommonMetadataBuilder):
    query_len_support: ClassVar[QueryLenSupport] = QueryLenSupport.VARLEN
    supports_non_causal_multi_token_decode: ClassVar[bool] = True
    supports_non_causal_multi_token_dcp: ClassVar[bool] = True


def _builder(tmp_path, world_size, rank, interleave, *, non_causal=False, layers=1):
    config = make_vllm_config(tmp_path / "model", dcp=world_size,
                              interleave=interleave, num_speculative_tokens=7)
    names = tuple(f"model.layers.{i}.self_attn.attn" for i in range(layers))
    with fake_dcp_group(world_size, rank):
        return make_builder(VarlenDCPBuilder, config, layer_names=names,
                            non_causal=non_causal, supports_dcp_with_varlen=True)


@pytest.mark.parametrize("world_size", [2, 4, 8])
@pytest.mark.parametrize("interleave", [1, 16])
@pytest.mark.parametrize("causal", [True, False])
def test_builder_rows_give_full_attention(tmp_path, world_size, interleave, causal):
    query_lens = [4, 1, 8, 3] if causal else [7, 7, 7, 0]
    seq_lens = [37, 5, 300, 18] if causal else [37, 7, 300, 18]
    batch = random_decode_batch(seq_lens, query_lens, block_size=16, seed=world_size)
    ref_out, ref_lse = full_attention(batch, causal=causal)
    shards = dcp_decode.shard_paged_kv(batch.kv_cache, batch.block_table,
                                       batch.seq_lens, world_size=world_size,
                                       interleave=interleave)
    outs, lses = [], []
    for rank, (cache, table) in enumerate(shards):
        builder = _builder(tmp_path, world_size, rank, interleave,
                           non_causal=not causal)
        assert builder.dcp_rank == rank and builder.dcp_world_size == world_size
        common = common_metadata(seq_lens, query_lens, table, world_size=world_size,
                                 rank=rank, interleave=interleave, causal=causal)
        metadata = builder.build(0, common)
        decode = metadata.decode
        assert isinstance(decode, DCPDecodeMetadata)
        assert decode.causal is causal and decode.dcp_rank == rank
        assert metadata.num_prefills == 0
        expected = dcp_decode.build_flat_decode(
            batch.seq_lens, batch.query_start_loc, table, world_size=world_size,
            rank=rank, interleave=interleave, causal=causal)
        for field in ("seq_lens", "row_to_req", "global_seq_lens", "empty",
                      "query_start_loc", "block_table"):
            assert torch.equal(getattr(decode.flat, field), getattr(expected, field))
        out, lse = dcp_decode.mla_decode_reference(
            batch.q, cache, decode.flat.block_table, decode.flat.seq_lens,
            kv_lora_rank=KV_LORA_RANK, scale=batch.scale)
        outs.append(out)
        lses.append(lse)
    out, lse = dcp_decode.merge_partials(torch.stack(outs), torch.stack(lses))
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layers", [1, 24])
def test_rows_built_once_per_forward(tmp_path, monkeypatch, layers):
    builder = _builder(tmp_path, 4, 1, 1, layers=layers)
    calls = []
    real_build = dcp_decode.build_flat_decode
    monkeypatch.setattr(dcp_decode, "build_flat_decode",
                        lambda *a, **k: calls.append(1) or real_build(*a, **k))
    table = torch.arange(1, 13, dtype=torch.int32).view(3, 4)
    common = common_metadata([40, 9, 60], [4, 4, 4], table, world_size=4, rank=1,
                             interleave=1)
    first = builder.build(0, common)
    # Every layer of the group reads this one object: nothing more is built.
    seen = {id(first.decode) for _ in range(layers)}
    assert len(seen) == 1 and len(calls) == 1
    second = builder.build(0, common)
    assert len(calls) == 2
    # Persistent buffers: the next forward writes into the same memory.
    assert second.decode.flat.seq_lens.data_ptr() == first.decode.flat.seq_lens.data_ptr()


def test_dcp1_keeps_upstream_metadata(tmp_path):
    builder = _builder(tmp_path, 1, 0, 1)
    table = torch.arange(1, 5, dtype=torch.int32).view(2, 2)
    common = common_metadata([20, 9], [3, 3], table, world_size=1, rank=0,
                             interleave=1)
    decode = builder.build(0, common).decode
    assert type(decode) is MLACommonDecodeMetadata
