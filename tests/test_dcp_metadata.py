# SPDX-License-Identifier: Apache-2.0
"""DCPDecodeBuilderMixin through vLLM 0.32.0's real MLA metadata builder."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

from tests.support.builder_harness import (attention_group, common_metadata, fake_dcp_group,
                                           layer_batches, make_builder, make_vllm_config,
                                           shard_layers, step_metadata)
from tests.support.dense_reference import KV_LORA_RANK, full_attention, random_decode_batch
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
from vllm.v1.attention.ops.dcp_decode import DCPLayout
from tools.dcp_simulated_ranks import decode_on_simulated_ranks


class VarlenDCPBuilder(DCPDecodeBuilderMixin, MLACommonMetadataBuilder):
    query_len_support: ClassVar[QueryLenSupport] = QueryLenSupport.VARLEN
    supports_non_causal_multi_token_decode: ClassVar[bool] = True
    supports_non_causal_multi_token_dcp: ClassVar[bool] = True

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device,
                         supports_dcp_with_varlen=True)


class VarlenDCPBackend:
    """Just what vLLM's ``AttentionGroup`` asks of a backend here."""

    kernel_block_sizes: ClassVar[list[int]] = [16]

    @classmethod
    def get_builder_cls(cls):
        return VarlenDCPBuilder

    @classmethod
    def get_supported_kernel_block_sizes(cls, spec=None):
        return cls.kernel_block_sizes


class WidthProbeBuilder(VarlenDCPBuilder):
    """Asks vLLM for the block-table width it will hand this builder
    (``requires_block_table_width``), the oracle for the buffer columns."""

    requires_block_table_width: ClassVar[bool] = True

    def __init__(self, *args, block_table_width: int):
        self.vllm_block_table_width = block_table_width
        super().__init__(*args)


def _builder(tmp_path, world_size, rank, interleave, *, non_causal=False, layers=1):
    config = make_vllm_config(tmp_path / "model", dcp=world_size,
                              interleave=interleave, num_speculative_tokens=7)
    names = tuple(f"model.layers.{i}.self_attn.attn" for i in range(layers))
    with fake_dcp_group(world_size, rank):
        return make_builder(VarlenDCPBuilder, config, layer_names=names,
                            non_causal=non_causal)


@pytest.mark.parametrize("world_size", [2, 4, 8])
@pytest.mark.parametrize("interleave", [1, 16])
@pytest.mark.parametrize("causal", [True, False])
def test_builder_rows_give_full_attention(tmp_path, world_size, interleave, causal):
    query_lens = [4, 1, 8, 3] if causal else [7, 7, 7, 0]
    seq_lens = [37, 5, 300, 18] if causal else [37, 7, 300, 18]
    batch = random_decode_batch(seq_lens, query_lens, block_size=16, seed=world_size)
    ref_out, ref_lse = full_attention(batch, causal=causal)

    def decode_rank(layout, cache, table):
        rank = layout.rank
        builder = _builder(tmp_path, world_size, rank, interleave,
                           non_causal=not causal)
        assert builder.dcp_setting.dcp_rank == rank and builder.dcp_world_size == world_size
        common = common_metadata(seq_lens, query_lens, table, world_size=world_size,
                                 rank=rank, interleave=interleave, causal=causal)
        metadata = builder.build(0, common)
        decode = metadata.decode
        assert isinstance(decode, DCPDecodeMetadata)
        assert decode.causal is causal
        assert decode.layout == DCPLayout(world_size, rank, interleave)
        assert metadata.num_prefills == 0
        expected = dcp_decode.build_flat_decode(
            batch.seq_lens, batch.query_start_loc, table,
            layout=DCPLayout(world_size, rank, interleave), causal=causal)
        for field in ("seq_lens", "row_to_req", "empty", "block_table"):
            assert torch.equal(getattr(decode.flat, field), getattr(expected, field))
        return dcp_decode.mla_decode_reference(
            batch.q, cache, decode.flat.block_table, decode.flat.seq_lens,
            kv_lora_rank=KV_LORA_RANK, scale=batch.scale)

    out, lse = decode_on_simulated_ranks(batch.kv_cache, batch.block_table,
                                         batch.seq_lens, decode_rank,
                                         layout=DCPLayout(world_size,
                                                          interleave=interleave))
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


# Two forwards of different batches: other row counts, bounds and tables.
STEPS = [([40, 9, 60], [4, 4, 4]), ([13, 70], [2, 5])]


