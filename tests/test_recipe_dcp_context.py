# SPDX-License-Identifier: Apache-2.0
"""A chunked prefill at ``-dcp 8`` reads its context from all eight ranks.

``tests/test_recipe_forward.py`` runs each recipe's prompt as rank 0 with
the other ranks' caches not simulated (their all-gathered context is rank
0's, repeated). Here every rank's cache is what that rank's own prefill
wrote (vLLM's slot mapping under DCP, the layer's cache insert), and the
DCP group's all-gather hands rank 0 each rank's local gather, made by the
same gather call vLLM made on rank 0 (same padded offsets) over that rank's
cache. vLLM's DCP context path then restores the global token order
(``reorg_kvcache``) and attends; its output is compared with float64
attention over the context as the cache holds it (fp8 values times the
scale), for every request, at interleave 1 and 16.

The recipes are the fp8 ones whose context path differs: sm90's (the
plugin's bf16-query prefill over a plain fp8 cache: the dequantizing gather
with a checkpoint's scale) and sm100's (PR #52188's fp8 prefill query: the
gather of raw fp8 bytes).
"""

from __future__ import annotations

import contextlib
import shlex
from unittest import mock

import pytest
import torch

from tests.support import recipe_forward as rf

FIRST = rf.PrefillStep(context=[0, 0], new=[600, 530])
CHUNKED = rf.PrefillStep(context=[600, 530], new=[70, 45])
WORLD = 8

CASES = {
    "sm90-fp8-i1": (9, "-tp 8 -dcp 8 --kv-cache-dtype fp8"),
    "sm90-fp8-i16": (9, "-tp 8 -dcp 8 --kv-cache-dtype fp8 "
                        "--cp-kv-cache-interleave-size 16"),
    "sm100-fp8-i16": (10, "-tp 8 -dcp 8 --kv-cache-dtype fp8 "
                          "--cp-kv-cache-interleave-size 16 --attention-config "
                          "'{\"mla_prefill_backend\":\"TRTLLM_RAGGED\","
                          "\"use_prefill_query_quantization\":true}'"),
}


@contextlib.contextmanager
def every_ranks_gather(rank_caches: list[torch.Tensor]):
    """The DCP all-gather of the context as eight ranks make it: the gather
    call of rank 0 (recorded where vLLM's layer calls it) repeated over each
    rank's cache, in rank order."""
    calls = {}

    def recording(name):
        stand_in = getattr(rf, name)

        def gather(**kwargs):
            calls["last"] = (stand_in, kwargs)
            return stand_in(**kwargs)
        return gather

    def kv_gather(manager, gathered_kv, local_kv):
        stand_in, kwargs = calls.pop("last")
        toks = local_kv.shape[0]
        for rank, cache in enumerate(rank_caches):
            dst = torch.zeros_like(kwargs["dst"])
            stand_in(**{**kwargs, "src_cache": cache, "dst": dst})
            gathered_kv[rank * toks:(rank + 1) * toks] = dst[:toks]

    with mock.patch("vllm._custom_ops.gather_and_maybe_dequant_cache",
                    recording("gather_and_maybe_dequant_cache")), \
            mock.patch("vllm._custom_ops.cp_gather_cache", recording("cp_gather_cache")), \
            mock.patch("vllm.v1.attention.ops.dcp.MLADCPManager.kv_gather", kv_gather):
        yield


def global_context(k3, rank_caches, block_table, request: int, length: int,
                   interleave: int) -> torch.Tensor:
    """[length, 576] float64: positions 0..length-1 of ``request`` from the
    rank that holds each (``(p // I) % W``, local slot ``(p // (I W)) I +
    p % I``), dequantized with the layer's scale, in bf16 as the gather
    writes it."""
    position = torch.arange(length)
    owner = (position // interleave) % WORLD
    local = (position // (interleave * WORLD)) * interleave + position % interleave
    rows = torch.stack([rf._gathered(rank_caches[int(r)], block_table,
                                     torch.tensor([request]), torch.tensor([int(p)]))[0]
                        for r, p in zip(owner, local)])
    values = rows.view(rf.FP8).double() * float(k3.layer._k_scale)
    return values.to(torch.bfloat16).double()


@pytest.mark.parametrize("case", list(CASES))
def test_chunked_context_at_dcp8_reads_every_rank(tmp_path, case):
    major, flags = CASES[case]
    with rf.k3_target_layer(shlex.split(flags), major, tmp_path, k_scale=0.05) as k3:
        interleave = k3.config.parallel_config.cp_kv_cache_interleave_size
        assert k3.config.parallel_config.decode_context_parallel_size == WORLD
        table = rf.block_table_for(2, 20)
        first = rf.random_inputs(k3, FIRST, seed=1)
        rank_caches = []
        for rank in range(WORLD):
            k3.kv_cache.zero_()
            rf.run_step(k3, FIRST, first, table, decode=False, rank=rank)
            rank_caches.append(k3.kv_cache.clone())
        k3.kv_cache.copy_(rank_caches[0])  # the layer runs as rank 0
        chunked = rf.random_inputs(k3, CHUNKED, seed=2)
        with every_ranks_gather(rank_caches):
            out = rf.run_prefill(k3, CHUNKED, chunked, table)
        fp8_query = k3.chosen_prefill == "TRTLLM_RAGGED"
        assert set(k3.prefill.q_dtypes) == {rf.FP8 if fp8_query else torch.bfloat16}
        scale = float(k3.layer._k_scale)
        starts, first_starts = [0, CHUNKED.new[0]], [0, FIRST.new[0]]
        for request in range(2):
            n = CHUNKED.new[request]
            rows = slice(starts[request], starts[request] + n)
            own = torch.cat([chunked.kv_c_normed[rows].double(),
                             chunked.k_pe[rows, 0].double()], dim=-1)
            # The context from the first step's inputs: fp8 with the scale,
            # read back into bf16 by the dequantizing gather.
            written = slice(first_starts[request],
                            first_starts[request] + CHUNKED.context[request])
            latent = torch.cat([first.kv_c_normed[written].float(),
                                first.k_pe[written, 0].float()], dim=-1)
            context = ((latent / scale).to(rf.FP8).double() * scale).to(
                torch.bfloat16).double()
            # Each rank's cache holds its share of it, where the layout says.
            assert torch.equal(context, global_context(
                k3, rank_caches, table, request, CHUNKED.context[request], interleave))
            expected = rf.reference_attention(
                k3, chunked.q[rows], torch.cat([context, own]), CHUNKED.context[request],
                query_dtype=rf.FP8 if fp8_query else torch.bfloat16)
            error = rf.relative_error(out[rows], expected)
            assert error <= (rf.FP8_QUERY_TOLERANCE if fp8_query
                             else rf.BF16_TOLERANCE), (request, error)
