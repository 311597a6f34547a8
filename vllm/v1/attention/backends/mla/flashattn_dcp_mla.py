# SPDX-License-Identifier: Apache-2.0
"""vLLM's FLASH_ATTN_MLA, not selectable where vLLM's own code would refuse it.

vLLM's ``FlashAttnMLAImpl`` decodes speculative tokens under decode context
parallelism only at ``--cp-kv-cache-interleave-size`` 1 (its
``supports_mtp_with_cp_non_trivial_interleave_size`` is False; its builder
also refuses DSpark's multi-token queries above 1): at a larger interleave
the model runner asserts in every worker, at model load, after vLLM's
Hopper order already picked it (selection does not look at the impl).
Registered over ``FLASH_ATTN_MLA`` by the plugin, this backend's selection
hook (``DCPSelection``) reads that impl attribute under DCP, so vLLM's
selector moves on to the next backend of its order, one that serves the
interleave; a named ``--attention-backend FLASH_ATTN_MLA`` is refused by the
start-up checks naming the flag. Everything else, and everything at DCP
size 1, is vLLM's own class and answer.
"""

from __future__ import annotations

from typing import ClassVar

from vllm.v1.attention.backends.mla import dcp_config_checks as checks
from vllm.v1.attention.backends.mla.flashattn_mla import FlashAttnMLABackend


class FlashAttnDCPMLABackend(checks.DCPSelection, FlashAttnMLABackend):
    """``FLASH_ATTN_MLA`` that declines speculative decoding under DCP at an
    interleave above 1."""

    dcp_latent: ClassVar[None] = None
