# SPDX-License-Identifier: Apache-2.0
"""FLASHINFER_MLA's sm90 path the way vLLM drives it, on CPU.

vLLM 0.32's own ``VllmConfig``, ``CommonAttentionMetadata`` and the real
``FlashInferDCPMLAMetadataBuilder`` / ``FlashInferDCPMLAImpl``: the builder
plans FA3 prefix+tail once per forward from host data
(``seq_lens_cpu_upper_bound`` optimistic by up to what vLLM hands over under
async speculative decoding: k for the target, 2k for a draft), every
layer's ``forward_mqa`` only runs. FA3 is the stand-in of
``test_flashinfer_sm90_mla`` (honours the plan it is given, FlashInfer
0.7.4's planned-shape contract, CUDA-graph wrappers with reserved buffers);
the tail kernel is the real Triton one, so the ``triton_path`` tests run
under ``TRITON_INTERPRET=1`` (``test_interpreter_runs_triton_path_tests``
starts them in a subprocess on every CI run). The ranks' outputs, merged,
must equal ``dense_reference.full_attention``. The same builder on the
H200 with FlashInfer's FA3: ``tests/gpu/test_sm90_vllm_backend.py``.
"""

from __future__ import annotations

import contextlib
import sys
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from tests.support.builder_harness import (
    TINY_MLA_CONFIG, common_metadata, fake_dcp_group, make_builder, make_mla_impl,
    make_vllm_config)
from tests.support.dense_reference import full_attention, random_decode_batch
from tests.support.kernel_stubs import import_on_cpu
from tests.support.flashinfer_fa3_fake import FakeFA3Wrapper, fake_flashinfer_package
from tests.support.triton_interpreted import (
    needs_triton, run_triton_path_tests, runs_where_triton_cannot)
from vllm.v1.attention.ops.dcp_decode import DCPLayout
from tools.dcp_simulated_ranks import decode_on_simulated_ranks


# Query heads after vLLM's DCP query gather: the tiny model's 8 heads
# (TP = DCP, so every rank sees all of them).
NUM_HEADS = 8
BLOCK_SIZE = 16
NUM_LAYERS = 3
NUM_SPEC = 3
# A draft model's layers are numbered after the target model's.
TARGET_LAYERS = TINY_MLA_CONFIG["num_hidden_layers"]


@pytest.fixture
def sm90(monkeypatch):
    """The backend module as on an H200 (132 SMs), FA3 stood in by the
    plan-honouring fake."""
    module = import_on_cpu("vllm.v1.attention.backends.mla.flashinfer_dcp_mla")
    monkeypatch.setitem(sys.modules, "flashinfer.mla", fake_flashinfer_package().mla)
    monkeypatch.setattr(module.checks, "current_gpu_major", lambda: 9)
    monkeypatch.setattr(module, "_get_workspace_buffer",
                        lambda *a, **k: torch.empty(8, dtype=torch.uint8))
    FakeFA3Wrapper.calls = []
    return module


def _make_impl(module, scale):
    return make_mla_impl(module.FlashInferDCPMLAImpl, num_heads=NUM_HEADS, scale=scale)


def _layer():
    return SimpleNamespace(_q_scale_float=1.0, _k_scale_float=1.0,
                           dcp_manager=SimpleNamespace(combine=mock.Mock()))


CASES = {  # (seq_lens, query_lens): q_len <= 1 + NUM_SPEC
    # Uniform; short requests whose first tokens have no local prefix.
    "uniform": ([37, 4, 300, 18, 130], [4, 4, 4, 4, 4]),
    # CUDA-graph padding: trailing zero-length requests (padding rows).
    "padded": ([37, 4, 300, 0, 0], [4, 4, 4, 0, 0]),
    "ragged": ([37, 2, 300, 18, 130], [4, 1, 3, 2, 4]),
    # "uniform" 32 tokens later (one local page at DCP 2, block 16), but for
    # the request already at max_model_len's bound.
    "uniform_grown": ([69, 36, 300, 50, 162], [4, 4, 4, 4, 4]),
    # Lengths a few tokens short of a local page edge (16 local tokens) at
    # DCP 2 x interleave 1 and DCP 4 x interleave 16: a host length a few
    # tokens over reaches past the edge.
    "page_edges": ([61, 62, 78, 142, 206], [4, 4, 4, 4, 4]),
}


