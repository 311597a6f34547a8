# SPDX-License-Identifier: Apache-2.0
"""FlashInfer-MLA and Tokenspeed DCP backends on CPU, kernels stood in by
reference adapters bound to the installed kernels' signatures.

For simulated W in {2, 4, 8}, the way Model Runner V2 drives them: each
rank's builder is made by vLLM's ``AttentionGroup.create_metadata_builders``
and run by vLLM's ``build_attn_metadata`` once per forward, which hands the
one metadata object to every layer; the real impl's ``forward_mqa`` runs each
layer on its own q and KV, over two forwards of different batches, and every
layer's merged partials equal full attention over that layer's inputs
(``tests/support/dense_reference.py``). The flattened rows are counted: one build
per forward and rank, whatever the number of layers.
"""

from __future__ import annotations

import contextlib
import math
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from tests.support.builder_harness import (attention_group, common_metadata,
                                           expected_local_row_lens, fake_dcp_group, make_mla_impl,
                                           make_vllm_config, shard_layers, step_metadata)
from tests.support.builder_harness import layer_batches as harness_layer_batches
from tests.support.dense_reference import full_attention
from tests.support.kernel_stubs import TokenspeedMLAReference, TrtllmMLAReference, import_on_cpu
from vllm.v1.attention.ops import dcp_decode

import importlib.util

if not (importlib.util.find_spec("flashinfer") and importlib.util.find_spec("tokenspeed_mla")):
    pytest.skip("flashinfer-python and tokenspeed-mla are needed for the kernel "
                "contracts (bash .ci/install installs them)", allow_module_level=True)


NUM_HEADS = 8
BLOCK_SIZE = 64
NUM_LAYERS = 3


class Backend:
    """What differs between the two backends under test."""

    def __init__(self, name):
        self.name = name
        if name == "FLASHINFER_MLA":
            self.module = import_on_cpu(
                "vllm.v1.attention.backends.mla.flashinfer_dcp_mla")
            self.backend = self.module.FlashInferDCPMLABackend
            self.kernel = TrtllmMLAReference()
            self.kernel_attr = "trtllm_batch_decode_with_kv_cache_mla"
            self.workspace_attr = "_get_workspace_buffer"
            self.dtype, self.kv_cache_dtype = torch.bfloat16, "auto"
        else:
            self.module = import_on_cpu(
                "vllm.v1.attention.backends.mla.tokenspeed_dcp_mla")
            self.backend = self.module.TokenspeedDCPMLABackend
            self.kernel = TokenspeedMLAReference()
            self.kernel_attr = None  # imported inside forward_mqa
            self.workspace_attr = "_get_workspace"
            self.dtype, self.kv_cache_dtype = torch.float8_e4m3fn, "fp8"

    def patches(self):
        stack = [
            mock.patch.object(self.module.checks, "current_gpu_major", return_value=10),
            mock.patch.object(self.module, self.workspace_attr,
                              lambda *a, **k: torch.empty(0, dtype=torch.int8)),
        ]
        if self.kernel_attr:
            stack.append(mock.patch.object(self.module, self.kernel_attr, self.kernel))
        else:
            stack.append(mock.patch("tokenspeed_mla.tokenspeed_mla_decode", self.kernel))
            stack.append(mock.patch("tokenspeed_mla.warmup_compile_prefill",
                                    lambda **kwargs: None))
        return stack


@pytest.fixture(params=["FLASHINFER_MLA", "TOKENSPEED_MLA"])
def backend(request):
    return Backend(request.param)


def _make_impl(backend, scale):
    return make_mla_impl(backend.backend.get_impl_cls(), num_heads=NUM_HEADS,
                         scale=scale, kv_cache_dtype=backend.kv_cache_dtype)


def _layer():
    upstream_combine = mock.Mock(name="upstream_combine")
    return SimpleNamespace(_q_scale_float=1.0, _k_scale_float=1.0,
                           dcp_manager=SimpleNamespace(combine=upstream_combine))


def layer_batches(seq_lens, query_lens, dtype, *, num_layers, seed):
    return harness_layer_batches(seq_lens, query_lens, num_layers=num_layers,
                                 seed=seed, block_size=BLOCK_SIZE,
                                 num_heads=NUM_HEADS, dtype=dtype)


def merge_ranks(impl, outs, lses):
    """vLLM's combine, ranks in one process; natural-log LSE returned."""
    out, lse = dcp_decode.merge_partials(torch.stack(outs), torch.stack(lses),
                                         lse_base_e=impl.lse_base_on_e)
    if not impl.lse_base_on_e:
        lse = lse * math.log(2.0)
    return out, lse


