# SPDX-License-Identifier: Apache-2.0
"""The plugin beside vLLM's own backend selection and start-up checks.

Through vLLM's selector (``get_attn_backend`` -> ``CudaPlatform``'s priority
lists and each backend's ``validate_configuration``) with compute capability
9.0 and 10.0: at ``-dcp 1`` every choice and CUDA-graph mode is upstream's;
``check_attention_cp_compatibility`` accepts every overridden backend for
spec decode at interleave 16. The README's and the launcher's recipes are
started as vLLM starts them in ``tests/test_recipe_start.py``.
"""

from __future__ import annotations

from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from tests.support.builder_harness import fake_dcp_group, make_mla_impl, make_vllm_config
from tests.support.cuda_selection import (as_cuda_gpu, plugin_registered, select_mla_backend,
                                          unloading_llvmlite)
from tests.support.dense_reference import KV_LORA_RANK, ROPE_DIM
from tests.support.kernel_stubs import import_on_cpu

# Imported here, on CPU: a module first imported inside ``as_cuda_gpu`` keeps
# vLLM's CUDA platform as its ``current_platform`` (TRITON_MLA's impl reads
# it when IMPLS constructs one).
import_on_cpu("vllm.v1.attention.backends.mla.triton_mla")

GPU_MAJORS = (9, 10)


@pytest.fixture(autouse=True, scope="module")
def _unload_llvmlite():
    with unloading_llvmlite():
        yield


def _selected(result):
    assert isinstance(result, type), f"vLLM selected no backend: {result}"
    return result


def _cudagraph_support(backend_cls, vllm_config, major):
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    spec = MLAAttentionSpec(block_size=64, num_kv_heads=1,
                            head_size=KV_LORA_RANK + ROPE_DIM, dtype=torch.bfloat16)
    with as_cuda_gpu(major):
        return backend_cls.get_builder_cls().get_cudagraph_support(vllm_config, spec)