def _run_ranks(sm90, tmp_path, *, world, interleave, causal, shape, seed=0,
               kept=None, host_overcount=None):
    """Every rank: real builder + NUM_LAYERS forward_mqa calls; returns the
    merged (out, lse), the reference, the per-rank FA3 plan counts and the
    kernel objects each rank planned. ``kept``: a dict that keeps the config
    and each rank's builder for the next call (as vLLM keeps them across
    forwards); ``host_overcount``: the host lengths' excess over the exact
    ones (default: random, up to what vLLM hands over: NUM_SPEC per request
    for the causal target verify, 2 x NUM_SPEC for the non-causal DSpark
    draft, whose layers are numbered after the target's)."""
    seq_lens, query_lens = CASES[shape]
    batch = random_decode_batch(seq_lens, query_lens, block_size=BLOCK_SIZE,
                                num_heads=NUM_HEADS, seed=seed)
    batch.q = batch.q.bfloat16().float()
    null = batch.kv_cache[0].clone()
    batch.kv_cache = batch.kv_cache.bfloat16().float()
    batch.kv_cache[0] = null
    ref_out, ref_lse = full_attention(batch, causal=causal)
    kept = {} if kept is None else kept
    if "config" not in kept:
        kept["config"] = make_vllm_config(
            tmp_path / "model", dcp=world, interleave=interleave,
            block_size=BLOCK_SIZE, num_speculative_tokens=NUM_SPEC)
        kept["config"].model_config.dtype = torch.bfloat16
    config = kept["config"]
    first_layer = 0 if causal else TARGET_LAYERS  # the draft's come after
    layer_names = [f"model.layers.{first_layer + i}.self_attn.attn"
                   for i in range(NUM_LAYERS)]
    max_overcount = NUM_SPEC if causal else 2 * NUM_SPEC
    gen = torch.Generator().manual_seed(seed + 7)
    plans, planned = [], []

    def decode_rank(layout, cache, table):
        from vllm.config import set_current_vllm_config

        rank = layout.rank
        with fake_dcp_group(world, rank), set_current_vllm_config(config):
            if rank not in kept:
                kept[rank] = make_builder(sm90.FlashInferDCPMLAMetadataBuilder,
                                          config, layer_names=layer_names,
                                          non_causal=not causal)
            builder = kept[rank]
            impl = _make_impl(sm90, batch.scale)
            context = config.compilation_config.static_forward_context
            for name in layer_names:
                context[name].impl = impl
            common = common_metadata(seq_lens, query_lens, table, world_size=world,
                                     rank=rank, interleave=interleave, causal=causal)
            # Async spec decode: the host lengths assume every draft accepted.
            overcount = (torch.randint(0, max_overcount + 1, common.seq_lens.shape,
                                       generator=gen) if host_overcount is None
                         else host_overcount)
            common.seq_lens_cpu_upper_bound = (common.seq_lens + overcount).int()
            before = sum(c[0] == "plan" for c in FakeFA3Wrapper.calls)
            metadata = builder.build(0, common)
            q = batch.q.bfloat16()
            results = [impl.forward_mqa(q, cache.bfloat16(), metadata, _layer())
                       for _ in layer_names]
            plans.append(sum(c[0] == "plan" for c in FakeFA3Wrapper.calls) - before)
            kernel = metadata.decode.plan
            planned.append(type(kernel).__name__)
        for out, lse in results[1:]:
            assert torch.equal(out, results[0][0]) and torch.equal(lse, results[0][1])
        return results[0][0].float(), results[0][1]

    out, lse = decode_on_simulated_ranks(batch.kv_cache, batch.block_table,
                                         batch.seq_lens, decode_rank,
                                         layout=DCPLayout(world, interleave=interleave))
    real = int(batch.query_start_loc[-1])
    return out[:real], lse[:real], ref_out, ref_lse, plans, planned


@needs_triton
@pytest.mark.parametrize("world,interleave", [(2, 1), (4, 16)])
@pytest.mark.parametrize("causal,shape", [(True, "uniform"), (True, "padded"),
                                          (True, "ragged"), (False, "uniform"),
                                          (False, "padded")])
def test_triton_path_backend_merges_to_full_attention(sm90, tmp_path, world,
                                                      interleave, causal, shape):
    out, lse, ref_out, ref_lse, plans, planned = _run_ranks(
        sm90, tmp_path, world=world, interleave=interleave, causal=causal,
        shape=shape, seed=world)
    assert plans == [1] * world, "one FA3 plan per forward (in the builder)"
    assert planned == ["FlashInferSm90MLA"] * world
    torch.testing.assert_close(out, ref_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)