@pytest.mark.parametrize("layers", [2, 24])
def test_one_row_build_per_forward_each_layer_its_own_data(tmp_path, monkeypatch,
                                                           layers):
    """vLLM's flow: ``build_attn_metadata`` builds once per KV-cache group and
    forward and hands that object to every layer. Each layer attends with
    its own q and KV over the rows it received, for two forwards: a layer
    reading the previous forward's rows, or rows built more than once per
    forward, fails."""
    world_size, interleave = 4, 1
    config = make_vllm_config(tmp_path / "model", dcp=world_size,
                              interleave=interleave, num_speculative_tokens=7)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    builds = []
    real_build = dcp_decode.build_flat_decode
    monkeypatch.setattr(dcp_decode, "build_flat_decode",
                        lambda *a, **k: builds.append(1) or real_build(*a, **k))
    inputs = []
    for step, (seq_lens, query_lens) in enumerate(STEPS):
        batches = layer_batches(seq_lens, query_lens, num_layers=layers,
                                seed=10 * step, block_size=16, num_heads=4)
        inputs.append((batches, shard_layers(batches, world_size, interleave)))
    partials = [[([], []) for _ in names] for _ in STEPS]
    for rank in range(world_size):
        with fake_dcp_group(world_size, rank):
            group = attention_group(VarlenDCPBackend, config, names)
        builder = group.get_metadata_builder(0)
        for step, ((seq_lens, query_lens), (batches, shards)) in enumerate(
                zip(STEPS, inputs)):
            common = common_metadata(seq_lens, query_lens, shards[0][rank][1],
                                     world_size=world_size, rank=rank,
                                     interleave=interleave)
            builds.clear()
            metadata = step_metadata(group, common)
            assert len(builds) == 1, "one row build per forward, not per layer"
            for name, batch, layer_shards, (outs, lses) in zip(
                    names, batches, shards, partials[step]):
                rows = metadata[name].decode.flat
                # The forward's rows live in the persistent buffers.
                assert rows.seq_lens.data_ptr() == builder._dcp_rows.seq_lens.data_ptr()
                out, lse = dcp_decode.mla_decode_reference(
                    batch.q, layer_shards[rank][0], rows.block_table, rows.seq_lens,
                    kv_lora_rank=KV_LORA_RANK, scale=batch.scale)
                outs.append(out)
                lses.append(lse)
    for (batches, _), step_partials in zip(inputs, partials):
        for batch, (outs, lses) in zip(batches, step_partials):
            out, lse = dcp_decode.merge_partials(torch.stack(outs), torch.stack(lses))
            ref_out, ref_lse = full_attention(batch, causal=True)
            torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "world_size,block_size,kernel_block_size,max_model_len,capture", [
        (2, 16, None, 4096, None),
        (4, 64, None, 2800, None),  # 128-token alignment: 11 blocks -> 12
        (8, 16, None, 2900, 300),   # 23 blocks -> 24; graphs pad decodes to 300
        (4, 64, 32, 4096, None),    # the backend pages finer than the group
    ])
def test_row_buffers_sized_once_from_vllm_bounds(tmp_path, world_size, block_size,
                                                 kernel_block_size, max_model_len,
                                                 capture):
    config = make_vllm_config(tmp_path / "model", dcp=world_size,
                              block_size=block_size, num_speculative_tokens=3,
                              max_model_len=max_model_len)
    config.compilation_config.max_cudagraph_capture_size = capture

    class Backend(VarlenDCPBackend):
        kernel_block_sizes = [kernel_block_size or block_size]

        @classmethod
        def get_builder_cls(cls):
            return WidthProbeBuilder

    with fake_dcp_group(world_size, 1):
        group = attention_group(Backend, config, ["model.layers.0.self_attn.attn"],
                                kernel_block_size=kernel_block_size)
    builder = group.get_metadata_builder(0)
    sched = config.scheduler_config
    decode_tokens = min(sched.max_num_batched_tokens, sched.max_num_seqs * (1 + 3))
    capture = config.compilation_config.max_cudagraph_capture_size or 0
    rows = builder._dcp_rows
    assert rows is not None, "allocated at builder init, not at the first build"
    assert rows.num_rows == max(decode_tokens, capture)
    assert rows.block_table.shape == (rows.num_rows, builder.vllm_block_table_width)
    pointers = {name: getattr(rows, name).data_ptr() for name in (
        "seq_lens", "block_table", "row_to_req", "empty")}

    def build(num_reqs, query_len, num_cols):
        table = torch.ones(num_reqs, num_cols, dtype=torch.int32)
        common = common_metadata([200] * num_reqs, [query_len] * num_reqs, table,
                                 world_size=world_size, rank=1, interleave=1)
        with fake_dcp_group(world_size, 1):
            return builder.build(0, common)

    # Batches up to both bounds reuse the same memory.
    full_width = builder.vllm_block_table_width
    build(3, 4, 5)
    metadata = build(sched.max_num_seqs, 4, full_width)
    assert metadata.decode.flat.num_rows == sched.max_num_seqs * 4
    build(1, 1, full_width)
    for name, pointer in pointers.items():
        assert getattr(builder._dcp_rows, name).data_ptr() == pointer, name
    # Beyond them: a clear error, never a fresh tensor.
    with pytest.raises(ValueError, match="max-model-len"):
        build(2, 4, full_width + 1)
    over = rows.num_rows // 4 + 1
    with pytest.raises(ValueError, match="max-num-seqs"):
        build(over, 4, 5)
    assert builder._dcp_rows is rows


def test_dcp1_keeps_upstream_metadata(tmp_path):
    builder = _builder(tmp_path, 1, 0, 1)
    table = torch.arange(1, 5, dtype=torch.int32).view(2, 2)
    common = common_metadata([20, 9], [3, 3], table, world_size=1, rank=0,
                             interleave=1)
    decode = builder.build(0, common).decode
    assert type(decode) is MLACommonDecodeMetadata
    assert builder._dcp_rows is None  # no DCP buffers: upstream memory use
