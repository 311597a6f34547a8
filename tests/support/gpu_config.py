# SPDX-License-Identifier: Apache-2.0
"""A ``VllmConfig`` built here as ``vllm serve`` builds it on a GPU host.

``on_cuda_host(major)`` runs vLLM's config code with the CUDA platform as
the current platform everywhere the config modules read it (also where they
bound it at import), as on an sm``major``0 host of 8 GPUs with vLLM's
wheel: Triton present (Model Runner V2), 80 GiB per GPU. So config
post-init, the model's config hooks (Kimi-K3's hybrid mamba-cache mode) and
the CUDA platform's hook decide prefix caching, the CUDA-graph mode and the
compilation mode as they do there, not the CPU platform's hook.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from unittest import mock

from tests.support.cuda_selection import as_cuda_gpu

# Config modules that bind ``current_platform`` at import.
_BOUND = ("vllm.config.compilation", "vllm.config.model", "vllm.config.parallel",
          "vllm.config.lora", "vllm.config.vllm", "vllm.engine.arg_utils")
GPU_MEMORY = 80 << 30
GPU_NAME = "NVIDIA H100 80GB HBM3"


@contextlib.contextmanager
def on_cuda_host(major: int, *, flashmla: bool = True):
    """vLLM's config code as on an sm``major``0 host. Yields the CUDA
    platform class; ``os.environ`` (which vLLM's config code may set, e.g.
    ``VLLM_USE_BREAKABLE_CUDAGRAPH``) is restored on the way out."""
    from vllm.config.compilation import PassConfig

    with as_cuda_gpu(major, flashmla=flashmla) as cuda_platform, \
            contextlib.ExitStack() as stack:
        enter = stack.enter_context
        platform = cuda_platform()
        for name in _BOUND:
            module = importlib.import_module(name)
            if hasattr(module, "current_platform"):
                enter(mock.patch.object(module, "current_platform", platform))
        enter(mock.patch.object(cuda_platform, "get_device_total_memory",
                                classmethod(lambda cls, device_id=0: GPU_MEMORY)))
        enter(mock.patch.object(cuda_platform, "get_device_name",
                                classmethod(lambda cls, device_id=0: GPU_NAME)))
        enter(mock.patch.object(cuda_platform, "device_count",
                                classmethod(lambda cls: 8)))
        config_module = importlib.import_module("vllm.config.vllm")
        if hasattr(config_module, "HAS_TRITON"):  # 0.32: MRV2 needs Triton
            enter(mock.patch.object(config_module, "HAS_TRITON", True))
        # The table of the FlashInfer all-reduce fusion sizes lives in a
        # module that binds CUDA-only ops at import; it only bounds the
        # compile ranges, which nothing here reads.
        enter(mock.patch.object(PassConfig, "default_fi_allreduce_fusion_max_size_mb",
                                staticmethod(lambda: {})))
        enter(mock.patch.dict(os.environ))
        yield cuda_platform


def cuda_engine_config(model_dir, major: int, *, tp: int, dcp: int, **flags):
    """``EngineArgs(...).create_engine_config()`` on an sm``major``0 host,
    the plugin's start-up checks left out of the platform's hook (the
    caller runs them: ``recipe_start.check_on_cuda``). Returns the config
    and the environment vLLM's config code left (the workers inherit it)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.plugins import load_general_plugins
    from vllm.v1.attention.backends.mla import dcp_startup_checks

    from tests.support.recipe_start import import_on_cpu

    # Loaded first under the CUDA platform, the plugin would leave its checks
    # on that platform for the rest of the process.
    load_general_plugins()
    import_on_cpu()
    with on_cuda_host(major), mock.patch.object(dcp_startup_checks,
                                                "check_vllm_config"):
        config = EngineArgs(model=str(model_dir), skip_tokenizer_init=True,
                            tensor_parallel_size=tp,
                            decode_context_parallel_size=dcp,
                            **flags).create_engine_config()
        env = dict(os.environ)
    return config, env
