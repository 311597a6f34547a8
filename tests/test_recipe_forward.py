# SPDX-License-Identifier: Apache-2.0
"""Every recipe's first prompt runs through vLLM's Kimi-K3 MLA layer
(``tests/support/recipe_forward.py``).

For every ``vllm serve`` command of the README's "Production recipe" and
every command the launcher generates (``tests/test_recipe_start.py``'s
lists; the draft's backend named or not gives the target the same layers,
so once per generation, KV dtype and interleave), on its GPU generation: the start-up checks, then vLLM's own
``MultiHeadLatentAttention`` of the target with the backend, KV dtype and
prefill backend vLLM picks there, its metadata builder, and its attention on
a prefill without context and one with chunked context, at the recipe's
``-dcp 8`` (rank 0; the context through vLLM's DCP context path) and at
``-dcp 1``, where the output is compared with float64 attention on the values
the layer attends to (the cache's fp8 values for the context). Kernels that
cannot run on CPU are stood in at their contracts.

Where vLLM's own path cannot serve a config, it fails here as on the GPU:
Kimi-K3 over a plain fp8 cache with a bf16 prefill query ("Kimi-K3 fp8 KV
cache requires an fp8 prefill query"), which is what the plugin's Hopper
prefill (``k3_fp8_prefill``) replaces and what the sm100 start-up check
refuses.
"""

from __future__ import annotations

import shlex

import pytest
import torch

from tests.support import recipe_forward as rf
from tests.support import recipe_start as rs
from tests.test_recipe_start import LAUNCHER_CASES, README_RECIPES, launcher_argv

# Two requests, long enough to be prefills for every backend's builder
# (FLASH_ATTN_MLA's decodes up to 512 query tokens, FLASHMLA's 128).
FIRST = rf.PrefillStep(context=[0, 0], new=[600, 530])
CHUNKED = rf.PrefillStep(context=[600, 530], new=[520, 545])
FP8_ASSERTION = "Kimi-K3 fp8 KV cache requires an fp8 prefill query"


def _cases():
    cases = [(r["id"], r["major"], r["argv"]) for r in README_RECIPES]
    for major, kv, interleave, backend in LAUNCHER_CASES:
        if backend is not None:
            continue  # the draft's backend leaves the target's layers as they are
        cases.append((f"launcher-sm{major}0-{kv or 'bf16'}-i{interleave}-"
                      f"{backend or 'vllm'}", major, (kv, interleave, backend)))
    return cases


CASES = _cases()


def _argv(case_argv, major, tmp_path, dcp=8):
    if isinstance(case_argv, tuple):  # the launcher's, for the tiny pair
        kv, interleave, backend = case_argv
        target, draft = rs.write_tiny_k3_pair(tmp_path / "models")
        return launcher_argv(major, kv, interleave, backend, target, draft, dcp=dcp)
    return case_argv


def _run_prompt(k3):
    """Both steps; the outputs, the inputs and the block table."""
    table = rf.block_table_for(2, 20)
    first = rf.random_inputs(k3, FIRST, seed=1)
    out_first = rf.run_prefill(k3, FIRST, first, table)
    chunked = rf.random_inputs(k3, CHUNKED, seed=2)
    out_chunked = rf.run_prefill(k3, CHUNKED, chunked, table)
    return (out_first, out_chunked), (first, chunked), table