@pytest.mark.parametrize("major", GPU_MAJORS)
@pytest.mark.parametrize("role", ["target", "draft"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_dcp1_selection_and_graph_mode_are_upstreams(tmp_path, major, role,
                                                     kv_cache_dtype):
    """-dcp 1: the plugin changes no backend choice and no CUDA-graph mode."""
    config = make_vllm_config(tmp_path / "m", dcp=1, block_size=64,
                              num_speculative_tokens=3)
    chosen = {}
    for registered in (False, True):
        with plugin_registered(registered):
            backend = _selected(select_mla_backend(
                config, major, non_causal=role == "draft",
                kv_cache_dtype=kv_cache_dtype))
            chosen[registered] = (backend.get_name(),
                                  _cudagraph_support(backend, config, major))
    assert chosen[True] == chosen[False]


def test_dcp1_hopper_draft_stays_on_triton(tmp_path):
    """The case that moved before: a DSpark draft on an H100/H200 at dcp 1."""
    config = make_vllm_config(tmp_path / "m", dcp=1, block_size=64,
                              num_speculative_tokens=3)
    with plugin_registered(True):
        backend = _selected(select_mla_backend(config, 9, non_causal=True))
    assert backend.get_name() == "TRITON_MLA"


@pytest.mark.parametrize("major", GPU_MAJORS)
def test_dcp8_hopper_draft_gets_the_dcp_path(tmp_path, major):
    """-dcp 8: a non-causal draft has no upstream backend on Hopper; the
    plugin's FLASHMLA serves it there (vLLM's sm90 order reaches it before
    FLASHINFER_MLA), its FLASHINFER_MLA on sm100, with bf16 and fp8 caches."""
    config = make_vllm_config(tmp_path / "m", dcp=8, block_size=64,
                              num_speculative_tokens=3)
    expected = {9: ("FLASHMLA", "FlashMLADCPBackend"),
                10: ("FLASHINFER_MLA", "FlashInferDCPMLABackend")}[major]
    for kv_cache_dtype in ("auto", "fp8"):
        if major == 10 and kv_cache_dtype == "auto":
            continue  # sm100 with bf16: vLLM's own choice, unchanged
        with plugin_registered(False):
            upstream = select_mla_backend(config, major, non_causal=True,
                                          kv_cache_dtype=kv_cache_dtype)
        with plugin_registered(True):
            ours = _selected(select_mla_backend(config, major, non_causal=True,
                                                kv_cache_dtype=kv_cache_dtype))
        assert (ours.get_name(), ours.__name__) == expected, kv_cache_dtype
        if major == 9:
            assert isinstance(upstream, ValueError)



NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


# ---------------------------------------------------------------------------
# check_attention_cp_compatibility (what the GPU model runners call)

IMPLS = {
    "FLASHINFER_MLA": ("vllm.v1.attention.backends.mla.flashinfer_dcp_mla",
                       "FlashInferDCPMLAImpl", "auto"),
    "TOKENSPEED_MLA": ("vllm.v1.attention.backends.mla.tokenspeed_dcp_mla",
                       "TokenspeedDCPMLAImpl", "fp8"),
    "CPU_MLA": ("vllm.v1.attention.backends.mla.cpu_dcp_mla", "CPUDCPMLAImpl", "auto"),
    "TRITON_MLA": ("vllm.v1.attention.backends.mla.triton_dcp_mla", "TritonDCPMLAImpl",
                   "auto"),
}


def _make_impl(module, cls_name, kv_cache_dtype):
    impl_cls = getattr(import_on_cpu(module), cls_name)
    # Tokenspeed JIT-compiles its prefill kernel at construction (GPU only).
    with mock.patch("tokenspeed_mla.warmup_compile_prefill", lambda **kwargs: None):
        return _construct(impl_cls, kv_cache_dtype)


def _construct(impl_cls, kv_cache_dtype):
    return make_mla_impl(impl_cls, num_heads=8, scale=0.1, kv_cache_dtype=kv_cache_dtype)


def _cp_check(config, impls):
    """vLLM's own ``check_attention_cp_compatibility`` over layers with these impls."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.worker import cp_utils

    layers = {f"model.layers.{i}.attn": SimpleNamespace(impl=impl)
              for i, impl in enumerate(impls)}
    with mock.patch.object(cp_utils, "get_layers_from_vllm_config",
                           return_value=layers), set_current_vllm_config(config):
        cp_utils.check_attention_cp_compatibility(config)


@pytest.mark.parametrize("backend", sorted(IMPLS))
@pytest.mark.parametrize("dcp", [2, 8])
def test_spec_decode_with_interleave_passes_vllms_cp_check(tmp_path, backend, dcp):
    config = make_vllm_config(tmp_path / "m", dcp=dcp, interleave=16, block_size=64,
                              num_speculative_tokens=4)
    from vllm.config import set_current_vllm_config

    with fake_dcp_group(dcp, 0), set_current_vllm_config(config):
        impl = _make_impl(*IMPLS[backend])
    assert impl.dcp_world_size == dcp and impl.need_to_return_lse_for_decode
    _cp_check(config, [impl])


# ---------------------------------------------------------------------------
# The README's and the launcher's recipes: tests/test_recipe_start.py


def _backend_enum(name):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    if name is None or isinstance(name, AttentionBackendEnum):
        return name
    return AttentionBackendEnum[name]




@pytest.mark.parametrize("major", [8, 12])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_dcp8_without_flashinfer_mla_gets_the_triton_rows(tmp_path, major,
                                                          kv_cache_dtype):
    """Ampere/Ada (8.x) and sm120: TRITON_MLA is vLLM's MLA backend there;
    at -dcp 8 upstream refuses a DSpark draft, the plugin's rows serve it and
    the causal target."""
    config = make_vllm_config(tmp_path / "m", dcp=8, block_size=64,
                              num_speculative_tokens=3)
    with plugin_registered(False):
        upstream = select_mla_backend(config, major, non_causal=True,
                                      kv_cache_dtype=kv_cache_dtype)
    assert isinstance(upstream, ValueError)
    with plugin_registered(True):
        for non_causal in (False, True):
            ours = _selected(select_mla_backend(config, major, non_causal=non_causal,
                                                kv_cache_dtype=kv_cache_dtype))
            assert ours.__name__ == "TritonDCPMLABackend"
