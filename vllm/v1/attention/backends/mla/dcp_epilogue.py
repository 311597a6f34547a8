# SPDX-License-Identifier: Apache-2.0
"""The DCP decode epilogue of the MLA backends: what sits between a backend's
kernel and vLLM's combine of the ranks' partial outputs.

vLLM's combine (``MLADCPManager.combine``, and on vLLM >= 0.33 with
``--dcp-comm-backend a2a`` ``v_up_proj_combine``) masks empty shards per
layer with a searchsorted over per-request *local* lengths: a row whose
per-token bound is 0 on this rank while its request's local length is not
(the first tokens of a causal verify block) escapes that mask and feeds the
kernel's undefined output into the merge. So:

* once per layer, when the backend's metadata builder is made
  (``route_combines_through_rows``), each layer's masking combines are
  wrapped to drop the per-request arguments that trigger vLLM's mask. That
  is vLLM's own point for configuring a layer's ``dcp_manager``: the
  manager is made with the layer, after the impl, and the MLA builder's
  ``__init__`` (which sees every layer of its KV-cache group through the
  static forward context) is where vLLM itself sets it up
  (``init_kv_gather``); the impl never sees its layer before
  ``forward_mqa``, and the layer's ``process_weights_after_loading`` hands
  the impl only a dtype;
* every forward, after the kernel (``finish_rows_decode``), the rows where
  this rank holds no KV are masked from ``DCPDecodeMetadata.flat.empty``,
  computed once per forward.

The collectives themselves (all-gather + reduce-scatter, or all-to-all)
stay vLLM's.
"""

from __future__ import annotations

import torch

from vllm.v1.attention.ops.dcp_decode import FlatDecode

# ``MLADCPManager`` attributes that merge the ranks' partials and, given the
# per-request ``seq_lens`` / ``query_start_loc``, mask empty shards themselves:
# ``combine`` (every vLLM) and ``v_up_proj_combine`` (vLLM >= 0.33 with
# ``--dcp-comm-backend a2a``: the layer merges and up-projects in one step
# and skips ``combine``; None when unused, which vLLM reads, so it stays None).
MASKING_COMBINES = ("combine", "v_up_proj_combine")


def mask_empty_rows_(out: torch.Tensor, lse: torch.Tensor, flat: FlatDecode) -> None:
    """Neutralise rows where this rank holds no KV, in place.

    Args:
        out: [N', H, Dv] partial outputs; rows past the metadata's N are
            padding.
        lse: [N', H] partial LSEs (any base).
        flat: the forward's rows (N of them).
    """
    num_rows = min(flat.num_rows, out.shape[0])
    empty = flat.empty[:num_rows]
    lse[:num_rows].masked_fill_(empty[:, None], float("-inf"))
    out[:num_rows].masked_fill_(empty[:, None, None], 0.0)
    if lse.shape[0] > num_rows:
        lse[num_rows:].fill_(float("-inf"))
        out[num_rows:].zero_()


def _without_request_mask(collective):
    def combine(*args, seq_lens=None, query_start_loc=None, **kwargs):
        return collective(*args, **kwargs)

    combine.__wrapped__ = collective
    return combine


def route_combine_through_rows(layer) -> None:
    """Make ``layer``'s DCP combines trust the rows' mask.

    Idempotent (every builder of a KV-cache group sees the same layers); a
    layer without a ``dcp_manager`` (DCP size 1) is left alone.
    """
    manager = getattr(layer, "dcp_manager", None)
    if manager is None or getattr(manager, "combine_masked_by_rows", False):
        return
    for name in MASKING_COMBINES:
        collective = getattr(manager, name, None)
        if collective is not None:
            setattr(manager, name, _without_request_mask(collective))
    manager.combine_masked_by_rows = True


def route_combines_through_rows(vllm_config, layer_names: list[str]) -> None:
    """Route the combines of every layer a DCP rows builder serves.

    Call it from the ``__init__`` of a metadata builder whose impls finish
    every DCP decode with ``finish_rows_decode``, when it builds rows at a
    DCP size > 1.

    Args:
        vllm_config: the builder's config; its static forward context holds
            the model's attention layers by name.
        layer_names: the builder's KV-cache group.
    """
    context = vllm_config.compilation_config.static_forward_context
    for name in layer_names:
        route_combine_through_rows(context[name])


def finish_rows_decode(impl, out: torch.Tensor, lse: torch.Tensor,
                       rows: FlatDecode) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What every DCP backend does after its kernel: mask the empty rows,
    hand LSE over if vLLM wants it (the layer's combine was routed at init).

    Args:
        impl: the attention impl (``need_to_return_lse_for_decode``).
        out: [N, H, Dv] kernel output; lse: [N, H] kernel LSE.
        rows: the forward's ``DCPDecodeMetadata.flat``.

    Returns:
        ``(out, lse or None)``, masked in place.
    """
    mask_empty_rows_(out, lse, rows)
    return out, (lse if impl.need_to_return_lse_for_decode else None)
