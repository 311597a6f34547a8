# SPDX-License-Identifier: Apache-2.0
"""vLLM's FLASH_ATTN_MLA, not selectable where its builder would refuse.

vLLM's ``FlashAttnMLAMetadataBuilder`` serves DSpark's multi-token queries
under decode context parallelism only at ``--cp-kv-cache-interleave-size`` 1
(``supports_dcp_with_varlen``): at a larger interleave it raises in every
worker, at model load, after vLLM's Hopper order already picked it for the
target (selection does not look at DSpark x DCP). Registered over
``FLASH_ATTN_MLA`` by the plugin, this backend declares that limit
(``dcp_dspark_interleave``), which its selection hook (``DCPSelection``)
answers under DCP, so vLLM's selector moves on to the next backend of its
order, one that serves the interleave; a named ``--attention-backend
FLASH_ATTN_MLA`` is refused by the start-up checks naming the flag.
Everything else, and everything at DCP size 1, is vLLM's own class and
answer.
"""

from __future__ import annotations

from typing import ClassVar

from vllm.v1.attention.backends.mla import dcp_config_checks as checks
from vllm.v1.attention.backends.mla.flashattn_mla import FlashAttnMLABackend


class FlashAttnDCPMLABackend(checks.DCPSelection, FlashAttnMLABackend):
    """``FLASH_ATTN_MLA`` that declines DSpark x DCP at interleave > 1."""

    dcp_latent: ClassVar[None] = None
    dcp_dspark_interleave: ClassVar[int] = 1
