# SPDX-License-Identifier: Apache-2.0
"""What vLLM's engine core and GPU model runner decide once a worker has
built its model, run with vLLM's own code for ``recipe_start``: the
engine core's KV-cache set-up over one worker, and the CUDA-graph modes of
Model Runner V2 and of the DSpark speculator."""

from __future__ import annotations

from types import SimpleNamespace
from unittest import mock

KV_CACHE_MEMORY = 8 << 30  # bytes a worker offers the KV cache (plenty)


class _OneWorkerExecutor:
    """The executor as the engine core sees it, over one worker of
    ``specs`` (rank 0): vLLM's worker methods answer its layout calls."""

    def __init__(self, config, specs):
        self.worker = SimpleNamespace(vllm_config=config)
        self.specs = specs
        self.kv_cache_configs = None

    def get_kv_cache_specs(self):
        return [self.specs]

    def get_supported_kv_cache_layouts(self):
        from vllm.v1.worker.worker_base import WorkerBase

        return [WorkerBase.get_supported_kv_cache_layouts(self.worker)]

    def set_kv_cache_layout(self, *args):
        from vllm.v1.worker.worker_base import WorkerBase

        WorkerBase.set_kv_cache_layout(self.worker, *args)

    def determine_available_memory(self):
        return [KV_CACHE_MEMORY]

    def initialize_from_config(self, kv_cache_configs):
        self.kv_cache_configs = kv_cache_configs

    def compile_or_warm_up_model(self):
        return []

    # 0.34's extensible KV cache (on by default where the GPU has VMM): its
    # final size is not under test.
    def extensible_kv_cache_unsupported_reason(self, specs):
        return None

    def extend_kv_cache(self, num_blocks):
        pass


def engine_core_kv_cache_config(config, specs):
    """The engine core's KV-cache set-up for one worker of ``specs``
    (``EngineCore._initialize_kv_caches``): prefix caching and chunked
    prefill off for layers whose spec says ``non_causal`` (a DSpark draft's
    say ``non_causal_multi_token_decode``: both stay on), the KV-cache
    layout, the plan (``get_kv_cache_configs``: grouping, page
    unification), the block size it sets from the groups and its
    ``validate_block_size``. Returns the worker's KV-cache config."""
    from vllm.v1.engine.core import EngineCore

    engine = object.__new__(EngineCore)
    engine.model_executor = executor = _OneWorkerExecutor(config, specs)
    EngineCore._initialize_kv_caches(engine, config)
    return executor.kv_cache_configs[0]


def draft_cudagraph_mode(speculator, runner_mode, draft_cg_support):
    """The mode the DSpark speculator's ``init_cudagraph_manager`` gives its
    graph manager, from the runner's mode and its draft layers' support."""
    from vllm.v1.worker.gpu.spec_decode.dflash import speculator as dflash

    modes = []
    speculator.attn_cg_support = draft_cg_support
    speculator.device = speculator.num_query_per_req = speculator.max_num_reqs = None
    with mock.patch.object(dflash, "DFlashCudaGraphManager",
                           lambda config, device, mode, **kwargs: modes.append(mode)):
        speculator.init_cudagraph_manager(runner_mode)
    return modes[0]


def runner_cudagraph_mode(config, model, cg_support, kv_cache_config):
    """The target runner's CUDA-graph mode: vLLM's
    ``resolve_cudagraph_mode_and_sizes`` with what Model Runner V2 passes it
    (its attention groups' weakest support, the uniform decode query length,
    piecewise capture available where breakable CUDA graphs are on or the
    model has a compiled submodule)."""
    import inspect

    from vllm.compilation.breakable_cudagraph import is_breakable_cudagraph_enabled
    from vllm.v1.worker.gpu.cudagraph_utils import has_compiled_submodule

    compilation = config.compilation_config
    kwargs = {}
    if "use_v2_model_runner" in inspect.signature(
            compilation.resolve_cudagraph_mode_and_sizes).parameters:  # 0.32
        kwargs["use_v2_model_runner"] = True
        breakable = is_breakable_cudagraph_enabled()  # from the environment
    else:  # 0.34: from the config
        breakable = is_breakable_cudagraph_enabled(compilation)
    return compilation.resolve_cudagraph_mode_and_sizes(
        cg_support.min_cg_support, cg_support.min_cg_attn_backend,
        config.uniform_decode_query_len, kv_cache_config=kv_cache_config,
        max_num_reqs=config.scheduler_config.max_num_seqs, is_profiling=False,
        piecewise_capture_available=bool(breakable or has_compiled_submodule(model)),
        **kwargs)
