# SPDX-License-Identifier: Apache-2.0
"""vLLM's FLASH_ATTN_MLA, not selectable where its builder would refuse.

vLLM's ``FlashAttnMLAMetadataBuilder`` serves DSpark's multi-token queries
under decode context parallelism only at ``--cp-kv-cache-interleave-size`` 1
(``supports_dcp_with_varlen``): at a larger interleave it raises in every
worker, at model load, after vLLM's Hopper order already picked it for the
target (selection does not look at DSpark x DCP). Registered over
``FLASH_ATTN_MLA`` by the plugin, this backend answers that case in
``supports_combination``, so vLLM's selector moves on to the next backend of
its order, one that serves the interleave; a named ``--attention-backend
FLASH_ATTN_MLA`` is refused by the start-up checks naming the flag. Everything
else, and everything at DCP size 1, is vLLM's own class and answer.
"""

from __future__ import annotations

from vllm.v1.attention.backends.mla import dcp_config_checks as checks
from vllm.v1.attention.backends.mla.dcp_compat import current_dcp_size
from vllm.v1.attention.backends.mla.flashattn_mla import FlashAttnMLABackend


class FlashAttnDCPMLABackend(FlashAttnMLABackend):
    """``FLASH_ATTN_MLA`` that declines DSpark x DCP at interleave > 1."""

    @classmethod
    def supports_combination(cls, head_size, dtype, kv_cache_dtype, block_size,
                             use_mla, has_sink, use_sparse, use_mm_prefix,
                             device_capability) -> str | None:
        from vllm.config import get_current_vllm_config

        vllm_config = get_current_vllm_config()
        if vllm_config.model_config is not None and current_dcp_size() > 1:
            problem = checks.flashattn_dspark_problem(
                checks.DCPSetting.from_vllm_config(vllm_config,
                                                   device_capability.major))
            if problem is not None:
                return problem
        return super().supports_combination(
            head_size, dtype, kv_cache_dtype, block_size, use_mla, has_sink,
            use_sparse, use_mm_prefix, device_capability)
