# SPDX-License-Identifier: Apache-2.0
"""Every recipe decodes after its first prompt (``tests/support/recipe_decode.py``).

For every ``vllm serve`` command of the README's "Production recipe" and
every command the launcher generates (``tests/test_recipe_start.py``'s
lists: sm90 bf16 / fp8 and sm100 fp8, interleave 1 and 16, the draft's
backend named and not), on its GPU generation at the recipe's ``-dcp 8``:
vLLM's Kimi-K3 target MLA layer serves the prompt (a prefill, then one with
chunked context), then

* a verify step: 1 + k causal query tokens per request through the target
  layer's decode path and the builder vLLM chose for it, over the latent the
  prefills cached;
* a DSpark draft block: k non-causal query tokens per request through the
  draft's MLA layer (vLLM's ``K3DSparkDecoderLayer``, the draft's backend
  and KV dtype) and the DSpark speculator's builder.

Rank 0's partial output and LSE, what the backend hands vLLM's combine,
must be float64 attention over the keys rank 0 holds (the cache's values:
fp8 times the scale for an fp8 cache), each query token's bound its own.
The prompt's lengths put a key rank 0 holds inside each verify block (at
interleave 1 and 16), so a block's later tokens see more keys than its
first. At ``-dcp 1`` the README recipes' verify and draft steps run vLLM's
own paths (``sm100``: FlashInfer's compact variable-query decode) against
float64 attention of the whole layer output. Kernels that cannot run on CPU
are stood in at their contracts (``kernel_stubs``, ``decode_kernel_stubs``,
``recipe_forward``).
"""

from __future__ import annotations

import pytest
import torch

from tests.support import recipe_decode as rd
from tests.support import recipe_forward as rf
from tests.test_recipe_forward import _argv
from tests.test_recipe_start import LAUNCHER_CASES, README_RECIPES, launcher_expected

FIRST = rf.PrefillStep(context=[0, 0], new=[600, 530])
# Contexts 1150 and 1078: the verify blocks hold 1152 (rank 0's at
# interleave 1 and 16) and 1080 (at interleave 1).
CHUNKED = rf.PrefillStep(context=[600, 530], new=[550, 548])
CONTEXT = [c + n for c, n in zip(CHUNKED.context, CHUNKED.new)]
DRAFT_CONTEXT = [c + 1 for c in CONTEXT]  # the bonus token's, as DSpark drafts
# The outputs' bf16 rounding (rf.BF16_TOLERANCE); the LSE is float32 of the
# same values.
OUT_TOLERANCE = rf.BF16_TOLERANCE
LSE_TOLERANCE = 1e-5


def _cases():
    cases = [(r["id"], r["major"], r["argv"], (r["target"], r["draft"]))
             for r in README_RECIPES]
    for major, kv, interleave, backend in LAUNCHER_CASES:
        cases.append((f"launcher-sm{major}0-{kv or 'bf16'}-i{interleave}-"
                      f"{backend or 'vllm'}", major, (kv, interleave, backend),
                      launcher_expected(major, kv, interleave, backend)))
    return cases


CASES = _cases()


def _assert_backend(k3, expected):
    backend, word = expected
    dtype = "bf16" if k3.layer.kv_cache_dtype in ("auto", "bfloat16") else "fp8"
    assert (k3.layer.get_attn_backend().get_name(), dtype) == (backend, word)


def _rows(step, request):
    start = sum(step.new[:request])
    return slice(start, start + step.new[request])


def _serve_prompt(k3, table):
    """Both prefills; per request, the latent they should have cached."""
    cached = [[], []]
    for seed, step in enumerate((FIRST, CHUNKED), start=1):
        inputs = rf.random_inputs(k3, step, seed=seed)
        rf.run_prefill(k3, step, inputs, table)
        latent = rd.step_latent(k3, inputs)
        for r in range(2):
            cached[r].append(latent[_rows(step, r)])
    return [torch.cat(parts) for parts in cached]


def _check(k3, result, step, inputs, context_latent, *, causal):
    """Each request's decode against float64 attention over its keys: the
    rank's partial (``RankPartials``) or, at ``-dcp 1``, the layer output."""
    q = rd.kernel_query(k3, inputs)
    new_latent = rd.step_latent(k3, inputs)
    for r in range(len(step.new)):
        rows = _rows(step, r)
        latent = torch.cat([context_latent[r][:step.context[r]], new_latent[rows]])
        out, lse = rd.reference_partial(k3, q[rows], latent, inputs.positions[rows],
                                        causal=causal)
        if isinstance(result, rd.RankPartials):
            errors = rd.partial_errors(k3, result.out[rows], result.lse[rows],
                                       out, lse, result.world)
            assert errors[0] <= OUT_TOLERANCE and errors[1] <= LSE_TOLERANCE, errors
        else:
            expected = rd.up_projected(k3, out)
            error = rf.relative_error(result[rows], expected)
            assert error <= OUT_TOLERANCE, error


def _verify(k3, table, context_latent):
    """The verify step on the target: 1 + k causal tokens per request."""
    k = k3.config.speculative_config.num_speculative_tokens
    verify = rd.DecodeStep(CONTEXT, [1 + k] * 2)
    inputs = rf.random_inputs(k3, verify.as_prefill_step(), seed=3)
    result = rd.run_decode(k3, verify, inputs, table, causal=True)
    _check(k3, result, verify, inputs, context_latent, causal=True)


def _draft(k3, table):
    """A DSpark block on the draft: k non-causal tokens per request."""
    draft = rd.dspark_draft_layer(k3)
    k = k3.config.speculative_config.num_speculative_tokens
    block = rd.DecodeStep(DRAFT_CONTEXT, [k] * 2)
    draft_context = rd.fill_context(draft, table, DRAFT_CONTEXT, seed=4)
    inputs = rf.random_inputs(draft, block.as_prefill_step(), seed=5)
    result = rd.run_decode(draft, block, inputs, table, causal=False)
    _check(draft, result, block, inputs, draft_context, causal=False)
    return draft


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_recipe_verifies_and_drafts_after_its_prompt(tmp_path, case):
    _, major, case_argv, (target, draft) = case
    argv = _argv(case_argv, major, tmp_path)
    with rf.k3_target_layer(argv, major, tmp_path / "dcp8") as k3, \
            rd.decode_stand_ins(major):
        _assert_backend(k3, target)
        table = rf.block_table_for(2, rd.table_columns(k3))
        _verify(k3, table, _serve_prompt(k3, table))
        _assert_backend(_draft(k3, table), draft)


@pytest.mark.parametrize("recipe", README_RECIPES, ids=[r["id"] for r in README_RECIPES])
def test_readme_recipe_decodes_at_dcp1(tmp_path, recipe):
    """vLLM's own decode paths (the plugin's backends are vLLM's at DCP 1)."""
    major = recipe["major"]
    with rf.k3_target_layer([*recipe["argv"], "-dcp", "1"], major, tmp_path) as k3, \
            rd.decode_stand_ins(major):
        table = rf.block_table_for(2, rd.table_columns(k3))
        _verify(k3, table, _serve_prompt(k3, table))
        if major == 9 and recipe["draft"][0] == "FLASHINFER_MLA":
            # vLLM serves FLASHINFER_MLA on sm100 only; the FA3 draft is the
            # plugin's, under DCP (tests/test_recipe_start.py: same refusal
            # without the plugin).
            with pytest.raises(ValueError, match="compute capability not supported"):
                rd.dspark_draft_layer(k3)
            return
        _draft(k3, table)
