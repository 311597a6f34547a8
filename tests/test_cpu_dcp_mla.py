# SPDX-License-Identifier: Apache-2.0
"""The CPU DCP MLA backend and the CPU pieces the plugin installs.

Fast (no engine): W ranks run in one process against vLLM 0.32.0's real MLA
metadata builder with a faked DCP group, and vLLM's own combine entry point
(``correct_attn_out``) runs the plugin's CPU kernel.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from tests.support.builder_harness import (common_metadata, fake_dcp_group, make_builder,
                                           make_vllm_config)
from tests.support.dense_reference import (KV_LORA_RANK, ROPE_DIM, full_attention,
                                           random_decode_batch)
from vllm.v1.attention.backends.mla.cpu_dcp_mla import (
    CPUDCPMLABackend,
    CPUDCPMLAImpl,
    CPUDCPMLAMetadataBuilder,
)
from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl
from vllm.v1.attention.backends.mla.dcp_metadata import DCPDecodeMetadata
from vllm.v1.attention.backends.mla.dcp_plugin import register
from vllm.v1.attention.ops import dcp_decode
from vllm.v1.attention.ops.dcp_decode import DCPLayout
from tools.dcp_simulated_ranks import decode_on_simulated_ranks

NUM_HEADS = 4


@pytest.fixture(scope="module", autouse=True)
def plugin_installed():
    register()


@contextlib.contextmanager
def dcp_context(tmp_path, world_size, rank, interleave, num_spec=7):
    """A current vLLM config and DCP group as a worker of that rank sees them."""
    from vllm.config import set_current_vllm_config

    config = make_vllm_config(tmp_path / "model", dcp=world_size,
                              interleave=interleave, num_speculative_tokens=num_spec)
    group = SimpleNamespace(world_size=world_size, rank_in_group=rank)
    with (set_current_vllm_config(config),
          fake_dcp_group(world_size, rank),
          mock.patch("vllm.distributed.parallel_state._DCP",
                     group if world_size > 1 else None)):
        yield config


def make_impl(scale: float, impl_cls=CPUDCPMLAImpl):
    from vllm.v1.attention.backend import AttentionType

    return impl_cls(
        num_heads=NUM_HEADS, head_size=KV_LORA_RANK + ROPE_DIM, scale=scale,
        num_kv_heads=1, alibi_slopes=None, sliding_window=None,
        kv_cache_dtype="auto", logits_soft_cap=None,
        attn_type=AttentionType.DECODER, kv_sharing_target_layer_name=None,
        q_lora_rank=None, kv_lora_rank=KV_LORA_RANK, qk_nope_head_dim=128,
        qk_rope_head_dim=ROPE_DIM, qk_head_dim=128 + ROPE_DIM, v_head_dim=128,
        kv_b_proj=None)


def vllm_combine(outs, lses, base_e=True):
    """vLLM's all-gather/rescale/reduce path, ranks in one process: each rank
    rescales its output with ``correct_attn_out`` (the plugin's CPU kernel)
    and the reduce is a sum. ``outs`` [W, N, H, Dv], ``lses`` [W, N, H]."""
    from vllm.v1.attention.ops.dcp import correct_attn_out

    corrected = []
    for rank in range(outs.shape[0]):
        out_r, lse = correct_attn_out(outs[rank].clone(), lses.clone(), rank, None,
                                      is_lse_base_on_e=base_e)
        corrected.append(out_r)
    return torch.stack(corrected).sum(0), lse


def test_plugin_overrides_cpu_mla():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    assert AttentionBackendEnum.CPU_MLA.get_class() is CPUDCPMLABackend
    assert CPUDCPMLABackend.get_name() == "CPU_MLA"
    assert CPUDCPMLABackend.supports_dcp()
    assert CPUDCPMLABackend.get_builder_cls() is CPUDCPMLAMetadataBuilder


@pytest.mark.parametrize("world_size", [2, 4, 8])
@pytest.mark.parametrize("interleave", [1, 16])
def test_impl_keeps_dcp_group(tmp_path, world_size, interleave):
    with dcp_context(tmp_path, world_size, world_size - 1, interleave):
        impl = make_impl(0.1)
    assert impl.dcp_world_size == world_size
    assert impl.dcp_rank == world_size - 1
    assert impl.total_cp_world_size == world_size
    assert impl.total_cp_rank == world_size - 1
    assert impl.cp_kv_cache_interleave_size == interleave
    assert impl.need_to_return_lse_for_decode and impl.lse_base_on_e


def test_impl_differs_from_upstream_only_in_the_dcp_pin(tmp_path):
    """``CPUMLAImpl.__init__`` pins the DCP size and interleave to 1 (its
    kernel has no LSE); the subclass puts back exactly those, and its LSE
    request follows from its class flag: every other attribute is
    upstream's, so nothing else of the parent's ``__init__`` is undone."""
    with dcp_context(tmp_path, 4, 3, 16):
        ours, upstream = make_impl(0.1), make_impl(0.1, CPUMLAImpl)
    differs = {name for name in vars(upstream)
               if not _same(getattr(upstream, name), getattr(ours, name))}
    assert differs == {"dcp_world_size", "cp_kv_cache_interleave_size",
                       "need_to_return_lse_for_decode"}
    assert set(vars(ours)) == set(vars(upstream))
    assert (upstream.dcp_world_size, upstream.cp_kv_cache_interleave_size) == (1, 1)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    try:
        return bool(a == b)
    except Exception:
        return a is b


def test_dcp1_is_upstream(tmp_path):
    """DCP = 1: same attributes, same C++ kernel output, no LSE, and
    upstream's single-token decode classification in the builder."""
    batch = random_decode_batch([37, 5, 60], [1, 1, 1], block_size=16, seed=3)
    with dcp_context(tmp_path, 1, 0, 1):
        ours, upstream = make_impl(batch.scale), make_impl(batch.scale, CPUMLAImpl)
        builder = make_builder(CPUDCPMLAMetadataBuilder,
                               make_vllm_config(tmp_path / "m1", dcp=1,
                                                num_speculative_tokens=3))
    assert ours.dcp_world_size == upstream.dcp_world_size == 1
    assert not ours.need_to_return_lse_for_decode
    assert builder.reorder_batch_threshold == 1
    assert not builder.supports_non_causal_multi_token_decode
    common = common_metadata(batch.seq_lens.tolist(), [1, 1, 1], batch.block_table,
                             world_size=1, rank=0, interleave=1)
    metadata = builder.build(0, common)
    assert not isinstance(metadata.decode, DCPDecodeMetadata)
    cache = torch.nan_to_num(batch.kv_cache)
    out, lse = ours.forward_mqa(batch.q, cache, metadata, None)
    ref, ref_lse = upstream.forward_mqa(batch.q, cache, metadata, None)
    assert lse is None and ref_lse is None
    assert torch.equal(out, ref)


def test_dcp_decode_needs_rows_for_every_query_token(tmp_path):
    """Under DCP the impl decodes only on its builder's rows: other decode
    metadata, or fewer rows than query tokens, is an error, not a decode."""
    batch = random_decode_batch([37, 5], [2, 2], block_size=16, seed=4)
    with dcp_context(tmp_path, 2, 0, 1):
        impl = make_impl(batch.scale)
        builder = make_builder(CPUDCPMLAMetadataBuilder,
                               make_vllm_config(tmp_path / "m", dcp=2,
                                                num_speculative_tokens=3))
    common = common_metadata([37, 5], [2, 2], batch.block_table, world_size=2,
                             rank=0, interleave=1)
    metadata = builder.build(0, common)
    assert isinstance(metadata.decode, DCPDecodeMetadata)
    cache = torch.nan_to_num(batch.kv_cache)
    too_many = torch.cat([batch.q, batch.q[:1]])
    with pytest.raises(ValueError, match="5 decode query tokens but the metadata has 4"):
        impl.forward_mqa(too_many, cache, metadata, None)
    upstream_decode = SimpleNamespace(decode=SimpleNamespace())
    with pytest.raises(TypeError, match="CPUDCPMLAMetadataBuilder"):
        impl.forward_mqa(batch.q, cache, upstream_decode, None)


@pytest.mark.parametrize("world_size", [2, 4, 8])
@pytest.mark.parametrize("interleave", [1, 16])
@pytest.mark.parametrize("causal", [True, False])
def test_forward_mqa_and_combine_give_full_attention(tmp_path, world_size,
                                                     interleave, causal):
    query_lens = [4, 1, 8, 3] if causal else [7, 7, 7, 7]
    seq_lens = [37, 5, 140, 18] if causal else [37, 7, 140, 18]
    batch = random_decode_batch(seq_lens, query_lens, block_size=16,
                                num_heads=NUM_HEADS, seed=world_size + interleave)
    ref_out, ref_lse = full_attention(batch, causal=causal)

    def decode_rank(layout, cache, table):
        rank = layout.rank
        with dcp_context(tmp_path, world_size, rank, interleave):
            impl = make_impl(batch.scale)
            builder = make_builder(CPUDCPMLAMetadataBuilder,
                                   make_vllm_config(tmp_path / f"m{rank}",
                                                    dcp=world_size,
                                                    interleave=interleave,
                                                    num_speculative_tokens=7),
                                   non_causal=not causal)
        assert builder.reorder_batch_threshold == 8
        common = common_metadata(seq_lens, query_lens, table, world_size=world_size,
                                 rank=rank, interleave=interleave, causal=causal)
        metadata = builder.build(0, common)
        assert metadata.num_prefills == 0
        decode = metadata.decode
        assert isinstance(decode, DCPDecodeMetadata) and decode.causal is causal
        q = batch.q.split([KV_LORA_RANK, ROPE_DIM], dim=-1)  # the (nope, pe) form
        out, lse = impl.forward_mqa(q, cache, metadata, None)
        assert out.shape == (batch.q.shape[0], NUM_HEADS, KV_LORA_RANK)
        assert lse.dtype == torch.float32 and lse.shape == out.shape[:2]
        # Rows this rank holds nothing of must not enter the combine.
        assert torch.all(lse[decode.flat.empty] == float("-inf"))
        assert torch.isfinite(lse[~decode.flat.empty]).all()
        return out, lse

    out, lse = decode_on_simulated_ranks(batch.kv_cache, batch.block_table,
                                         batch.seq_lens, decode_rank,
                                         layout=DCPLayout(world_size,
                                                          interleave=interleave),
                                         merge=vllm_combine)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("base_e", [True, False])
def test_cpu_combine_matches_merge_partials_and_vllm_reference(base_e):
    from vllm.v1.attention.ops.dcp import _lse_weighted_combine

    gen = torch.Generator().manual_seed(0)
    world, rows, heads, dim = 4, 9, 3, 16
    outs = torch.randn(world, rows, heads, dim, generator=gen)
    lses = torch.randn(world, rows, heads, generator=gen) * 3
    lses[1, 0] = float("-inf")                      # one empty shard
    lses[2, 1] = float("nan")                       # garbage from an empty shard
    lses[3, 2] = float("inf")
    lses[:, 3] = float("-inf")                      # a row no rank holds
    outs[1, 0] = float("nan")                       # its output is undefined
    outs[:, 3] = float("nan")
    ours, our_lse = vllm_combine(outs, lses, base_e)
    merged, merged_lse = dcp_decode.merge_partials(outs, lses, lse_base_e=base_e)
    reference, reference_lse = _lse_weighted_combine(
        torch.nan_to_num(outs), lses, return_lse=True, is_lse_base_on_e=base_e)
    torch.testing.assert_close(ours, merged, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ours, reference, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(our_lse, merged_lse)
    torch.testing.assert_close(our_lse[:3], reference_lse[:3])
    assert torch.all(ours[3] == 0) and torch.all(our_lse[3] == float("-inf"))


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("interleave", [1, 4, 16])
def test_slot_mapping_owner_and_local_slot(world_size, interleave):
    """vLLM's own slot-mapping entry point on CPU, with the plugin's kernel:
    only the owner writes, at the slot of its local index."""
    from vllm.platforms import current_platform
    from vllm.v1.worker.block_table import _COMPUTE_SLOT_MAPPING_KERNEL

    current_platform.register_triton_kernel_overrides()
    block_size, max_blocks = 16, 8
    query_lens, starts = [5, 1, 40, 3], [0, 70, 17, 128]
    qsl = torch.tensor([0, 5, 6, 46, 49], dtype=torch.int32)
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, query_lens)])
    req = torch.repeat_interleave(torch.arange(4), torch.tensor(query_lens))
    table = (torch.randperm(4 * max_blocks, generator=torch.Generator().manual_seed(1))
             .view(4, max_blocks).to(torch.int32) + 1)
    owner, local = DCPLayout(world_size, 0, interleave).owner(positions)
    writers = torch.zeros_like(positions)
    for rank in range(world_size):
        slots = torch.full((64,), 7, dtype=torch.int64)
        _COMPUTE_SLOT_MAPPING_KERNEL(4, len(positions), 64, qsl, positions, table,
                                     table.stride(0), slots, block_size, world_size,
                                     rank, interleave)
        mine = owner == rank
        expected = (table[req, local // block_size].long() * block_size
                    + local % block_size)
        assert torch.equal(slots[:len(positions)][mine], expected[mine])
        assert torch.all(slots[:len(positions)][~mine] == -1)
        assert torch.all(slots[len(positions):] == -1)
        writers += mine
    assert torch.all(writers == 1)


def test_slot_mapping_without_dcp_is_upstream():
    from vllm.platforms import current_platform
    from vllm.v1.worker.block_table import _COMPUTE_SLOT_MAPPING_KERNEL

    current_platform.register_triton_kernel_overrides()
    qsl = torch.tensor([0, 3, 10], dtype=torch.int32)
    positions = torch.cat([torch.arange(20, 23), torch.arange(0, 7)])
    table = torch.arange(1, 17, dtype=torch.int32).view(2, 8)
    slots = torch.full((16,), 7, dtype=torch.int64)
    _COMPUTE_SLOT_MAPPING_KERNEL(2, 10, 16, qsl, positions, table, 8, slots, 16,
                                 1, 0, 1)
    expected = torch.cat([table[0, 1] * 16 + torch.arange(4, 7),
                          table[1, 0] * 16 + torch.arange(0, 7)])
    assert torch.equal(slots[:10], expected.long())
