# SPDX-License-Identifier: Apache-2.0
"""Greedy generation through ``vllm.LLM`` on GPUs, optionally with DSpark.

One engine per process (the GPU test runs this as a subprocess). Prints one
JSON object on a line of stdout and writes it to ``--out``::

    python tests/support/dspark_greedy_run.py --model TARGET --prompts-json FILE \
        --tp 2 --dcp 2 [--interleave 1] [--draft DRAFT] [--max-tokens 48] \
        [--out RESULT.json]

vLLM logs to stdout too (also after the result, at shut-down), so callers
should read ``--out``. Output: ``{"tokens": [[...] per prompt], "load_s", "generate_s",
"tokens_per_s", "spec": {"num_drafts", "num_draft_tokens",
"num_accepted_tokens", "accepted_per_pos", "acceptance_rate"}}``.
Model Runner V2 is forced on (DSpark needs it) for runs with and without a
draft alike, so both sides of a comparison use the same runner.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def spec_decode_stats(metrics) -> dict:
    """Acceptance counters from ``LLM.get_metrics()``."""
    by_name = {m.name: m for m in metrics}

    def total(name: str) -> float:
        metric = by_name.get(f"vllm:{name}")
        return float(getattr(metric, "value", 0) or 0) if metric else 0.0

    per_pos = by_name.get("vllm:spec_decode_num_accepted_tokens_per_pos")
    draft_tokens = total("spec_decode_num_draft_tokens")
    accepted = total("spec_decode_num_accepted_tokens")
    return {
        "num_drafts": total("spec_decode_num_drafts"),
        "num_draft_tokens": draft_tokens,
        "num_accepted_tokens": accepted,
        "accepted_per_pos": list(getattr(per_pos, "values", []) or []),
        "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts-json", required=True,
                        help="JSON list of token-id lists")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--dcp", type=int, default=1)
    parser.add_argument("--interleave", type=int, default=1)
    parser.add_argument("--draft", help="DSpark draft checkpoint")
    parser.add_argument("--num-spec", type=int, help="default: draft block")
    parser.add_argument("--attention-backend")
    parser.add_argument("--draft-attention-backend")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--out", help="also write the result JSON here")
    args = parser.parse_args()

    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = json.loads(open(args.prompts_json).read())
    kwargs = {}
    if args.draft:
        spec = {"method": "dspark", "model": args.draft}
        if args.num_spec:
            spec["num_speculative_tokens"] = args.num_spec
        if args.draft_attention_backend:
            spec["attention_backend"] = args.draft_attention_backend
        kwargs["speculative_config"] = spec
    if args.attention_backend:
        kwargs["attention_backend"] = args.attention_backend
    start = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype,
              tensor_parallel_size=args.tp,
              decode_context_parallel_size=args.dcp,
              cp_kv_cache_interleave_size=args.interleave,
              block_size=args.block_size, max_model_len=1024,
              max_num_seqs=16, gpu_memory_utilization=0.5, seed=0,
              disable_log_stats=False, **kwargs)
    loaded = time.perf_counter()
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                            ignore_eos=True, detokenize=False)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                           params, use_tqdm=False)
    done = time.perf_counter()
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    result = {
        "tokens": tokens,
        "load_s": round(loaded - start, 1),
        "generate_s": round(done - loaded, 2),
        "tokens_per_s": round(sum(map(len, tokens)) / (done - loaded), 1),
        "spec": spec_decode_stats(llm.get_metrics()) if args.draft else {},
    }
    print(json.dumps(result), flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh)


if __name__ == "__main__":
    main()
