# SPDX-License-Identifier: Apache-2.0
"""FlashInfer-MLA and Tokenspeed DCP backends on CPU, kernels stood in by
reference adapters bound to the installed kernels' signatures.

For simulated W in {2, 4, 8}: each rank's real builder fills the per-forward
metadata from vLLM's ``CommonAttentionMetadata``, the real impl's
``forward_mqa`` runs every layer of a multi-layer forward on that one
metadata object, and the ranks' partials merge to full attention.
"""

from __future__ import annotations

from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from builder_harness import common_metadata, fake_dcp_group, make_builder, make_vllm_config
from dense_reference import KV_LORA_RANK, ROPE_DIM, full_attention, random_decode_batch
from kernel_stubs import TokenspeedMLAReference, TrtllmMLAReference, import_on_cpu
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
    impl_cls = backend.backend.get_impl_cls()
    return impl_cls(
        num_heads=NUM_HEADS, head_size=KV_LORA_RANK + ROPE_DIM, scale=scale,
        num_kv_heads=1, alibi_slopes=None, sliding_window=None,
        kv_cache_dtype=backend.kv_cache_dtype, logits_soft_cap=None,
        attn_type="decoder", kv_sharing_target_layer_name=None, q_lora_rank=None,
        kv_lora_rank=KV_LORA_RANK, qk_nope_head_dim=128, qk_rope_head_dim=ROPE_DIM,
        qk_head_dim=128 + ROPE_DIM, v_head_dim=128, kv_b_proj=None)


def _layer():
    upstream_combine = mock.Mock(name="upstream_combine")
    return SimpleNamespace(_q_scale_float=1.0, _k_scale_float=1.0,
                           dcp_manager=SimpleNamespace(combine=upstream_combine))


def _rounded(batch, dtype):
    """The batch as the kernel sees it: q and KV stored in ``dtype``."""
    batch.q = batch.q.to(dtype).float()
    null = batch.kv_cache[0].clone()
    batch.kv_cache = batch.kv_cache.to(dtype).float()
    batch.kv_cache[0] = null
    return batch


CASES = {  # (seq_lens, query_lens) per (causal, batch shape)
    (True, "uniform"): ([37, 4, 300, 18, 130], [4, 4, 4, 4, 4]),
    (False, "uniform"): ([37, 7, 300, 18, 130], [7, 7, 7, 7, 7]),
    # CUDA-graph padding: trailing zero-length requests.
    (True, "padded"): ([37, 4, 300, 0, 0], [4, 4, 4, 0, 0]),
    (False, "padded"): ([37, 7, 300, 0], [7, 7, 7, 0]),
    # Adaptive verification: ragged query lengths (FlashInfer is VARLEN).
    (True, "ragged"): ([37, 2, 300, 18, 130], [4, 1, 7, 3, 2]),
}


@pytest.mark.parametrize("world_size", [2, 4, 8])
@pytest.mark.parametrize("interleave", [1, 16])
@pytest.mark.parametrize("causal,shape", sorted(CASES))
def test_forward_mqa_merges_to_full_attention(tmp_path, backend, world_size,
                                              interleave, causal, shape, monkeypatch):
    if shape == "ragged" and backend.name == "TOKENSPEED_MLA":
        pytest.skip("Tokenspeed takes uniform query lengths (QueryLenSupport.UNIFORM)")
    seq_lens, query_lens = CASES[causal, shape]
    batch = _rounded(random_decode_batch(seq_lens, query_lens, block_size=BLOCK_SIZE,
                                         num_heads=NUM_HEADS, seed=world_size),
                     backend.dtype)
    ref_out, ref_lse = full_attention(batch, causal=causal)
    shards = dcp_decode.shard_paged_kv(batch.kv_cache, batch.block_table,
                                       batch.seq_lens, world_size=world_size,
                                       interleave=interleave)
    config = make_vllm_config(tmp_path / "model", dcp=world_size, interleave=interleave,
                              block_size=BLOCK_SIZE, num_speculative_tokens=6)
    config.cache_config.cache_dtype = backend.kv_cache_dtype
    builds = []
    real_build = dcp_decode.build_flat_decode
    monkeypatch.setattr(dcp_decode, "build_flat_decode",
                        lambda *a, **k: builds.append(1) or real_build(*a, **k))
    layer_names = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]

    outs, lses = [], []
    for rank, (cache, table) in enumerate(shards):
        from vllm.config import set_current_vllm_config

        with fake_dcp_group(world_size, rank), set_current_vllm_config(config):
            patches = backend.patches()
            for p in patches:
                p.start()
            try:
                builder = make_builder(backend.backend.get_builder_cls(), config,
                                       layer_names=layer_names, non_causal=not causal)
                common = common_metadata(seq_lens, query_lens, table,
                                         world_size=world_size, rank=rank,
                                         interleave=interleave, causal=causal)
                metadata = builder.build(0, common)
                impl = _make_impl(backend, batch.scale)
                assert impl.dcp_world_size == world_size and impl.dcp_rank == rank
                q = batch.q.to(backend.dtype)
                kv = cache.to(backend.dtype)
                layer_results = []
                for _ in layer_names:
                    layer = _layer()
                    out, lse = impl.forward_mqa(q, kv, metadata, layer)
                    layer_results.append((out.float(), lse))
                    # The layer's combine now skips vLLM's per-layer mask.
                    assert layer.dcp_manager.combine_masked_by_rows
            finally:
                for p in patches:
                    p.stop()
        assert len(builds) == rank + 1, "one metadata build per forward, not per layer"
        for out, lse in layer_results[1:]:
            assert torch.equal(out, layer_results[0][0])
        outs.append(layer_results[0][0])
        lses.append(layer_results[0][1])
    out, lse = dcp_decode.merge_partials(torch.stack(outs), torch.stack(lses),
                                         lse_base_e=impl.lse_base_on_e)
    if not impl.lse_base_on_e:
        lse = lse * torch.log(torch.tensor(2.0))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)


