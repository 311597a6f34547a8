# SPDX-License-Identifier: Apache-2.0
"""Greedy equivalence of TP=W x DCP=W with a DSpark draft against TP=1.

The tiny random MLA target (tests/support/tiny_mla.py) served at TP=W, DCP=W with
the tiny DSpark draft (tests/support/tiny_dspark.py) must produce, with greedy
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

The GPU MLA kernels run in bfloat16, where TP=1 itself leaves float32
greedy at near-ties (on CPU: top-2 gaps <= 0.19 logit at every divergence of
bf16 TP1 vs bf16 TP2 x DCP2, while one wrong token costs ~16). So besides
counting exact matches, every run's tokens are scored teacher-forced by
transformers in float32: each must be the float32 argmax within
``TIE_TOL`` logits. A divergence from TP=1 passes only as such a near-tie;
``DSPARK_TEST_EXACT=1`` demands exact equality instead (use it with
``DSPARK_TEST_DTYPE=float32`` where the backends allow).

DSpark needs Model Runner V2, which needs Triton on a GPU: every test skips
without CUDA or with fewer than W GPUs. Each engine runs in its own process
(``dspark_greedy_run.py``). Knobs (environment):

* ``DSPARK_TEST_ATTENTION_BACKEND``, ``DSPARK_TEST_DRAFT_BACKEND``: MLA
  backends of target and draft (default: vLLM's choice);
* ``DSPARK_TEST_DTYPE``: model dtype (default bfloat16);
* ``DSPARK_TEST_EXACT=1``: require exact token equality with TP=1;
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

from tests.support.tiny_dspark import bigram_successors, build_tiny_dspark_checkpoint
from tests.support.tiny_mla import build_tiny_mla_checkpoint, hf_greedy

GPU_DIR = Path(__file__).resolve().parent

PROMPT_LENGTHS = (5, 63, 64, 65, 130, 200, 300)
MAX_TOKENS = 48
# Largest float32 logit deficit a bf16 greedy token may have (noise, ~2.5x
# the largest seen on CPU); a wrong token's deficit is in the tens.
TIE_TOL = 0.5


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
    cmd = [sys.executable, str(GPU_DIR.parent / "support" / "dspark_greedy_run.py"),
           "--model", str(target), "--prompts-json", str(prompts_file),
           "--out", str(out),
           "--tp", str(tp), "--dcp", str(dcp), "--interleave", str(interleave),
           "--max-tokens", str(MAX_TOKENS),
           "--dtype", os.environ.get("DSPARK_TEST_DTYPE", "bfloat16")]
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


def fp32_deficits(target, prompts_file, tokens) -> list[list[float]]:
    """Per generated token: float32 max logit minus the token's logit, with
    the run's own tokens as context (transformers on CPU)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        target, dtype=torch.float32).eval()
    prompts = json.loads(prompts_file.read_text())
    deficits = []
    with torch.no_grad():
        for prompt, generated in zip(prompts, tokens):
            logits = model(torch.tensor([prompt + generated])).logits[0]
            logits = logits[len(prompt) - 1:-1]
            chosen = logits[torch.arange(len(generated)), torch.tensor(generated)]
            deficits.append((logits.max(-1).values - chosen).tolist())
    return deficits


def check_greedy(models, plain, result, name: str) -> dict:
    """Compare a run with TP=1 plain greedy; assert; return report fields."""
    target, _, prompts_file = models
    assert all(len(t) == MAX_TOKENS for t in result["tokens"]), name
    exact = [a == b for a, b in zip(plain["tokens"], result["tokens"])]
    deficits = fp32_deficits(target, prompts_file, result["tokens"])
    worst = max(max(d) for d in deficits)
    fields = {"exact_prompts": sum(exact), "prompts": len(exact),
              "first_difference": first_difference(plain["tokens"], result["tokens"]),
              "max_fp32_deficit": round(worst, 4)}
    if os.environ.get("DSPARK_TEST_EXACT") == "1":
        assert all(exact), f"{name} differs from TP1 greedy: {fields}"
    i, j = max(((i, j) for i, d in enumerate(deficits) for j in range(len(d))),
               key=lambda ij: deficits[ij[0]][ij[1]])
    assert worst <= TIE_TOL, (
        f"{name}: prompt {i} (length {PROMPT_LENGTHS[i]}) generated token {j} "
        f"is {worst:.3f} logits below float32 greedy; {fields}")
    return fields


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


def test_tp1_plain_is_float32_greedy_within_noise(models, reference):
    """Calibrates TIE_TOL: the reference itself must pass the check."""
    plain, _ = reference
    fields = check_greedy(models, plain, plain, "TP1")
    report({"case": "tp1-plain", "tokens_per_s": plain["tokens_per_s"],
            "max_fp32_deficit": fields["max_fp32_deficit"]})


def test_dspark_at_tp1_matches_plain_greedy(models, reference):
    plain, dspark = reference
    assert dspark["spec"]["num_drafts"] > 0, "DSpark never drafted"
    fields = check_greedy(models, plain, dspark, "TP1 + DSpark")
    report({"case": "tp1-dspark", "tokens_per_s": dspark["tokens_per_s"],
            "plain_tokens_per_s": plain["tokens_per_s"], "spec": dspark["spec"],
            **fields})


@pytest.mark.parametrize("world,interleave", [(2, 1), (2, 16), (4, 1), (8, 1)])
def test_tp_dcp_dspark_matches_tp1_greedy(models, reference, world, interleave):
    if cuda_device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    target, draft, prompts_file = models
    plain, ref_dspark = reference
    result = run_engine(target, prompts_file, tp=world, dcp=world,
                        interleave=interleave, draft=draft)
    spec, ref_spec = result["spec"], ref_dspark["spec"]
    name = f"TP{world} x DCP{world} (interleave {interleave}) + DSpark"
    case = {"case": f"tp{world}-dcp{world}-i{interleave}-dspark",
            "tokens_per_s": result["tokens_per_s"],
            "tp1_plain_tokens_per_s": plain["tokens_per_s"],
            "acceptance_rate": spec["acceptance_rate"],
            "tp1_acceptance_rate": ref_spec["acceptance_rate"],
            "accepted_per_pos": spec["accepted_per_pos"],
            "tp1_accepted_per_pos": ref_spec["accepted_per_pos"]}
    try:
        case.update(check_greedy(models, plain, result, name))
    finally:
        report(case)
    assert spec["num_drafts"] > 0, "DSpark never drafted"
    # The draft's view of the context must not degrade under DCP.
    ref_rate = ref_spec["acceptance_rate"] or 0.0
    if ref_rate >= 0.05:
        assert spec["acceptance_rate"] >= 0.5 * ref_rate, (
            f"draft acceptance collapsed under DCP: {spec['acceptance_rate']:.3f} "
            f"vs {ref_rate:.3f} at TP1")
