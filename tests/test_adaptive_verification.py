# SPDX-License-Identifier: Apache-2.0
"""Model Runner V2's adaptive verification: host and device query lengths
disagree (same total).

MRV2 spreads the draft budget evenly over the verify requests on the host
(``query_start_loc_cpu``) and reallocates it unevenly on the device
(``query_start_loc``), passing the pre-trim host upper bound as
``max_query_len`` (``v1/worker/gpu/model_runner.py``, adaptive verify). Every
DCP backend either equals full attention over the DEVICE layout on such a
batch or declares the mismatch unsupported, so that vLLM never sends it.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from builder_harness import make_vllm_config
from test_backend_contracts import (
    BLOCK_SIZE, NUM_HEADS, Backend, FakeSm90MLA, _layer, _make_impl,
    assert_matches_full_attention, layer_batches, merge_ranks, run_steps,
    shard_layers)

# The repro of issue 11: device lengths [5, 1, 3, 3], host [3, 3, 3, 3],
# vLLM's promised bound 5 (1 + 4 drafts scheduled before the trim).
SEQ_LENS = [40, 30, 50, 60]
DEVICE_QUERY_LENS = [5, 1, 3, 3]
MISMATCH = dict(host_query_lens=[3, 3, 3, 3], max_query_len=5)


@pytest.mark.parametrize("interleave", [1, 16])
@pytest.mark.parametrize("name", ["FLASHINFER_MLA", "TOKENSPEED_MLA"])
def test_sm100_backends_follow_the_device_layout(tmp_path, name, interleave):
    backend = Backend(name)
    (batches, merged, rows_built), = run_steps(
        tmp_path, backend, [(SEQ_LENS, DEVICE_QUERY_LENS, MISMATCH)],
        world_size=2, interleave=interleave, causal=True, seed=11,
        num_speculative_tokens=4)
    assert rows_built == [1, 1]
    for batch, (out, lse) in zip(batches, merged):
        assert_matches_full_attention(batch, out, lse, causal=True, atol=2e-2,
                                      lse_atol=1e-4)
