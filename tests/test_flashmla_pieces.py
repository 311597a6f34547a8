# SPDX-License-Identifier: Apache-2.0
"""``flashmla_pieces``: when FLASHMLA's planner cuts a lone request's prefix
into pieces, and the pieces' block table and lengths, against a plain
reading of the prefix's pages (CPU, plain torch)."""

from __future__ import annotations

import pytest
import torch

from vllm.v1.attention.ops.flashmla_pieces import PAGE, PiecePlanner, pieces_for


def test_pieces_only_for_a_lone_bf16_request():
    # 132 SMs (H100 / H200), q_len 4: 96 heads -> 22 FlashMLA partitions,
    # 128 heads -> 16 (the two shapes measured on the device).
    assert pieces_for(num_reqs=1, fp8=False, rows_per_request=4 * 96, num_sms=132) == 4
    assert pieces_for(num_reqs=1, fp8=False, rows_per_request=4 * 128, num_sms=132) == 2
    assert pieces_for(num_reqs=2, fp8=False, rows_per_request=4 * 96, num_sms=132) == 1
    assert pieces_for(num_reqs=1, fp8=True, rows_per_request=4 * 96, num_sms=132) == 1
    assert pieces_for(num_reqs=1, fp8=False, rows_per_request=4 * 96, num_sms=1) == 1


@pytest.mark.parametrize("pieces", [1, 2, 3, 4])
def test_pieces_cover_the_prefix_pages_in_order(pieces):
    planner = PiecePlanner(torch.device("cpu"))
    width = 11
    table = torch.randperm(100)[:width].int().view(1, width) + 1
    for prefix in (0, 1, 63, 64, 65, 300, 700, width * PAGE):
        got_table, got_lens = planner.plan(torch.tensor([prefix], dtype=torch.int32),
                                           table, pieces)
        assert got_table.shape == (pieces, width) and got_lens.shape == (pieces,)
        assert int(got_lens.sum()) == prefix and bool((got_lens >= 0).all())
        keys = []  # every key of the prefix exactly once, in order
        for piece in range(pieces):
            n = int(got_lens[piece])
            assert n % PAGE == 0 or piece == pieces - 1 or int(got_lens[piece + 1:].sum()) == 0
            keys += [(int(got_table[piece, k // PAGE]), k % PAGE) for k in range(n)]
        assert keys == [(int(table[0, k // PAGE]), k % PAGE) for k in range(prefix)]


def test_more_pieces_than_planned_for_are_refused():
    with pytest.raises(ValueError, match="pieces"):
        PiecePlanner(torch.device("cpu")).plan(torch.tensor([5], dtype=torch.int32),
                                               torch.ones(1, 4, dtype=torch.int32), 5)
