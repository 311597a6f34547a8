# SPDX-License-Identifier: Apache-2.0
"""Greedy equivalence of TP=W x DCP=W with a DSpark draft against TP=1.

The tiny random MLA target (tests/tiny_mla.py) served at TP=W, DCP=W with
the tiny DSpark draft (tests/tiny_dspark.py) must produce, with greedy
sampling, exactly the tokens of TP=1 without speculation: rejection sampling
keeps the target's greedy tokens whatever the draft proposes, so any
difference is a target-side error (the causal verification of the drafted
block under DCP). The draft side is watched through the acceptance rate,
compared with the same draft at TP=1 without DCP: a draft whose KV slots
ignore DCP reads the wrong context and its acceptance collapses. The random
draft's Markov head is set to the target's bigram successors (from its own
greedy continuations), so acceptance is far from chance; its backbone stays
random, so draft-side errors move acceptance less than a trained draft's.

Prompts of 5 to 300 tokens plus 48 generated ones cross several KV blocks
(64 tokens) and DCP interleave boundaries on every rank.

DSpark needs Model Runner V2, which needs Triton on a GPU: every test skips
without CUDA or with fewer than W GPUs. Each engine runs in its own process
(``dspark_greedy_run.py``). Knobs (environment):

* ``DSPARK_TEST_ATTENTION_BACKEND``, ``DSPARK_TEST_DRAFT_BACKEND``: MLA
  backends of target and draft (default: vLLM's choice);
* ``DSPARK_TEST_REPORT``: append each case's result as a JSON line there.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

GPU_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(GPU_DIR.parent))

from tiny_dspark import (bigram_successors,  # noqa: E402
                         build_tiny_dspark_checkpoint)
from tiny_mla import build_tiny_mla_checkpoint, hf_greedy  # noqa: E402

PROMPT_LENGTHS = (5, 63, 64, 65, 130, 200, 300)
MAX_TOKENS = 48


def cuda_device_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(cuda_device_count() == 0,
                       reason="DSpark needs Model Runner V2 (Triton on CUDA)"),
]


def make_prompts(seed: int = 0, vocab_size: int = 256) -> list[list[int]]:
    """Seeded random prompts over the tiny vocabulary (no special ids)."""
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab_size) for _ in range(n)]
            for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("dspark_gpu")
    # 16 heads: divisible by every TP size tested (2 per rank at TP 8).
    target = build_tiny_mla_checkpoint(root / "target", num_heads=16)
    prompts = make_prompts()
    # The draft's Markov head proposes each token's usual successor in the
    # target's own greedy continuations (transformers, float32, on CPU), so
    # acceptance sits far above chance and can visibly collapse.
    continuations = hf_greedy(target, prompts, MAX_TOKENS)
    successors = bigram_successors(
        [p[-1:] + c for p, c in zip(prompts, continuations)])
    draft = build_tiny_dspark_checkpoint(root / "draft", target,
                                         markov_successors=successors)
    prompts_file = root / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    return target, draft, prompts_file


def run_engine(target, prompts_file, *, tp=1, dcp=1, interleave=1,
               draft=None) -> dict:
    """One greedy run in a subprocess; its JSON result."""
    out = prompts_file.parent / f"result_tp{tp}_dcp{dcp}_i{interleave}_{bool(draft)}.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, str(GPU_DIR / "dspark_greedy_run.py"),
           "--model", str(target), "--prompts-json", str(prompts_file),
           "--out", str(out),
           "--tp", str(tp), "--dcp", str(dcp), "--interleave", str(interleave),
           "--max-tokens", str(MAX_TOKENS)]
    if draft is not None:
        cmd += ["--draft", str(draft)]
        if os.environ.get("DSPARK_TEST_DRAFT_BACKEND"):
            cmd += ["--draft-attention-backend",
                    os.environ["DSPARK_TEST_DRAFT_BACKEND"]]
    if os.environ.get("DSPARK_TEST_ATTENTION_BACKEND"):
        cmd += ["--attention-backend", os.environ["DSPARK_TEST_ATTENTION_BACKEND"]]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, (
        f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(out.read_text())


def first_difference(expected: list[list[int]], got: list[list[int]]):
    """(prompt index, token index) of the first mismatch, or None."""
    for i, (a, b) in enumerate(zip(expected, got)):
        if a != b:
            j = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y),
                     min(len(a), len(b)))
            return i, j
    return None


@pytest.fixture(scope="module")
def reference(models):
    """TP=1: no speculation (the tokens) and DSpark (the acceptance)."""
    target, draft, prompts_file = models
    plain = run_engine(target, prompts_file)
    dspark = run_engine(target, prompts_file, draft=draft)
    return plain, dspark


def report(case: dict) -> None:
    print(json.dumps(case))
    path = os.environ.get("DSPARK_TEST_REPORT")
    if path:
        with open(path, "a") as fh:
            fh.write(json.dumps(case) + "\n")


def test_dspark_at_tp1_matches_plain_greedy(models, reference):
    plain, dspark = reference
    assert all(len(t) == MAX_TOKENS for t in plain["tokens"])
    assert dspark["spec"]["num_drafts"] > 0, "DSpark never drafted"
    assert first_difference(plain["tokens"], dspark["tokens"]) is None
    report({"case": "tp1-dspark", "tokens_per_s": dspark["tokens_per_s"],
            "plain_tokens_per_s": plain["tokens_per_s"], "spec": dspark["spec"]})


@pytest.mark.parametrize("world,interleave", [(2, 1), (2, 16), (4, 1), (8, 1)])
def test_tp_dcp_dspark_matches_tp1_greedy(models, reference, world, interleave):
    if cuda_device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    target, draft, prompts_file = models
    plain, ref_dspark = reference
    result = run_engine(target, prompts_file, tp=world, dcp=world,
                        interleave=interleave, draft=draft)
    spec, ref_spec = result["spec"], ref_dspark["spec"]
    report({"case": f"tp{world}-dcp{world}-i{interleave}-dspark",
            "tokens_per_s": result["tokens_per_s"],
            "tp1_plain_tokens_per_s": plain["tokens_per_s"],
            "acceptance_rate": spec["acceptance_rate"],
            "tp1_acceptance_rate": ref_spec["acceptance_rate"],
            "accepted_per_pos": spec["accepted_per_pos"],
            "tp1_accepted_per_pos": ref_spec["accepted_per_pos"]})
    assert spec["num_drafts"] > 0, "DSpark never drafted"
    diff = first_difference(plain["tokens"], result["tokens"])
    assert diff is None, (
        f"TP{world} x DCP{world} (interleave {interleave}) + DSpark differs "
        f"from TP1 greedy at prompt {diff[0]} "
        f"(length {PROMPT_LENGTHS[diff[0]]}), generated token {diff[1]}")
    # The draft's view of the context must not degrade under DCP.
    ref_rate = ref_spec["acceptance_rate"] or 0.0
    if ref_rate >= 0.05:
        assert spec["acceptance_rate"] >= 0.5 * ref_rate, (
            f"draft acceptance collapsed under DCP: {spec['acceptance_rate']:.3f} "
            f"vs {ref_rate:.3f} at TP1")
