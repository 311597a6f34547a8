# SPDX-License-Identifier: Apache-2.0
"""DSpark x DCP on CPU, end to end through vLLM: tokens/s and acceptance.

Builds the tiny MLA target (``tests/support/tiny_mla.py``) and a tiny DSpark draft
(``tests/support/tiny_dspark.py``) whose Markov head proposes the target's usual next
token (bigram successors of transformers' greedy output), then runs each
configuration as its own ``vllm.LLM`` (``tests/support/greedy_run.py``: greedy,
float32, eager) with ``VLLM_DCP_CPU_MRV2=1`` (Model Runner V2 in Triton's
interpreter, vLLM's DSpark speculator)::

    python -m benchmarks.dspark_cpu                       # -tp 2 -dcp 2
    python -m benchmarks.dspark_cpu --configs tp1 tp1-nospec tp2-dcp2 tp2-dcp2-i16

(from the repository root: the tiny models are imported from ``tests``).

A configuration is ``tp<N>[-dcp<M>][-i<I>][-nospec]``. Prints one JSON line
per configuration and a table: generated tokens/s (all prompts, wall time of
``generate``), drafted and accepted tokens, acceptance rate, mean accepted
length per draft, and whether the tokens equal the first configuration's.
Tiny random models on a CPU: the numbers show the route works, not speed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def parse_config(name: str) -> dict:
    match = re.fullmatch(r"tp(\d+)(?:-dcp(\d+))?(?:-i(\d+))?(-nospec)?", name)
    if not match:
        raise argparse.ArgumentTypeError(
            f"configuration {name!r}: expected tp<N>[-dcp<M>][-i<I>][-nospec]")
    tp, dcp, interleave, nospec = match.groups()
    return {"name": name, "tp": int(tp), "dcp": int(dcp or 1),
            "interleave": int(interleave or 1), "draft": not nospec}


def make_prompts(num: int, seed: int = 0) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    lengths = [5 + (37 * i) % 120 for i in range(num)]
    return [torch.randint(4, 256, (n,), generator=gen).tolist() for n in lengths]


def build_models(workdir: Path, prompts, max_tokens: int) -> tuple[Path, Path]:
    from tests.support.tiny_dspark import bigram_successors, build_tiny_dspark_checkpoint
    from tests.support.tiny_mla import build_tiny_mla_checkpoint, hf_greedy

    target = build_tiny_mla_checkpoint(workdir / "target")
    continuations = hf_greedy(target, prompts, max_tokens)
    successors = bigram_successors(
        [p[-1:] + c for p, c in zip(prompts, continuations)])
    draft = build_tiny_dspark_checkpoint(workdir / "draft", target,
                                         markov_successors=successors)
    return target, draft


def run_config(config: dict, target: Path, draft: Path, prompts_file: Path,
               max_tokens: int, max_num_seqs: int) -> dict:
    from tests.support.greedy_run import cpu_engine_env

    env = dict(os.environ, **cpu_engine_env(config["tp"]),
               VLLM_DCP_CPU_MRV2="1")
    cmd = [sys.executable, str(REPO / "tests" / "support" / "greedy_run.py"),
           "--model", str(target), "--prompts-json", str(prompts_file),
           "--tp", str(config["tp"]), "--dcp", str(config["dcp"]),
           "--interleave", str(config["interleave"]),
           "--max-tokens", str(max_tokens), "--max-num-seqs", str(max_num_seqs)]
    if config["draft"]:
        cmd += ["--draft", str(draft)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith('{"tokens"')]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{config['name']} failed:\n{proc.stdout[-3000:]}\n"
                           f"{proc.stderr[-3000:]}")
    result = json.loads(lines[-1])
    spec = result["spec"]
    drafts = int(spec.get("vllm:spec_decode_num_drafts") or 0)
    drafted = int(spec.get("vllm:spec_decode_num_draft_tokens") or 0)
    accepted = int(spec.get("vllm:spec_decode_num_accepted_tokens") or 0)
    generated = sum(map(len, result["tokens"]))
    return {
        "config": config["name"], "tokens": result["tokens"],
        "generated_tokens": generated, "generate_s": result["generate_s"],
        "tokens_per_s": round(generated / result["generate_s"], 1),
        "load_s": result["load_s"], "drafts": drafts, "drafted": drafted,
        "accepted": accepted,
        "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
        "mean_accepted_per_draft": round(accepted / drafts, 2) if drafts else None,
        "accepted_per_pos": spec.get("vllm:spec_decode_num_accepted_tokens_per_pos"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--configs", nargs="+", type=parse_config,
                        default=[parse_config("tp2-dcp2")])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--workdir", help="where the tiny checkpoints go "
                        "(default: a temporary folder)")
    args = parser.parse_args()

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="dspark_cpu_"))
    workdir.mkdir(parents=True, exist_ok=True)
    prompts = make_prompts(args.prompts)
    prompts_file = workdir / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    target, draft = build_models(workdir, prompts, args.max_tokens)
    rows = []
    for config in args.configs:
        row = run_config(config, target, draft, prompts_file, args.max_tokens,
                         args.max_num_seqs)
        row["same_tokens_as_first"] = row["tokens"] == (rows[0] if rows else row)["tokens"]
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "tokens"}), flush=True)
    print(f"\n{args.prompts} prompts x {args.max_tokens} tokens, greedy float32")
    print(f"{'config':<16}{'tokens/s':>10}{'drafted':>9}{'accepted':>9}"
          f"{'accept':>8}{'per draft':>10}  same tokens")
    for row in rows:
        rate = row["acceptance_rate"]
        per = row["mean_accepted_per_draft"]
        print(f"{row['config']:<16}{row['tokens_per_s']:>10}{row['drafted']:>9}"
              f"{row['accepted']:>9}{'-' if rate is None else rate:>8}"
              f"{'-' if per is None else per:>10}  {row['same_tokens_as_first']}")


if __name__ == "__main__":
    main()
