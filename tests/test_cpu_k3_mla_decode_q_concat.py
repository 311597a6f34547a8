# SPDX-License-Identifier: Apache-2.0
"""The torch K3 MLA decode epilogue (``cpu_k3_mla_decode_q_concat``).

Checked against a reference built from other code: vLLM's own GPT-J rotary
embedding (``RotaryEmbedding.forward_native`` with ``is_neox_style=False``),
a per-token loop for the cache insert, and the DCP layout of
``cpu_dcp_slot_mapping`` for which rank stores which token. Also driven the
way the DSpark draft calls it: through vLLM's wrapper
``fused_mla_decode_q_concat_kv_cache_insert`` and ``torch.ops._C``, after the
CPU MRV2 plugin registered the op.
"""

from __future__ import annotations

import pytest
import torch

from vllm.v1.attention.ops.cpu_dcp_slot_mapping import dcp_slot_mapping
from vllm.v1.attention.ops.dcp_decode import DCPLayout
from vllm.v1.attention.ops.cpu_k3_mla_decode_q_concat import (
    decode_q_concat_kv_cache_insert,
)

LORA, ROPE, HEADS, BLOCK = 32, 16, 3, 4


def vllm_gptj_rope(max_position: int = 512):
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):
        return get_rope(ROPE, max_position=max_position,
                        rope_parameters={"rope_type": "default",
                                         "rope_theta": 10000.0},
                        is_neox_style=False, dtype=torch.float32)


def make_inputs(num_tokens: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return dict(
        ql_nope=torch.randn(num_tokens, HEADS, LORA, generator=gen),
        q_pe=torch.randn(num_tokens, HEADS, ROPE, generator=gen),
        kv_c_normed=torch.randn(num_tokens, LORA, generator=gen),
        k_pe=torch.randn(num_tokens, 1, ROPE, generator=gen),
    )


def reference(inputs, positions, slots, cache, rope):
    """mqa_q and the cache after the insert, token by token."""
    q_pe, k_pe = inputs["q_pe"].clone(), inputs["k_pe"].reshape(len(positions), 1, ROPE).clone()
    if rope is not None:
        q_pe, k_pe = rope.forward_native(positions, q_pe, k_pe)
    mqa_q = torch.cat([inputs["ql_nope"], q_pe], dim=-1)
    cache = cache.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            cache[slot // BLOCK, slot % BLOCK] = torch.cat(
                [inputs["kv_c_normed"][t], k_pe[t, 0]])
    return mqa_q, cache


def dcp_slots(positions, world, rank, interleave, block_table):
    """This rank's slots of one decode request's new tokens (-1: not ours)."""
    slots = torch.full((len(positions),), 777, dtype=torch.int64)
    qsl = torch.tensor([0, len(positions)], dtype=torch.int32)
    dcp_slot_mapping(qsl, positions, block_table, slots, num_tokens=len(positions),
                     max_num_tokens=len(positions), block_size=BLOCK,
                     layout=DCPLayout(world, rank, interleave))
    return slots


@pytest.mark.parametrize("world,rank,interleave", [(1, 0, 1), (2, 0, 1), (2, 1, 1),
                                                   (2, 1, 2), (4, 2, 1)])
@pytest.mark.parametrize("with_rope", [True, False])
def test_matches_reference_on_dcp_local_slots(world, rank, interleave, with_rope):
    num_tokens = 9  # crosses cache blocks and interleave spans
    positions = torch.arange(21, 21 + num_tokens)
    block_table = torch.tensor([[5, 2, 9, 7, 3, 8, 1, 4]], dtype=torch.int32)
    slots = dcp_slots(positions, world, rank, interleave, block_table)
    if world > 1:
        assert 0 < int((slots >= 0).sum()) < num_tokens  # some tokens elsewhere
    inputs = make_inputs(num_tokens, seed=world * 10 + rank)
    cache = torch.randn(10, BLOCK, LORA + ROPE)
    rope = vllm_gptj_rope() if with_rope else None
    want_q, want_cache = reference(inputs, positions, slots, cache, rope)

    got_cache = cache.clone()
    got_q = torch.empty(num_tokens, HEADS, LORA + ROPE)
    decode_q_concat_kv_cache_insert(
        inputs["ql_nope"], inputs["q_pe"], inputs["kv_c_normed"], inputs["k_pe"],
        got_q, got_cache, slots, BLOCK,
        positions if with_rope else None,
        rope.cos_sin_cache if with_rope else None)
    torch.testing.assert_close(got_q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_cache, want_cache, rtol=1e-5, atol=1e-5)
    # Tokens another rank owns leave this rank's cache untouched.
    touched = (got_cache != cache).any(-1).nonzero().tolist()
    owned = {(s // BLOCK, s % BLOCK) for s in slots.tolist() if s >= 0}
    assert {tuple(x) for x in touched} == owned


def test_registered_op_through_vllms_wrapper():
    """The plugin's op registration, called as vLLM's K3 MLA does."""
    from vllm.models.kimi_k3.nvidia.ops.fused_mla_key_concat_kv_cache import (
        fused_mla_decode_q_concat_kv_cache_insert,
    )
    from vllm.v1.worker.cpu.dcp_mrv2_overrides import install_q_concat_op

    install_q_concat_op()
    assert hasattr(torch.ops._C, "fused_kimi_k3_mla_decode_q_concat_kv_cache_insert")
    num_tokens = 6
    positions = torch.arange(3, 3 + num_tokens)
    slots = torch.tensor([9, -1, 10, 11, -1, 4])
    inputs = make_inputs(num_tokens, seed=5)
    cache = torch.zeros(4, BLOCK, LORA + ROPE)
    rope = vllm_gptj_rope()
    want_q, want_cache = reference(inputs, positions, slots, cache, rope)
    got_cache = cache.clone()
    got_q = fused_mla_decode_q_concat_kv_cache_insert(
        inputs["ql_nope"], inputs["q_pe"], inputs["kv_c_normed"], inputs["k_pe"],
        got_cache, slots, positions=positions, cos_sin_cache=rope.cos_sin_cache)
    torch.testing.assert_close(got_q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_cache, want_cache, rtol=1e-5, atol=1e-5)