CASES = {  # (seq_lens, query_lens) per (causal, batch shape)
    (True, "uniform"): ([37, 4, 300, 18, 130], [4, 4, 4, 4, 4]),
    (False, "uniform"): ([37, 7, 300, 18, 130], [7, 7, 7, 7, 7]),
    # CUDA-graph padding: trailing zero-length requests.
    (True, "padded"): ([37, 4, 300, 0, 0], [4, 4, 4, 0, 0]),
    (False, "padded"): ([37, 7, 300, 0], [7, 7, 7, 0]),
    # Adaptive verification: ragged query lengths (FlashInfer is VARLEN).
    (True, "ragged"): ([37, 2, 300, 18, 130], [4, 1, 7, 3, 2]),
}


def next_step(seq_lens, query_lens):
    """The batch of the following forward: every request 5 tokens longer and
    one request more (the first padding slot filled, or appended) with the
    batch's query length, so a layer reading the previous forward's metadata
    gets fewer rows, other bounds and other block tables than it needs."""
    seq_lens = [s + 5 if q else 0 for s, q in zip(seq_lens, query_lens)]
    query_lens = list(query_lens)
    new_query_len = max(query_lens)
    if 0 in query_lens:
        slot = query_lens.index(0)
        seq_lens[slot], query_lens[slot] = 90, new_query_len
    else:
        seq_lens.append(90)
        query_lens.append(new_query_len)
    return seq_lens, query_lens


def run_steps(tmp_path, backend, steps, *, world_size, interleave, causal,
              dtype=None, seed=0, num_speculative_tokens=6):
    """Every rank runs ``steps`` forwards through vLLM's flow: one
    ``AttentionGroup`` (its builder made by ``create_metadata_builders``),
    per step ``build_attn_metadata`` hands one metadata object to every
    layer, each layer's ``forward_mqa`` runs on its own q and KV.

    Args:
        steps: list of ``(seq_lens, query_lens, common_kwargs)``; the kwargs
            go to ``common_metadata`` (host query lens, promised bound).

    Returns:
        ``[(layer_batches, merged [(out, lse natural log)] per layer,
        rows_built per rank)]`` per step.
    """
    from vllm.config import set_current_vllm_config

    dtype = dtype or backend.dtype
    layer_names = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
    config = make_vllm_config(tmp_path / "model", dcp=world_size, interleave=interleave,
                              block_size=BLOCK_SIZE,
                              num_speculative_tokens=num_speculative_tokens)
    config.cache_config.cache_dtype = backend.kv_cache_dtype
    step_inputs = []
    for i, (seq_lens, query_lens, _) in enumerate(steps):
        batches = layer_batches(seq_lens, query_lens, dtype, num_layers=NUM_LAYERS,
                                seed=seed + 10 * i)
        step_inputs.append((batches, shard_layers(batches, world_size, interleave)))
    partials = [[([], []) for _ in layer_names] for _ in steps]
    rows_built = [[] for _ in steps]
    real_build = dcp_decode.build_flat_decode
    for rank in range(world_size):
        with fake_dcp_group(world_size, rank), set_current_vllm_config(config), \
                contextlib.ExitStack() as stack:
            for patch in backend.patches():
                stack.enter_context(patch)
            builds = []
            stack.enter_context(mock.patch.object(
                dcp_decode, "build_flat_decode",
                lambda *a, **k: builds.append(1) or real_build(*a, **k)))
            group = attention_group(backend.backend, config, layer_names,
                                    non_causal=not causal)
            # Every layer's combine skips vLLM's per-layer mask from the
            # builder's creation on, before any forward.
            context = config.compilation_config.static_forward_context
            for name in layer_names:
                manager = context[name].dcp_manager
                assert manager.combine_masked_by_rows
                assert manager.combine.__wrapped__ is not None
            impl = _make_impl(backend, step_inputs[0][0][0].scale)
            assert impl.dcp_world_size == world_size and impl.dcp_rank == rank
            layers = [_layer() for _ in layer_names]
            for step, ((seq_lens, query_lens, kwargs), (batches, shards)) in \
                    enumerate(zip(steps, step_inputs)):
                table = shards[0][rank][1]
                common = common_metadata(seq_lens, query_lens, table,
                                         world_size=world_size, rank=rank,
                                         interleave=interleave, causal=causal,
                                         **kwargs)
                builds.clear()
                metadata = step_metadata(group, common)
                # The rows against vLLM's own layout helper, not the ops layer.
                rows = metadata[layer_names[0]].decode.flat
                expected = expected_local_row_lens(
                    seq_lens, query_lens, world_size=world_size, rank=rank,
                    interleave=interleave, causal=causal)
                assert torch.equal(rows.seq_lens[:len(expected)], expected)
                for name, layer, batch, layer_shards, (outs, lses) in zip(
                        layer_names, layers, batches, shards, partials[step]):
                    out, lse = impl.forward_mqa(
                        batch.q.to(backend.dtype),
                        layer_shards[rank][0].to(backend.dtype), metadata[name], layer)
                    # A forward rebinds no combine (routed once, above).
                    assert not hasattr(layer.dcp_manager, "combine_masked_by_rows")
                    outs.append(out.float())
                    lses.append(lse)
                rows_built[step].append(len(builds))
    results = []
    for step, (batches, _) in enumerate(step_inputs):
        merged = [merge_ranks(impl, outs, lses) for outs, lses in partials[step]]
        results.append((batches, merged, rows_built[step]))
    return results


