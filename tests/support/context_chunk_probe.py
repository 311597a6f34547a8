# SPDX-License-Identifier: Apache-2.0
"""What vLLM's MLA chunked-context loop did under DCP, seen in the worker.

A worker extension, named through vLLM's own ``worker_extension_cls``
(``LLM(..., worker_extension_cls=QUALNAME)``; the repository root must be on
``PYTHONPATH`` in the workers), whose two methods the engine calls on every
worker through ``LLM.collective_rpc``:

* ``observe_mla_context_chunks``: from now on, each call of vLLM's
  ``MLACommonBaseImpl._context_parallel_compute_prefill_context`` (one per
  MLA layer and step with a prefill that has a context) is recorded: vLLM's
  own chunk metadata of that step (per chunk its requests, their context
  offsets and lengths, whether it continues a request cut by the workspace)
  and every DCP all-gather made meanwhile (``MLADCPManager.kv_gather``:
  local and gathered rows, the process group's backend).
* ``mla_context_chunks_seen``: those records, with this worker's DCP rank.

Both wrappers call vLLM's functions unchanged; nothing else is touched.
"""

from __future__ import annotations

import torch

QUALNAME = "tests.support.context_chunk_probe.ContextChunkProbe"

_SEEN: list[dict] = []
_GATHERS: list[dict] = []


def _chunk(chunk) -> dict:
    return {"requests": [chunk.request_slice.start, chunk.request_slice.stop],
            "seq_lens": chunk.seq_lens.tolist(),
            "local_starts": list(chunk.local_starts or ()),
            "continuation": bool(chunk.is_continuation)}


def install() -> None:
    """Wrap the context loop and the DCP all-gather (idempotent)."""
    from vllm.model_executor.layers.attention.mla_attention import MLACommonBaseImpl
    from vllm.v1.attention.ops.dcp import MLADCPManager

    loop = MLACommonBaseImpl._context_parallel_compute_prefill_context
    if getattr(loop, "_context_chunk_probe", False):
        return
    gather = MLADCPManager.kv_gather

    def kv_gather(self, gathered_kv, local_kv):
        _GATHERS.append({
            "local_rows": local_kv.shape[0], "gathered_rows": gathered_kv.shape[0],
            "backend": str(torch.distributed.get_backend(self.group.device_group))})
        return gather(self, gathered_kv, local_kv)

    def context_loop(self, q, kv_c_and_k_pe_cache, attn_metadata, *args, **kwargs):
        _GATHERS.clear()
        out = loop(self, q, kv_c_and_k_pe_cache, attn_metadata, *args, **kwargs)
        chunked = attn_metadata.prefill.chunked_context
        _SEEN.append({"context_lens": list(chunked.context_lens_list),
                      "chunks": [_chunk(chunk) for chunk in chunked.chunks],
                      "gathers": list(_GATHERS)})
        return out

    context_loop._context_chunk_probe = True  # type: ignore[attr-defined]
    MLACommonBaseImpl._context_parallel_compute_prefill_context = context_loop
    MLADCPManager.kv_gather = kv_gather


class ContextChunkProbe:
    """Mixed into vLLM's worker class by ``worker_extension_cls``."""

    def observe_mla_context_chunks(self) -> None:
        install()

    def mla_context_chunks_seen(self) -> dict:
        from vllm.distributed.parallel_state import get_dcp_group

        return {"dcp_rank": get_dcp_group().rank_in_group, "calls": list(_SEEN)}


def spanning_calls(seen: list[dict]) -> list[dict]:
    """The recorded loop runs whose context vLLM cut into two chunks or more,
    with a request's context continued from one chunk into the next."""
    return [call for call in seen if len(call["chunks"]) >= 2
            and any(chunk["continuation"] for chunk in call["chunks"][1:])]