def _expected_query_dtype(k3):
    from vllm.v1.attention.backends.mla.k3_fp8_prefill import is_plain_fp8

    fp8 = is_plain_fp8(k3.layer.kv_cache_dtype)
    return torch.float8_e4m3fn if fp8 and k3.chosen_prefill == "TRTLLM_RAGGED" \
        else torch.bfloat16


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_recipe_serves_its_first_prompt(tmp_path, case):
    _, major, case_argv = case
    # -dcp 8, rank 0: the prefill, the cache write of rank 0's tokens and the
    # DCP context path with the recipe's KV dtype.
    argv = _argv(case_argv, major, tmp_path)
    with rf.k3_target_layer(argv, major, tmp_path / "dcp8") as k3:
        outputs, _, _ = _run_prompt(k3)
        assert all(torch.isfinite(out.float()).all() for out in outputs)
        assert set(k3.prefill.q_dtypes) == {_expected_query_dtype(k3)}
    if isinstance(case_argv, tuple):
        return  # the launcher's target layers are the README's (same flags)
    # -dcp 1: the same against float64 attention.
    with rf.k3_target_layer([*argv, "-dcp", "1"], major, tmp_path / "dcp1") as k3:
        (out_first, out_chunked), (first, chunked), table = _run_prompt(k3)
        tolerance = (rf.FP8_QUERY_TOLERANCE if _expected_query_dtype(k3) == rf.FP8
                     else rf.BF16_TOLERANCE)
        assert_matches_reference(k3, out_first, out_chunked, first, chunked, table,
                                 tolerance)


def assert_matches_reference(k3, out_first, out_chunked, first, chunked, table,
                             tolerance):
    """Request 0 of each step against float64 attention: the first step over
    its own latent, the chunked step over the cached context (as stored,
    fp8 values times the scale, as read back into the bf16 workspace) and
    its own new latent."""
    layer = k3.layer
    n_first, n_new = FIRST.new[0], CHUNKED.new[0]

    def latent(inputs, count):
        return torch.cat([inputs.kv_c_normed[:count].double(),
                          inputs.k_pe[:count, 0].double()], dim=-1)

    query_dtype = _expected_query_dtype(k3)
    expected_first = rf.reference_attention(k3, first.q[:n_first],
                                            latent(first, n_first), 0,
                                            query_dtype=query_dtype)
    # As the context gather hands it over: in the model dtype.
    context = rf.cached_latent(k3, table, 0, CHUNKED.context[0],
                               read_as=torch.bfloat16)
    expected_chunked = rf.reference_attention(
        k3, chunked.q[:n_new], torch.cat([context, latent(chunked, n_new)]),
        CHUNKED.context[0], query_dtype=query_dtype)
    for got, expected in ((out_first[:n_first], expected_first),
                          (out_chunked[:n_new], expected_chunked)):
        error = rf.relative_error(got, expected)
        assert error <= tolerance, (error, layer.kv_cache_dtype)


# ---------------------------------------------------------------------------
# Kimi-K3 over a plain fp8 cache on Hopper: the plugin's bf16-query prefill

HOPPER_FP8 = "-tp 8 -dcp 1 --kv-cache-dtype fp8"


def test_hopper_fp8_prefill_fails_in_vllm_without_the_plugin(tmp_path):
    """vLLM 0.32/0.34's own K3 prefill on sm90 over an fp8 cache (issue
    #51313), also with use_prefill_query_quantization (ignored off sm100)."""
    for flags in (HOPPER_FP8, HOPPER_FP8 + " --attention-config "
                  "'{\"use_prefill_query_quantization\": true}'"):
        with rf.k3_target_layer(shlex.split(flags), 9, tmp_path,
                                touches=False) as k3:
            with pytest.raises(AssertionError, match=FP8_ASSERTION):
                _run_prompt(k3)


def test_hopper_fp8_prefill_matches_float64_on_the_fp8_values(tmp_path):
    """The bf16-query prefill with a checkpoint's fp8 scale (0.05, not 1):
    the new tokens' latent lands in the cache quantized with it, the context
    is read back dequantized with it, and the output is float64 attention on
    those values within the bf16 output's rounding (below the fp8 decode's
    3e-2)."""
    with rf.k3_target_layer(shlex.split(HOPPER_FP8), 9, tmp_path,
                            k_scale=0.05) as k3:
        (out_first, out_chunked), (first, chunked), table = _run_prompt(k3)
        assert set(k3.prefill.q_dtypes) == {torch.bfloat16}
        assert_matches_reference(k3, out_first, out_chunked, first, chunked,
                                 table, rf.BF16_TOLERANCE)
        # The cache holds the new latent as fp8 with the scale.
        stored = rf.cached_latent(k3, table, 1, FIRST.new[1])
        second = slice(FIRST.new[0], sum(FIRST.new))
        written = torch.cat([first.kv_c_normed[second].double(),
                             first.k_pe[second, 0].double()], dim=-1)
        scale = k3.layer._k_scale.float()
        rounded = (written.float() / scale).to(torch.float8_e4m3fn).double() * float(scale)
        assert torch.equal(stored, rounded)