@needs_triton
def test_triton_path_builder_reuses_an_unchanged_fa3_schedule(sm90, tmp_path):
    """The real builders, kept across forwards as vLLM keeps them, on the FA3
    path: a forward at the same lengths with new pages, cache and queries
    reuses FlashInfer's plan on every rank; one whose requests grew by a
    local page plans again; each merges to full attention."""
    kept = {}
    for shape, seed, expected in (("uniform", 0, [1, 1]), ("uniform", 1, [0, 0]),
                                  ("uniform_grown", 2, [1, 1])):
        out, lse, ref_out, ref_lse, plans, _ = _run_ranks(
            sm90, tmp_path, world=2, interleave=1, causal=True, shape=shape,
            seed=seed, kept=kept, host_overcount=NUM_SPEC)
        assert plans == expected, (shape, seed, plans)
        torch.testing.assert_close(out, ref_out, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)


@needs_triton
@pytest.mark.parametrize("world,interleave", [(2, 1), (4, 16)])
def test_triton_path_draft_with_the_largest_async_host_overcount(sm90, tmp_path,
                                                                 world, interleave):
    """The DSpark draft's host lengths exceed the device's by up to 2k (k
    rejected in the previous async step, k in this one): at that over-count
    on every request the draft's FA3 prefixes still hold only keys every
    token sees, and the ranks merge to full attention."""
    out, lse, ref_out, ref_lse, _, _ = _run_ranks(
        sm90, tmp_path, world=world, interleave=interleave, causal=False,
        shape="page_edges", seed=5, host_overcount=2 * NUM_SPEC)
    torch.testing.assert_close(out, ref_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)


def test_sm90_host_slack_per_model(sm90, tmp_path):
    """k for the target's verify, 2k for a draft model's layers (numbered
    after the target's, or a non-causal drafter's attention config)."""
    config = make_vllm_config(tmp_path / "model", dcp=2, block_size=BLOCK_SIZE,
                              num_speculative_tokens=NUM_SPEC)
    cases = ((["model.layers.0.self_attn.attn"], False, NUM_SPEC),
             ([f"model.layers.{TARGET_LAYERS}.self_attn.attn"], False, 2 * NUM_SPEC),
             (["model.layers.0.self_attn.attn"], True, 2 * NUM_SPEC))
    for layer_names, non_causal_drafter, slack in cases:
        config.attention_config.use_non_causal = non_causal_drafter
        with fake_dcp_group(2, 0):
            builder = make_builder(sm90.FlashInferDCPMLAMetadataBuilder, config,
                                   layer_names=layer_names)
        assert builder.dcp_setting.host_length_slack == slack, (
            layer_names, non_causal_drafter)


GRAPH_NUM_SPEC = 4  # the k of the failing shapes (25/5, 12/3, ...)


def _capture_batch(num_tokens, num_reqs, query_len, *, num_cols, seed):
    """A FULL graph's batch of ``num_reqs`` padded requests: vLLM's capture
    dummy (every request ``query_len`` tokens, ``seed`` None) or a later
    replay (fewer real requests of random lengths, then zero-length ones,
    as Model Runner V2 pads a uniform decode batch)."""
    real = num_reqs if seed is None else max(num_reqs - 1, 1)
    gen = torch.Generator().manual_seed(seed or 0)
    seq_lens = ([query_len] * real if seed is None else
                (torch.randint(0, 900, (real,), generator=gen) + query_len).tolist())
    pad = num_reqs - real
    table = torch.randint(1, 99, (num_reqs, num_cols), generator=gen, dtype=torch.int32)
    return seq_lens + [0] * pad, [query_len] * real + [0] * pad, table, num_tokens


@pytest.mark.parametrize("role", ["target", "draft"])
def test_sm90_graph_wrappers_cover_every_shape_vllm_captures(sm90, tmp_path,
                                                             role):
    """Every FULL uniform-decode graph vLLM's own CudaGraphManager captures
    (its default sizes; the target verifies 1 + k tokens, the DSpark draft a
    k-token block) is planned on a FlashInfer CUDA-graph wrapper when vLLM
    builds it for capture, and every later batch replayed in that graph
    (fewer real requests, padded) plans on that same wrapper."""
    from vllm.config import set_current_vllm_config
    from tests.support.vllm_capture_shapes import full_decode_shapes

    draft = role == "draft"
    query_len = GRAPH_NUM_SPEC if draft else 1 + GRAPH_NUM_SPEC
    config = make_vllm_config(tmp_path / "model", dcp=2, block_size=BLOCK_SIZE,
                              num_speculative_tokens=GRAPH_NUM_SPEC)
    config.model_config.dtype = torch.bfloat16
    shapes = full_decode_shapes(config, query_len)
    # As DFlashSpeculator.attn_vllm_config gives the draft's builders.
    config.attention_config.use_non_causal = draft
    with fake_dcp_group(2, 0), set_current_vllm_config(config):
        builder = make_builder(sm90.FlashInferDCPMLAMetadataBuilder, config,
                               non_causal=draft)
        config.compilation_config.static_forward_context[
            "model.layers.0.attn"].impl = _make_impl(sm90, 0.0721)
        num_cols = builder._dcp_rows.block_table.shape[1]
        for num_tokens, num_reqs in shapes:
            wrappers = []
            for seed in (None, num_tokens):
                seq_lens, query_lens, table, padded = _capture_batch(
                    num_tokens, num_reqs, query_len, num_cols=num_cols, seed=seed)
                common = common_metadata(seq_lens, query_lens, table, world_size=2,
                                         rank=0, interleave=1, causal=not draft)
                common.num_actual_tokens = padded
                common.max_query_len = query_len
                metadata = (builder.build_for_cudagraph_capture(common) if seed is None
                            else builder.build(0, common))
                kernel = metadata.decode.plan
                wrappers.append(kernel._wrapper)
            assert wrappers[0] is not kernel._eager_wrapper, (role, num_tokens, num_reqs)
            assert wrappers[1] is wrappers[0], (role, num_tokens, num_reqs)


