# SPDX-License-Identifier: Apache-2.0
"""GSM8K 5-shot exact match of a running OpenAI-compatible vLLM server.

Runs lm-eval (0.4.13) with its ``local-completions`` model against
``--base-url`` and GSM8K read from local JSONL files, so it works on machines
with no hub access::

    python -m tools.gsm8k --base-url http://127.0.0.1:8000/v1 \
        [--data-dir ../shared/data/gsm8k] [--limit 200] [--num-concurrent 32]

The data folder holds ``test.jsonl`` and ``train.jsonl`` (fields ``question``
and ``answer``); default ``$GSM8K_DATA_DIR`` or ``../shared/data/gsm8k`` beside the checkout.
The task is lm-eval's own ``gsm8k`` (prompt, 5-shot from train, stop strings,
strict / flexible answer extraction) with only its data source replaced: see
``tools/gsm8k_task/gsm8k_local.yaml.template``.

Prints lm-eval's results table, then one JSON line
``{"gsm8k": {"strict-match": ..., "flexible-extract": ..., ...}}``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

TASK_NAME = "gsm8k_local"
TASK_TEMPLATE = Path(__file__).resolve().parent / "gsm8k_task" / "gsm8k_local.yaml.template"
# The offline copy kept beside the project checkout (never inside it).
DEFAULT_DATA_DIR = str(Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k")


def default_data_dir() -> str:
    """``$GSM8K_DATA_DIR`` if set, else the shared offline copy."""
    return os.environ.get("GSM8K_DATA_DIR", DEFAULT_DATA_DIR)


def lm_eval_gsm8k_yaml() -> Path:
    """Path of the installed lm-eval's own gsm8k task yaml."""
    import lm_eval

    path = Path(lm_eval.__file__).parent / "tasks" / "gsm8k" / "gsm8k.yaml"
    if not path.exists():
        raise FileNotFoundError(f"lm-eval has no gsm8k task at {path}")
    return path


