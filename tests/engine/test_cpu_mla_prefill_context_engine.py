# SPDX-License-Identifier: Apache-2.0
"""Chunked prefill and prefix caching on under DCP, through vLLM's engine on
CPU: a first smoke (issue 39's full suite is ``tests/engine/`` of part B).

Two real ``vllm.LLM`` engines (multi-process, ``greedy_run.py``) on the tiny
MLA checkpoint, each generating two waves of prompts, the second sharing
long prefixes with the first:

* stock ``-tp 2`` as vLLM's CPU platform runs MLA without this project:
  prefix caching and chunked prefill off;
* ``-tp 2 -dcp 2`` (interleave 16) with both on and a token budget of 32, so
  every prompt longer than 32 tokens is prefilled in chunks (chunked prefill
  off, vLLM would not schedule it), and the second wave's prompts read
  their cached prefix through vLLM's DCP context path.

Every request's greedy tokens must be equal; the DCP engine must report both
features on and prefix-cache hits in vLLM's own counters.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from tests.engine.test_cpu_dcp_engine import engine_env
from tests.support.greedy_run import greedy_result
from tests.support.tiny_mla import build_tiny_mla_checkpoint

HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.engine

MAX_TOKENS = 16
BUDGET = 32
ENGINE_TIMEOUT_S = 400


def make_waves() -> tuple[list[list[int]], list[list[int]]]:
    """A first wave with two long prompts, a second whose prompts extend
    their prefixes (by whole and partial blocks) or share part of one."""
    gen = torch.Generator().manual_seed(3)

    def rand(n):
        return torch.randint(4, 256, (n,), generator=gen).tolist()

    long_a, long_b = rand(70), rand(45)
    first = [long_a + rand(5), long_b + rand(9), rand(100)]
    second = [long_a + rand(12), long_b + rand(3), long_a[:40] + rand(20)]
    return first, second


FIRST, SECOND = make_waves()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    work = tmp_path_factory.mktemp("prefill-context")
    model = build_tiny_mla_checkpoint(work / "tiny-mla")
    (work / "first.json").write_text(json.dumps(FIRST))
    (work / "second.json").write_text(json.dumps(SECOND))
    configs = {
        "stock -tp 2": ["--tp", "2", "--features-off"],
        "-tp 2 -dcp 2": ["--tp", "2", "--dcp", "2", "--interleave", "16",
                         "--max-num-batched-tokens", str(BUDGET)],
    }
    results = {}
    for name, flags in configs.items():
        cmd = [sys.executable, str(HERE.parent / "support" / "greedy_run.py"),
               "--model", str(model), "--prompts-json", str(work / "first.json"),
               "--second-wave-json", str(work / "second.json"),
               "--max-tokens", str(MAX_TOKENS), *flags]
        results[name] = greedy_result(cmd, env=engine_env(2), timeout=ENGINE_TIMEOUT_S,
                                      cwd=HERE, label=name)
        print(f"\nengine {name}: wall {results[name]['wall_s']} s, "
              f"{results[name]['features']}, {results[name]['counters']}")
    return results


def test_stock_tp2_runs_without_the_features(runs):
    stock = runs["stock -tp 2"]
    assert stock["features"]["enable_prefix_caching"] is False
    assert stock["features"]["enable_chunked_prefill"] is False
    tokens = stock["tokens"]
    assert len(tokens) == len(FIRST) + len(SECOND)
    assert all(len(t) == MAX_TOKENS for t in tokens)
    assert len({tuple(t) for t in tokens}) == len(tokens)  # not degenerate


def test_dcp2_chunks_and_hits_the_prefix_cache(runs):
    dcp = runs["-tp 2 -dcp 2"]
    assert dcp["features"] == {"enable_chunked_prefill": True,
                               "enable_prefix_caching": True,
                               "max_num_batched_tokens": BUDGET}
    assert max(map(len, FIRST + SECOND)) > BUDGET
    # The second wave's shared prefixes: whole blocks of 16 x 2 ranks.
    assert dcp["counters"]["vllm:prefix_cache_hits"] >= 64


def test_dcp2_with_features_equals_stock_tp2(runs):
    stock, dcp = runs["stock -tp 2"]["tokens"], runs["-tp 2 -dcp 2"]["tokens"]
    for i, (got, want) in enumerate(zip(dcp, stock)):
        assert got == want, f"prompt {i} (len {len((FIRST + SECOND)[i])})"