# ---------------------------------------------------------------------------
# sm100: the start-up check agrees with the forward

SM100_FP8 = "-tp 8 -dcp 8 --kv-cache-dtype fp8"


@pytest.mark.parametrize("attention_config", [
    None, '{"use_prefill_query_quantization": true}',
    '{"mla_prefill_backend": "TRTLLM_RAGGED"}'])
def test_sm100_fp8_without_an_fp8_prefill_is_refused_and_would_fail(
        tmp_path, attention_config):
    flags = SM100_FP8 + (f" --attention-config '{attention_config}'"
                         if attention_config else "")
    config = rs.recipe_config(shlex.split(flags), tmp_path / "check", major=10)
    from tests.support.cuda_selection import check_as_gpu

    with pytest.raises(ValueError, match="--attention-config"):
        check_as_gpu(config, 10)
    # What it would have done: the first prompt fails.
    with pytest.raises(AssertionError, match=FP8_ASSERTION), \
            mock_check_passes():
        with rf.k3_target_layer(shlex.split(flags), 10, tmp_path / "run") as k3:
            _run_prompt(k3)


def mock_check_passes():
    from unittest import mock

    from vllm.v1.attention.backends.mla import k3_fp8_prefill

    return mock.patch.object(k3_fp8_prefill, "prefill_query_problem",
                             lambda *args: None)


# ---------------------------------------------------------------------------
# The Hopper fp8 recipe's decode reads what its prefill wrote

VERIFY = rf.PrefillStep(context=list(FIRST.new), new=[5, 5])  # 1 + 4 drafts


# With DSpark's 4 drafts a verify block is 5 query tokens.
DSPARK = (" --speculative-config '{\"method\": \"dspark\", \"model\": \"d\", "
          "\"num_speculative_tokens\": 4}'")


def test_hopper_fp8_verify_reads_the_latent_the_prefill_wrote(tmp_path):
    """After the plugin's bf16-query prefill (fp8 latent, scale 0.05), a
    verify block of 5 tokens decodes on vLLM's FLASHMLA fp8 (FlashMLA at its
    contract) over the prefill's cache and its own new latent: float64
    attention on the fp8 values the cache should hold, within the fp8
    decode's bound (every recipe's verify and draft steps:
    ``tests/test_recipe_decode.py``)."""
    major, backend = 9, "FLASHMLA"
    flags = HOPPER_FP8 + DSPARK
    with rf.k3_target_layer(shlex.split(flags), major, tmp_path,
                            k_scale=0.05) as k3:
        assert k3.layer.get_attn_backend().get_name() == backend
        table = rf.block_table_for(2, 20)
        first = rf.random_inputs(k3, FIRST, seed=1)
        rf.run_prefill(k3, FIRST, first, table)
        verify = rf.random_inputs(k3, VERIFY, seed=3)
        out = rf.run_step(k3, VERIFY, verify, table, decode=True)
        # What the cache should hold: each token's latent, fp8 with the scale
        # (not read back: a prefill writing other values fails here).
        scale = k3.layer._k_scale.float()
        latent = torch.cat([
            torch.cat([inputs.kv_c_normed[:count], inputs.k_pe[:count, 0]], dim=-1)
            for inputs, count in ((first, FIRST.new[0]), (verify, VERIFY.new[0]))])
        latent = (latent.float() / scale).to(torch.float8_e4m3fn).double() * float(scale)
        expected = rf.reference_decode(k3, verify.q[:VERIFY.new[0]], latent,
                                       VERIFY.context[0])
        got = out[:VERIFY.new[0]].double()
        error = rf.relative_error(got, expected)
        assert error <= rf.FP8_QUERY_TOLERANCE, error