def write_task_dir(data_dir: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Render the local-data gsm8k task into ``out_dir`` (an --include_path)."""
    data_dir = Path(data_dir).resolve()
    missing = [n for n in ("test.jsonl", "train.jsonl") if not (data_dir / n).exists()]
    if missing:
        raise FileNotFoundError(
            f"GSM8K data folder {data_dir} lacks {', '.join(missing)}; "
            "pass --data-dir (a folder with test.jsonl and train.jsonl)")
    text = TASK_TEMPLATE.read_text().format(
        gsm8k_yaml=lm_eval_gsm8k_yaml(), data_dir=data_dir)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    task_file = out_dir / f"{TASK_NAME}.yaml"
    task_file.write_text(text)
    return task_file


def served_model_name(base_url: str, timeout: float = 10.0) -> str:
    """The first model id the server lists at ``{base_url}/models``."""
    with urllib.request.urlopen(f"{base_url}/models", timeout=timeout) as resp:
        return json.load(resp)["data"][0]["id"]


def lm_eval_command(*, base_url: str, model: str, tokenizer: str,
                    include_path: str | os.PathLike, output_path: str | os.PathLike,
                    num_fewshot: int, limit: int | None, num_concurrent: int,
                    max_gen_toks: int | None, seed: int,
                    log_samples: bool = False) -> list[str]:
    """The ``lm-eval run`` command line for one gsm8k evaluation."""
    model_args = ",".join([
        f"model={model}",
        f"base_url={base_url}/completions",
        f"tokenizer={tokenizer}",
        f"num_concurrent={num_concurrent}",
        "max_retries=3",
        "tokenized_requests=False",
    ])
    cmd = [sys.executable, "-m", "lm_eval", "run",
           "--model", "local-completions",
           "--model_args", model_args,
           "--tasks", TASK_NAME,
           "--include_path", str(include_path),
           "--num_fewshot", str(num_fewshot),
           "--batch_size", "1",
           "--seed", str(seed),
           "--output_path", str(output_path)]
    if limit is not None:
        cmd += ["--limit", str(limit)]
    if max_gen_toks is not None:
        cmd += ["--gen_kwargs", f"max_gen_toks={max_gen_toks}"]
    if log_samples:
        cmd += ["--log_samples"]
    return cmd


def read_scores(output_path: str | os.PathLike) -> dict:
    """exact_match per filter (and its stderr) from lm-eval's results JSON."""
    files = sorted(Path(output_path).rglob("results*.json"),
                   key=lambda p: p.stat().st_mtime)
    if not files:
        raise FileNotFoundError(f"lm-eval wrote no results under {output_path}")
    results = json.loads(files[-1].read_text())
    task = results["results"][TASK_NAME]
    scores = {}
    for key, value in task.items():
        metric, _, filt = key.partition(",")
        if metric == "exact_match":
            scores[filt] = value
        elif metric == "exact_match_stderr":
            scores[f"{filt}_stderr"] = value
    scores["n_samples"] = results.get("n-samples", {}).get(TASK_NAME, {}).get("effective")
    return scores


def read_samples(output_path: str | os.PathLike) -> list[dict]:
    """Per-problem records lm-eval wrote with ``--log_samples``."""
    files = sorted(Path(output_path).rglob(f"samples_{TASK_NAME}_*.jsonl"),
                   key=lambda p: p.stat().st_mtime)
    if not files:
        raise FileNotFoundError(f"lm-eval wrote no samples under {output_path}")
    return [json.loads(line) for line in files[-1].read_text().splitlines()
            if line.strip()]


def run_gsm8k(*, base_url: str, data_dir: str | os.PathLike,
              model: str | None = None, tokenizer: str | None = None,
              num_fewshot: int = 5, limit: int | None = None,
              num_concurrent: int = 8, max_gen_toks: int | None = None,
              seed: int = 1234, output_path: str | os.PathLike | None = None,
              log_samples: bool = False, timeout: float | None = None) -> dict:
    """Run lm-eval gsm8k against ``base_url``; lm-eval's output goes to stdout.

    Returns:
        ``{"strict-match": float, "flexible-extract": float, ...stderrs,
        "n_samples": int, "wall_s": float}``.
    """
    import importlib.util

    if importlib.util.find_spec("tenacity") is None:
        raise RuntimeError("lm-eval's API models need tenacity: "
                           "pip install 'lm-eval[api]==0.4.13'")
    base_url = base_url.rstrip("/")
    model = model or served_model_name(base_url)
    tokenizer = tokenizer or model
    with tempfile.TemporaryDirectory(prefix="gsm8k_task_") as task_dir:
        write_task_dir(data_dir, task_dir)
        out = Path(output_path or Path(task_dir) / "results")
        cmd = lm_eval_command(
            base_url=base_url, model=model, tokenizer=tokenizer,
            include_path=task_dir, output_path=out, num_fewshot=num_fewshot,
            limit=limit, num_concurrent=num_concurrent,
            max_gen_toks=max_gen_toks, seed=seed, log_samples=log_samples)
        env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
                   TOKENIZERS_PARALLELISM="false")
        start = time.perf_counter()
        subprocess.run(cmd, check=True, env=env, timeout=timeout)
        scores = read_scores(out)
    scores["wall_s"] = round(time.perf_counter() - start, 1)
    return scores


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1",
                        help="the server's OpenAI API root")
    parser.add_argument("--data-dir", default=default_data_dir(),
                        help="folder with GSM8K test.jsonl and train.jsonl")
    parser.add_argument("--model", help="served model name (default: the "
                        "server's first model)")
    parser.add_argument("--tokenizer", help="HF tokenizer name or folder "
                        "(default: the model name)")
    parser.add_argument("--num-fewshot", type=int, default=5)
    parser.add_argument("--limit", type=int, help="first N test problems only")
    parser.add_argument("--num-concurrent", type=int, default=8,
                        help="requests in flight")
    parser.add_argument("--max-gen-toks", type=int,
                        help="generation cap (default: the task's 256)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--output-path", help="keep lm-eval's results here")
    parser.add_argument("--log-samples", action="store_true",
                        help="also keep every prompt and response "
                             "(with --output-path)")
    args = parser.parse_args()
    scores = run_gsm8k(
        base_url=args.base_url, data_dir=args.data_dir, model=args.model,
        tokenizer=args.tokenizer, num_fewshot=args.num_fewshot,
        limit=args.limit, num_concurrent=args.num_concurrent,
        max_gen_toks=args.max_gen_toks, seed=args.seed,
        output_path=args.output_path, log_samples=args.log_samples)
    print(json.dumps({"gsm8k": scores}), flush=True)


if __name__ == "__main__":
    main()
