# SPDX-License-Identifier: Apache-2.0
"""vLLM's own CUDA backend selection, run on CPU as on an sm90 or sm100 GPU.

``as_cuda_gpu(major)`` makes ``vllm.platforms.current_platform`` vLLM's
``CudaPlatform`` reporting compute capability ``major``.0, and answers the
probes of GPU-only kernels the way a GPU of that generation with vLLM's wheel
does: FlashAttention's and FlashMLA's Hopper MLA kernels present on sm90,
FlashInfer's module importable, CUTLASS MLA's import-time workspace
allocated on the meta device. Everything else (priority lists, each backend's
``validate_configuration``, ``supports_combination``, the plugin's overrides)
is vLLM's and the plugin's own code.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import types
from unittest import mock

import torch

from tests.support.kernel_stubs import cuda_properties_for_import, flash_attn_entry_points

def _overridden() -> tuple[str, ...]:
    from vllm.v1.attention.backends.mla.dcp_vllm_touches import BACKEND_OVERRIDES

    return tuple(name for name, _ in BACKEND_OVERRIDES)


OVERRIDDEN = _overridden()


def _cuda_platform_cls():
    try:
        importlib.import_module("vllm._C_stable_libtorch")
    except Exception:  # a CPU build of vLLM, or CUDA libraries absent
        sys.modules["vllm._C_stable_libtorch"] = types.ModuleType(
            "vllm._C_stable_libtorch")
    from vllm.platforms.cuda import CudaPlatform

    return CudaPlatform


def _meta_instead_of_cuda(real_empty):
    def empty(*args, device=None, **kwargs):
        if device is not None and str(device).startswith("cuda"):
            device = "meta"
        return real_empty(*args, device=device, **kwargs)

    return empty


@contextlib.contextmanager
def as_cuda_gpu(major: int, *, flashmla: bool = True):
    """Run vLLM's CUDA platform code as on a compute capability ``major``.0 GPU;
    ``flashmla``: vLLM's wheel built with FlashMLA's extension (optional)."""
    import vllm.platforms
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention import selector

    cuda_platform = _cuda_platform_cls()
    capability = DeviceCapability(major, 0)
    hopper = major == 9
    with contextlib.ExitStack() as stack:
        enter = stack.enter_context
        enter(cuda_properties_for_import(major))
        enter(mock.patch.object(cuda_platform, "get_device_capability",
                                classmethod(lambda cls, device_id=0: capability)))
        enter(mock.patch.object(vllm.platforms, "current_platform", cuda_platform()))
        enter(mock.patch.object(torch, "empty", _meta_instead_of_cuda(torch.empty)))
        enter(flash_attn_entry_points())
        flashattn_mla = importlib.import_module(
            "vllm.v1.attention.backends.mla.flashattn_mla")
        enter(mock.patch.object(flashattn_mla, "flash_attn_supports_mla",
                                lambda: hopper))
        flashmla_probe = (lambda: (True, None) if hopper and flashmla else
                          (False, "FlashMLA Dense is only supported on Hopper devices."
                           if flashmla else "vllm._flashmla_C is not available"))
        # Where the selector reads it, and where FLASHMLA's impl bound it at
        # import (patched here too, or the answer would depend on which test
        # imported that module first).
        importlib.import_module("vllm.v1.attention.backends.mla.flashmla")
        for module in ("vllm.v1.attention.ops.flashmla",
                       "vllm.v1.attention.backends.mla.flashmla"):
            enter(mock.patch(f"{module}.is_flashmla_dense_supported", flashmla_probe))
        selector._cached_get_attn_backend.cache_clear()
        try:
            yield cuda_platform
        finally:
            selector._cached_get_attn_backend.cache_clear()


@contextlib.contextmanager
def unloading_llvmlite():
    """Selecting as on a GPU imports FlashInfer's CUDA stack, and with it
    llvmlite, whose ``ffi.lib`` answers every attribute lookup: vLLM's
    Triton dispatcher (``register_kernels``) then fails scanning
    ``sys.modules`` in any later test of this process. Unloads what the
    block loaded of it (a test module's fixture)."""
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name.split(".")[0] in ("llvmlite", "numba"):
            del sys.modules[name]


@contextlib.contextmanager
def plugin_registered(registered: bool):
    """The plugin's overrides in place (True) or vLLM's own backends (False)."""
    from vllm.v1.attention.backends.mla.dcp_plugin import register
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    members = [AttentionBackendEnum[name] for name in OVERRIDDEN]
    with _registry_restored(members):
        for member in members:
            member.clear_override()
        if registered:
            # The CPU pieces play no part in CUDA selection, and vLLM's Triton
            # dispatcher cannot rebind kernels once some modules are loaded.
            from vllm.v1.attention.backends.mla import cpu_dcp_patches
            from vllm.v1.attention.backends.mla import dcp_vllm_touches as touches

            without_cpu_pieces = tuple(t for t in touches.TOUCHES if not (
                t.install or "").startswith(f"{cpu_dcp_patches.__name__}:"))
            with mock.patch.object(touches, "TOUCHES", without_cpu_pieces):
                register()
            assert all(AttentionBackendEnum[name].is_overridden() for name in OVERRIDDEN)
        yield


@contextlib.contextmanager
def backends_overridden():
    """The plugin's backend classes registered over vLLM's (and nothing else
    of the plugin's touches), as vLLM's selector sees them in a process the
    plugin loaded in; vLLM's registry restored on the way out."""
    from vllm.v1.attention.backends.mla.dcp_vllm_touches import BACKEND_OVERRIDES
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    members = {AttentionBackendEnum[name]: path for name, path in BACKEND_OVERRIDES}
    with _registry_restored(members):
        for member, path in members.items():
            register_backend(member, path)
        yield


@contextlib.contextmanager
def _registry_restored(members):
    """vLLM's registry entries of ``members`` (backend enum members) as they
    were, restored on the way out."""
    from vllm.v1.attention.backends.registry import register_backend

    before = {m: m.get_path() if m.is_overridden() else None for m in members}
    try:
        yield
    finally:
        for member, path in before.items():
            member.clear_override()
            if path is not None:
                register_backend(member, path)


def select_mla_backend(vllm_config, major: int, *, non_causal: bool,
                       kv_cache_dtype: str = "auto", num_heads: int = 16,
                       layer_kv_cache_dtype: str | None = None):
    """vLLM's ``get_attn_backend`` for an MLA layer of ``vllm_config`` (the
    target's, or a DSpark draft's when ``non_causal``) on an sm``major``0 GPU.

    ``kv_cache_dtype``: ``--kv-cache-dtype``; ``layer_kv_cache_dtype``: the
    layer's own, where ``--kv-cache-dtype-skip-layers`` names it ("auto").
    Returns the backend class, or the ``ValueError`` vLLM raised.
    """
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.selector import get_attn_backend

    # Set in place: rebuilding the VllmConfig would rerun the CPU platform's
    # config hook (which forces CPU_MLA's block size).
    attention, cache = vllm_config.attention_config, vllm_config.cache_config
    saved = attention.use_non_causal, cache.cache_dtype
    attention.use_non_causal, cache.cache_dtype = non_causal, kv_cache_dtype
    try:
        with as_cuda_gpu(major), set_current_vllm_config(vllm_config):
            return get_attn_backend(576, torch.bfloat16,
                                    layer_kv_cache_dtype or kv_cache_dtype,
                                    use_mla=True, num_heads=num_heads)
    except ValueError as error:
        return error
    finally:
        attention.use_non_causal, cache.cache_dtype = saved


def engine_config(model_dir, *, tp=2, dcp=2, max_model_len=4096, dtype="float32",
                  **flags):
    """vLLM's ``EngineArgs(...).create_engine_config()``, as ``vllm serve``
    builds its config (the plugin's start-up checks run in it)."""
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(model_dir), skip_tokenizer_init=True,
                      tensor_parallel_size=tp, decode_context_parallel_size=dcp,
                      max_model_len=max_model_len, dtype=dtype,
                      **flags).create_engine_config()