@contextlib.contextmanager
def _rank0_of_2(sm90, tmp_path):
    """Rank 0 of DCP 2 in vLLM's config context: the real builder, one layer's
    impl registered where the builder reads its scale, and a uniform batch's
    common metadata."""
    from vllm.config import set_current_vllm_config

    config = make_vllm_config(tmp_path / "model", dcp=2, block_size=BLOCK_SIZE,
                              num_speculative_tokens=NUM_SPEC)
    config.model_config.dtype = torch.bfloat16
    seq_lens, query_lens = CASES["uniform"]
    batch = random_decode_batch(seq_lens, query_lens, block_size=BLOCK_SIZE,
                                num_heads=NUM_HEADS)
    with fake_dcp_group(2, 0), set_current_vllm_config(config):
        builder = make_builder(sm90.FlashInferDCPMLAMetadataBuilder, config)
        impl = _make_impl(sm90, batch.scale)
        config.compilation_config.static_forward_context[
            "model.layers.0.attn"].impl = impl
        common = common_metadata(seq_lens, query_lens, batch.block_table,
                                 world_size=2, rank=0, interleave=1)
        yield builder, impl, batch, common


def test_sm90_refuses_to_capture_a_plain_wrapper_plan(sm90, tmp_path, monkeypatch):
    """A forward planned outside vLLM's capture build (so on FlashInfer's plain
    wrapper) is refused, loudly, if a CUDA graph captures it."""
    with _rank0_of_2(sm90, tmp_path) as (builder, impl, batch, common):
        metadata = builder.build(0, common)
        fa3 = sys.modules["vllm.v1.attention.ops.flashinfer_sm90_mla"]
        monkeypatch.setattr(fa3, "_capturing", lambda device: True)
        with pytest.raises(RuntimeError, match="plain wrapper"):
            impl.forward_mqa(batch.q.bfloat16(), batch.kv_cache.bfloat16(), metadata,
                             _layer())


def test_layer_refuses_a_forward_the_builder_did_not_plan(sm90, tmp_path):
    """The layers never plan: metadata of a build whose plan was replaced by a
    later build (a stale forward) is refused, loudly."""
    with _rank0_of_2(sm90, tmp_path) as (builder, impl, batch, common):
        first = builder.build(0, common)
        builder.build(0, common)
        with pytest.raises(RuntimeError, match="no plan for this forward"):
            impl.forward_mqa(batch.q.bfloat16(), batch.kv_cache.bfloat16(), first,
                             _layer())


def test_sm90_graph_support_and_host_offsets(sm90, tmp_path):
    """Full graphs for uniform batches at DCP > 1; at DCP 1 none (the backend
    is not selectable there); the host query offsets must match the device's
    (vLLM's adaptive verification then picks another backend)."""
    from vllm.v1.attention.backend import AttentionCGSupport

    builder_cls = sm90.FlashInferDCPMLAMetadataBuilder
    assert builder_cls.get_cudagraph_support(
        make_vllm_config(tmp_path / "a", dcp=2), None) == AttentionCGSupport.UNIFORM_BATCH
    assert builder_cls.get_cudagraph_support(
        make_vllm_config(tmp_path / "b", dcp=1), None) == AttentionCGSupport.NEVER
    assert not sm90.FlashInferDCPMLABackend.supports_device_cpu_query_lens_mismatch()


@runs_where_triton_cannot
def test_interpreter_runs_triton_path_tests():
    """Every CI run: the triton_path tests under Triton's interpreter."""
    run_triton_path_tests(__file__)
