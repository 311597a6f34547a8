# SPDX-License-Identifier: Apache-2.0
"""The uniform-decode CUDA graphs vLLM's Model Runner V2 captures, from its code.

``full_decode_shapes`` turns on vLLM's default CUDA-graph mode for a config
built on CPU, lets ``VllmConfig._set_cudagraph_sizes`` pick the capture sizes
as on a GPU, and reads the FULL uniform-decode descriptors off vLLM's own
``CudaGraphManager`` (0.32: capture sizes rounded up to the query length;
0.34: request counts), for the target (query length 1 + k) or a drafter
(a DSpark block: k).
"""

from __future__ import annotations

import inspect
from unittest import mock


def full_decode_shapes(vllm_config, decode_query_len: int) -> list[tuple[int, int]]:
    """``(num_tokens, num_reqs)`` of every FULL graph of uniform decode batches
    of ``decode_query_len`` tokens per request that vLLM captures."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu import cudagraph_utils

    compilation = vllm_config.compilation_config
    compilation.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    compilation.cudagraph_capture_sizes = None
    compilation.max_cudagraph_capture_size = None
    vllm_config._set_cudagraph_sizes()
    manager_cls = cudagraph_utils.CudaGraphManager
    params = inspect.signature(manager_cls.__init__).parameters
    if "decode_query_lens" in params:  # vLLM >= 0.34
        query_lens = dict(decode_query_lens={
            decode_query_len: vllm_config.scheduler_config.max_num_seqs})
    else:
        query_lens = dict(decode_query_len=decode_query_len)
    # No process group and no CUDA graph pool on CPU: the manager only needs
    # them to capture, not to list what it would capture.
    with mock.patch.object(cudagraph_utils, "get_pp_group"), \
            mock.patch.object(cudagraph_utils.current_platform,
                              "get_global_graph_pool", create=True):
        manager = manager_cls(vllm_config, None, CUDAGraphMode.FULL_AND_PIECEWISE,
                              **query_lens)
    shapes = [(desc.num_tokens, desc.num_reqs)
              for desc in manager._capture_descs.get(CUDAGraphMode.FULL, [])
              if desc.uniform_token_count == decode_query_len]
    assert shapes, "vLLM captures no FULL uniform-decode graph for this config"
    return shapes