def gpu_engine_config(model_dir, **flags):
    """A config built here on CPU for a GPU: the CPU platform's DCP checks and
    its model-runner refusal (a GPU runs DSpark in Model Runner V2) are left
    out, the CPU platform's hook runs as on a CPU without AMX (the same
    config on every host: ``builder_harness.cpu_without_amx``), and an
    explicit ``--block-size`` is restored (the CPU platform forced MLA's 16)."""
    from tests.support.builder_harness import cpu_without_amx
    from vllm.config.vllm import VllmConfig
    from vllm.v1.attention.backends.mla import dcp_startup_checks

    runner_check = next(name for name in ("_validate_v1_model_runner",  # 0.32
                                          "_validate_model_runner")  # 0.34
                        if hasattr(VllmConfig, name))
    flags.setdefault("dtype", "bfloat16")  # a GPU model's (vLLM refuses fp32 MLA)
    with mock.patch.object(dcp_startup_checks, "check_vllm_config"), \
            mock.patch.object(VllmConfig, runner_check), cpu_without_amx():
        config = engine_config(model_dir, **flags)
    if "block_size" in flags:
        config.cache_config.block_size = flags["block_size"]
    else:  # what vLLM's CacheConfig holds on a GPU host until a worker sets it
        config.cache_config.block_size = type(config.cache_config).DEFAULT_BLOCK_SIZE
    return config


def check_as_gpu(config, major: int, *, flashmla: bool = True) -> None:
    """The start-up checks on ``config`` as on an sm{major}0 host: vLLM's
    CUDA platform code, the plugin's overrides registered, vLLM asked in
    this process (a GPU host asks in a child process)."""
    from tests.support.gpu_config import on_cuda_host
    from tests.support.recipe_start import import_on_cpu
    from vllm.v1.attention.backends.mla import dcp_startup_checks

    import_on_cpu(config)
    with on_cuda_host(major, flashmla=flashmla), backends_overridden(), \
            mock.patch.object(dcp_startup_checks, "ASK_IN_CHILD_PROCESS", False):
        dcp_startup_checks.check_vllm_config(config)

