# SPDX-License-Identifier: Apache-2.0
"""Greedy generation through ``vllm.LLM`` on CPU, one engine per process.

The engine tests run this as a subprocess (vLLM's CPU workers fork and bind
threads, which does not mix with pytest's process) and read one JSON object
from the last line of stdout::

    python tests/support/greedy_run.py --model DIR --prompts-json FILE \
        --tp 2 --dcp 2 --interleave 16 --max-tokens 64 [--ngram 3 | --draft DIR] \
        [--max-num-batched-tokens N] [--second-wave-json FILE] \
        [--features-off | --prefix-caching --chunked-prefill] [--step-log FILE] \
        [--second-wave-together] [--observe-context-chunks]

``--draft`` speculates with a DSpark draft checkpoint; that needs Model
Runner V2, which on CPU needs ``VLLM_DCP_CPU_MRV2=1`` in the environment
this process starts with (the switch acts at interpreter start).

``--second-wave-json`` generates a second list of prompts after the first
(with prefix caching on, prompts sharing a prefix with the first wave hit the
cache); their tokens follow the first wave's. ``--second-wave-together``
queues it with vLLM's scheduling paused (``LLM.sleep(level=0)``,
``enqueue``, ``wake_up(["scheduling"])``): otherwise the engine core may
schedule the first request to arrive before the others. ``--prefix-caching`` and
``--chunked-prefill`` ask vLLM for them; where vLLM turns one off the run
stops before generating, naming it (a prompt longer than the token budget
would otherwise wait forever). ``--step-log`` writes what vLLM's scheduler
scheduled each step (``tests/support/step_log_scheduler.py``; the
repository root must be on ``PYTHONPATH``). ``--observe-context-chunks``
records, in each worker, what vLLM's MLA chunked-context loop did under DCP
(``tests/support/context_chunk_probe.py``, same ``PYTHONPATH``): the output's
``context_chunks`` holds each worker's records.

Output: ``{"tokens": [[...] per prompt], "load_s": ..., "generate_s": ...,
"spec": {...}, "features": {...}, "num_cached_tokens": [...], "counters": {...}}``:
``features`` is what the engine runs with (chunked prefill, prefix caching,
the token budget), ``num_cached_tokens`` each request's prefix-cache hit,
``counters`` vLLM's prefix-cache, preemption and spec-decode counters (when
stats are on: speculating, a second wave or prefix caching asked for).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import time


# vLLM's counters an engine test reads (LLM.get_metrics()).
COUNTERS = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
            "vllm:num_preemptions", "vllm:prompt_tokens_cached")


def cpu_engine_env(tp: int) -> dict[str, str]:
    """Environment a CPU engine needs on a small machine (DESIGN.md §8)."""
    cores = os.cpu_count() or 1
    per_rank = max(cores // tp, 1)
    binds = "|".join(
        ",".join(str(rank * per_rank + i) for i in range(per_rank))
        if per_rank > 1 else str(rank % cores)
        for rank in range(tp))
    return {
        "VLLM_CPU_OMP_THREADS_BIND": binds,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
    }


def run_engine(cmd: list[str], *, env: dict[str, str], timeout: float,
               cwd) -> subprocess.CompletedProcess:
    """``subprocess.run`` of an engine script in its own process group: on a
    timeout the engine core and workers it forked are killed with it (they
    would go on using the cores), then ``TimeoutExpired`` is raised."""
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def greedy_result(cmd: list[str], *, env: dict[str, str], timeout: float, cwd,
                  label) -> dict:
    """Run one engine script (``run_engine``) and return the JSON object of its
    last ``{"tokens"`` line, with ``wall_s`` (seconds, the whole process) and
    ``log`` (its stdout and stderr) added; fails naming ``label`` and the
    output's tail when the engine exits non-zero or prints no result."""
    start = time.perf_counter()
    proc = run_engine(cmd, env=env, timeout=timeout, cwd=cwd)
    lines = [line for line in proc.stdout.splitlines()
             if line.startswith('{"tokens"')]
    assert proc.returncode == 0 and lines, (
        f"engine {label} failed (rc {proc.returncode}):\n"
        f"{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    result = json.loads(lines[-1])
    result["wall_s"] = round(time.perf_counter() - start, 1)
    result["log"] = proc.stdout + proc.stderr
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts-json", required=True,
                        help="JSON list of token-id lists")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--dcp", type=int, default=1)
    parser.add_argument("--interleave", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--ngram", type=int, default=0,
                        help="ngram speculative tokens (0: no speculation)")
    parser.add_argument("--ngram-lookup-min", type=int, default=2,
                        help="ngram: the shortest suffix matched in the context")
    parser.add_argument("--draft", help="DSpark draft checkpoint")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--max-num-batched-tokens", type=int,
                        help="the step's token budget (vLLM's default if unset); "
                        "a small one cuts verify blocks and chunks prefills")
    parser.add_argument("--second-wave-json",
                        help="JSON list of token-id lists, generated after the first")
    parser.add_argument("--second-wave-together", action="store_true",
                        help="queue the second wave with scheduling paused, so "
                        "that its requests are first scheduled in one step "
                        "(as far as the budget and --max-num-seqs allow)")
    parser.add_argument("--features-off", action="store_true",
                        help="prefix caching and chunked prefill off (as "
                        "vLLM's CPU platform runs MLA without this project)")
    parser.add_argument("--prefix-caching", action="store_true",
                        help="--enable-prefix-caching; an error if vLLM turns it off")
    parser.add_argument("--chunked-prefill", action="store_true",
                        help="--enable-chunked-prefill; an error if vLLM turns it off")
    parser.add_argument("--step-log", help="log each step's schedule here")
    parser.add_argument("--observe-context-chunks", action="store_true",
                        help="record vLLM's MLA context chunks and DCP "
                        "all-gathers in the workers")
    args = parser.parse_args()
    if args.draft and os.environ.get("VLLM_DCP_CPU_MRV2", "0") in ("", "0"):
        parser.error("--draft (DSpark) needs VLLM_DCP_CPU_MRV2=1 on CPU")

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = json.loads(open(args.prompts_json).read())
    waves = [prompts]
    if args.second_wave_json:
        waves.append(json.loads(open(args.second_wave_json).read()))
    kwargs = {}
    if args.prefix_caching:
        kwargs["enable_prefix_caching"] = True
    if args.chunked_prefill:
        kwargs["enable_chunked_prefill"] = True
    if args.step_log:
        from tests.support.step_log_scheduler import QUALNAME, STEP_LOG_ENV

        os.environ[STEP_LOG_ENV] = args.step_log
        kwargs["scheduler_cls"] = QUALNAME
    if args.observe_context_chunks:
        from tests.support.context_chunk_probe import QUALNAME as PROBE

        kwargs["worker_extension_cls"] = PROBE
    if args.ngram:
        kwargs["speculative_config"] = {
            "method": "ngram",
            "num_speculative_tokens": args.ngram,
            "prompt_lookup_min": args.ngram_lookup_min,
            "prompt_lookup_max": max(4, args.ngram_lookup_min),
        }
    if args.draft:
        # The draft's layers do not take the target's backend: name it too.
        kwargs["speculative_config"] = {"method": "dspark", "model": args.draft,
                                        "attention_backend": "CPU_MLA"}
    speculating = bool(args.ngram or args.draft)
    counting = speculating or bool(args.second_wave_json) or args.prefix_caching
    start = time.perf_counter()
    llm = LLM(
        model=args.model,
        dtype="float32",
        tensor_parallel_size=args.tp,
        decode_context_parallel_size=args.dcp,
        # CPU_MLA at every -dcp, as an operator on a CPU with AMX tiles passes
        # it: vLLM would pick AMX_MLA there (no DCP, bf16 only), and the -dcp 1
        # baselines must run the backend the -dcp 2 engines run.
        attention_backend="CPU_MLA",
        cp_kv_cache_interleave_size=args.interleave,
        block_size=16,
        enforce_eager=True,
        max_model_len=512,
        max_num_seqs=args.max_num_seqs,
        seed=0,
        disable_log_stats=not counting,
        **({"max_num_batched_tokens": args.max_num_batched_tokens}
           if args.max_num_batched_tokens else {}),
        **({"enable_prefix_caching": False, "enable_chunked_prefill": False}
           if args.features_off else {}),
        **kwargs,
    )
    loaded = time.perf_counter()
    config = llm.llm_engine.vllm_config
    features = {
        "enable_chunked_prefill": config.scheduler_config.enable_chunked_prefill,
        "enable_prefix_caching": config.cache_config.enable_prefix_caching,
        "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
    }
    turned_off = [flag for flag, asked, key in (
        ("--enable-chunked-prefill", args.chunked_prefill, "enable_chunked_prefill"),
        ("--enable-prefix-caching", args.prefix_caching, "enable_prefix_caching"))
        if asked and not features[key]]
    if turned_off:
        raise SystemExit(f"vLLM turned {' and '.join(turned_off)} off: {features}")
    if args.observe_context_chunks:
        llm.collective_rpc("observe_mla_context_chunks")
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                            ignore_eos=True, detokenize=False)
    outputs = []
    for index, wave in enumerate(waves):
        prompts = [TokensPrompt(prompt_token_ids=p) for p in wave]
        if index and args.second_wave_together:
            # vLLM's way to queue requests before any is scheduled: pause
            # scheduling (sleep level 0), enqueue, resume.
            llm.sleep(level=0)
            llm.enqueue(prompts, params, use_tqdm=False)
            llm.wake_up(tags=["scheduling"])
            outputs += llm.wait_for_completion(use_tqdm=False)
        else:
            outputs += llm.generate(prompts, params, use_tqdm=False)
    done = time.perf_counter()
    metrics = {}
    if counting:
        metrics = {m.name: (m.value if hasattr(m, "value") else getattr(m, "values", None))
                   for m in llm.get_metrics()}
    result = {
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "context_chunks": (llm.collective_rpc("mla_context_chunks_seen")
                           if args.observe_context_chunks else None),
        "load_s": round(loaded - start, 1),
        "generate_s": round(done - loaded, 1),
        "spec": {name: value for name, value in metrics.items()
                 if "spec_decode" in name and speculating},
        "features": features,
        "num_cached_tokens": [o.num_cached_tokens for o in outputs],
        "counters": {name: value for name, value in metrics.items()
                     if name in COUNTERS},
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
