# SPDX-License-Identifier: Apache-2.0
"""The DCP combine of MLA decode, driven by the per-forward row metadata.

vLLM's combine (``MLADCPManager.combine``) masks empty shards per layer with a
searchsorted over per-request *local* lengths: a row whose per-token bound is
0 on this rank while its request's local length is not (the first tokens of a
causal verify block) escapes the mask and feeds the kernel's undefined output
into the merge. Here the backends mask with ``DCPDecodeMetadata.flat.empty``,
computed once per forward, and the layer's combine skips its own mask.
"""

from __future__ import annotations

import torch

from vllm.v1.attention.ops.dcp_decode import FlatDecode


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


# ``MLADCPManager`` attributes that merge the ranks' partials and, given the
# per-request ``seq_lens`` / ``query_start_loc``, mask empty shards themselves:
# ``combine`` (every vLLM) and ``v_up_proj_combine`` (vLLM >= 0.33 with
# ``--dcp-comm-backend a2a``: the layer merges and up-projects in one step and
# skips ``combine``).
MASKING_COMBINES = ("combine", "v_up_proj_combine")


def _without_request_mask(collective):
    def combine(*args, seq_lens=None, query_start_loc=None, **kwargs):
        return collective(*args, **kwargs)

    combine.__wrapped__ = collective
    return combine


def route_combine_through_rows(layer) -> None:
    """Make ``layer``'s DCP combine trust the rows' mask (idempotent).

    vLLM builds one ``MLADCPManager`` per attention layer and offers no hook
    for the mask, so each of its masking combines that this vLLM has is
    wrapped to drop the per-request arguments that trigger the per-layer
    searchsorted; the collective itself (all-gather + reduce-scatter or
    all-to-all) is vLLM's own.
    """
    manager = getattr(layer, "dcp_manager", None)
    if manager is None or getattr(manager, "combine_masked_by_rows", False):
        return
    for name in MASKING_COMBINES:
        collective = getattr(manager, name, None)
        if collective is not None:
            setattr(manager, name, _without_request_mask(collective))
    manager.combine_masked_by_rows = True


def finish_rows_decode(impl, out: torch.Tensor, lse: torch.Tensor, rows: FlatDecode,
                       layer) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What every DCP backend does after its kernel: mask the empty rows,
    route the layer's combine through that mask, hand LSE over if wanted.

    Each layer's manager is wrapped once, on its first DCP decode (vLLM
    creates the manager after the impl and hands the impl no layer before
    ``forward_mqa``); later forwards only read the manager's flag.

    Args:
        impl: the attention impl (``dcp_world_size``,
            ``need_to_return_lse_for_decode``).
        out: [N, H, Dv] kernel output; lse: [N, H] kernel LSE.
        rows: the forward's ``DCPDecodeMetadata.flat``.
    """
    mask_empty_rows_(out, lse, rows)
    if impl.dcp_world_size > 1:
        route_combine_through_rows(layer)
    return out, (lse if impl.need_to_return_lse_for_decode else None)