def assert_matches_full_attention(batch, out, lse, *, causal, atol, lse_atol):
    ref_out, ref_lse = full_attention(batch, causal=causal)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref_out, atol=atol, rtol=atol)
    torch.testing.assert_close(lse, ref_lse, atol=lse_atol, rtol=lse_atol)


# Output tolerance per kernel dtype: the reference sees the same rounded
# inputs, so what is left is the kernel's output cast (bf16 for fp8).
OUT_ATOL = {torch.bfloat16: 2e-2, torch.float8_e4m3fn: 2e-2}


@pytest.mark.parametrize("world_size", [2, 4, 8])
@pytest.mark.parametrize("interleave", [1, 16])
@pytest.mark.parametrize("causal,shape", sorted(CASES))
def test_forward_mqa_merges_to_full_attention(tmp_path, backend, world_size,
                                              interleave, causal, shape):
    """Two forwards of three layers, each layer its own q and KV: every
    layer's merged output equals full attention over its own inputs, and the
    rows are built once per forward (a per-layer rebuild or a layer reading
    the previous forward's metadata fails)."""
    seq_lens, query_lens = CASES[causal, shape]
    steps = [(seq_lens, query_lens, {}),
             (*next_step(seq_lens, query_lens), {})]
    results = run_steps(tmp_path, backend, steps, world_size=world_size,
                        interleave=interleave, causal=causal, seed=world_size)
    for batches, merged, rows_built in results:
        assert rows_built == [1] * world_size, "one row build per forward and rank"
        for batch, (out, lse) in zip(batches, merged):
            assert_matches_full_attention(batch, out, lse, causal=causal,
                                          atol=OUT_ATOL[backend.dtype],
                                          lse_atol=1e-4)


# The sm90 path (builder plans FA3 once per forward, layers only run) is
# tested with the real adapter in test_flashinfer_dcp_mla.py.


def test_plugin_registers_the_dcp_backends():
    from importlib.metadata import entry_points

    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    (plugin,) = [ep for ep in entry_points(group="vllm.general_plugins")
                 if ep.name == "dcp_dspark"]
    plugin.load()()
    paths = {name: AttentionBackendEnum[name].get_path()
             for name in ("FLASHINFER_MLA", "TOKENSPEED_MLA")}
    assert paths == {
        "FLASHINFER_MLA": backend_path("flashinfer_dcp_mla", "FlashInferDCPMLABackend"),
        "TOKENSPEED_MLA": backend_path("tokenspeed_dcp_mla", "TokenspeedDCPMLABackend"),
    }
    fi = Backend("FLASHINFER_MLA").backend
    ts = Backend("TOKENSPEED_MLA").backend
    from vllm.platforms.interface import DeviceCapability

    # sm90 only under DCP (at DCP size 1 Hopper keeps upstream's choice).
    with mock.patch("vllm.v1.attention.backends.mla.flashinfer_dcp_mla."
                    "current_dcp_size", return_value=8):
        assert fi.supports_compute_capability(DeviceCapability(9, 0))
    assert not fi.supports_compute_capability(DeviceCapability(9, 0))
    assert fi.supports_compute_capability(DeviceCapability(10, 0))
    assert not fi.supports_compute_capability(DeviceCapability(8, 0))
    assert not ts.supports_compute_capability(DeviceCapability(9, 0))
    for cls in (fi.get_builder_cls(), ts.get_builder_cls()):
        assert cls.supports_non_causal_multi_token_decode
        assert cls.supports_non_causal_multi_token_dcp
    from vllm.v1.attention.backend import AttentionCGSupport

    builder = fi.get_builder_cls()
    checks = Backend("FLASHINFER_MLA").module.checks
    for major, support in ((9, AttentionCGSupport.NEVER), (10, AttentionCGSupport.ALWAYS)):
        with mock.patch.object(checks, "current_gpu_major", return_value=major):
            assert builder.get_cudagraph_support(None, None) == support


def backend_path(module, cls):
    return f"vllm.v1.attention.backends.mla.{module}.{cls}"