class FakeSm90MLA:
    """Stands in for ``FlashInferSm90MLA`` (its plan/run contract) on CPU."""

    instances: list["FakeSm90MLA"] = []

    def __init__(self, workspace, *, num_heads, page_size, sm_scale, dtype,
                 kv_lora_rank, rope_dim):
        self.sm_scale, self.kv_lora_rank = sm_scale, kv_lora_rank
        self.plans = 0
        self.flat = None
        FakeSm90MLA.instances.append(self)

    def plan_causal_prefix(self, flat, query_start_loc):
        assert query_start_loc.dtype == torch.int32
        assert int(query_start_loc[-1]) <= flat.num_rows
        self.plans += 1
        self.flat = flat

    def run(self, q, kv_cache, *, mask_empty=True):
        assert q.shape[0] == self.flat.num_rows
        out, lse = dcp_decode.mla_decode_reference(
            q.float(), kv_cache.float(), self.flat.block_table, self.flat.seq_lens,
            kv_lora_rank=self.kv_lora_rank, scale=self.sm_scale)
        return out.to(q.dtype), lse


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_flashinfer_sm90_plans_once_per_forward(tmp_path, world_size):
    backend = Backend("FLASHINFER_MLA")
    seq_lens, query_lens = CASES[False, "uniform"]
    batch = _rounded(random_decode_batch(seq_lens, query_lens, block_size=BLOCK_SIZE,
                                         num_heads=NUM_HEADS, seed=3), torch.bfloat16)
    ref_out, _ = full_attention(batch, causal=False)
    shards = dcp_decode.shard_paged_kv(batch.kv_cache, batch.block_table,
                                       batch.seq_lens, world_size=world_size,
                                       interleave=16)
    config = make_vllm_config(tmp_path / "model", dcp=world_size, interleave=16,
                              block_size=BLOCK_SIZE, num_speculative_tokens=6)
    layer_names = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
    outs, lses = [], []
    for rank, (cache, table) in enumerate(shards):
        from vllm.config import set_current_vllm_config

        FakeSm90MLA.instances.clear()
        with fake_dcp_group(world_size, rank), set_current_vllm_config(config), \
                mock.patch.object(backend.module.checks, "current_gpu_major",
                                  return_value=9), \
                mock.patch.object(backend.module, "_get_workspace_buffer",
                                  lambda *a: torch.empty(0)), \
                mock.patch("vllm.v1.attention.ops.flashinfer_sm90_mla.FlashInferSm90MLA",
                           FakeSm90MLA):
            builder = make_builder(backend.backend.get_builder_cls(), config,
                                   layer_names=layer_names, non_causal=True)
            impl = _make_impl(backend, batch.scale)
            common = common_metadata(seq_lens, query_lens, table, world_size=world_size,
                                     rank=rank, interleave=16, causal=False)
            for forward in range(2):
                metadata = builder.build(0, common)
                for _ in layer_names:
                    out, lse = impl.forward_mqa(batch.q.bfloat16(), cache.bfloat16(),
                                                metadata, _layer())
                (kernel,) = FakeSm90MLA.instances  # one kernel object per group
                assert kernel.plans == forward + 1  # planned once per forward
        outs.append(out.float())
        lses.append(lse if lse is not None else torch.zeros(out.shape[:2]))
    out, _ = dcp_decode.merge_partials(torch.stack(outs), torch.stack(lses))
    torch.testing.assert_close(out, ref_out, atol=2e-2, rtol=2e-2)


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
                    "_current_dcp_size", return_value=8):
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
