# SPDX-License-Identifier: Apache-2.0
"""What this plugin reads from vLLM differently per supported version.

One place for the version fallbacks (vLLM 0.32 and 0.34), each naming the
version it serves, and for the one private vLLM read the plugin makes. A
vLLM with neither spelling fails at import, which the plugin's guard
reports as an unsupported vLLM.
"""

from __future__ import annotations

try:  # vLLM >= 0.33
    from vllm.v1.kv_cache_interface import get_block_table_width
except ImportError:  # vLLM 0.32
    from vllm.v1.worker.block_table import get_block_table_width

__all__ = ["current_dcp_size", "get_block_table_width"]


def current_dcp_size() -> int:
    """DCP size of the config being built or selected for; outside a config
    context that of the initialized DCP group; else 1."""
    from vllm.config import get_current_vllm_config_or_none
    from vllm.distributed import parallel_state

    vllm_config = get_current_vllm_config_or_none()
    if vllm_config is not None:
        return vllm_config.parallel_config.decode_context_parallel_size
    # vLLM has no public "is the DCP group initialized" query
    # (get_dcp_group() asserts).
    group = parallel_state._DCP
    return group.world_size if group is not None else 1
