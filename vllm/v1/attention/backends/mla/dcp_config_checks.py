# SPDX-License-Identifier: Apache-2.0
"""The DCP limits of the plugin's MLA backend classes, on the classes.

A backend class the plugin registers mixes in ``DCPLimits`` (or
``DCPSelection``, which also makes vLLM's selection decline a setting it
cannot serve). What vLLM has a hook for is vLLM's hook on the class:
``supports_compute_capability`` (FLASHINFER_MLA adds sm90 under DCP,
FLASHMLA keeps to sm90 there), ``supported_kv_cache_dtypes``,
``get_supported_kernel_block_sizes`` / ``supports_block_size``,
``supports_non_causal_dcp``. What vLLM has no hook for is a class attribute
of its own module (``dcp_*``: interleave, query length, head dims, the GPUs
where it reads an unquantized cache only). vLLM's impl attributes answer for
the impl (``supports_mtp_with_cp_non_trivial_interleave_size``: speculative
decoding at an interleave above 1). ``DCPLimits.dcp_problems`` turns
a ``DCPSetting`` into ``ValueError`` lines naming the flag to change, from
those hooks alone; vLLM's selection (``DCPSelection``), the builders
(``raise_if_unsupported``), the start-up check and the README's backend
table all read them there.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

from vllm.config import get_current_vllm_config
from vllm.v1.attention.backends.mla.dcp_compat import current_dcp_size
from vllm.v1.attention.backends.mla.dcp_settings import DCPSetting

UNQUANTIZED = ("auto", "float16", "bfloat16")
TARGET_FLAG = "--attention-backend"
DRAFT_FLAG = "attention_backend in --speculative-config"
FALLBACK = "TRITON_MLA"
GPU_MAJORS = (8, 9, 10, 12)  # the generations a backend's hook is asked about


def kernel_block_sizes(cls) -> tuple[int, ...]:
    """vLLM's ``get_supported_kernel_block_sizes`` of ``cls``, as tokens."""
    return tuple(getattr(size, "base", size)
                 for size in cls.get_supported_kernel_block_sizes())


def fixed_block_size(cls) -> int | None:
    """The one block size ``cls`` pages by (vLLM's CPU_MLA), else None."""
    sizes = cls.get_supported_kernel_block_sizes()
    if len(sizes) == 1 and isinstance(sizes[0], int) and \
            not cls.supports_block_size(2 * sizes[0]):
        return sizes[0]
    return None


def spec_decodes_at_any_interleave(cls) -> bool:
    """vLLM's own answer (its model runner's CP check reads it): whether the
    impl of ``cls`` decodes speculative tokens at an interleave above 1."""
    return cls.get_impl_cls().supports_mtp_with_cp_non_trivial_interleave_size


def gpu_majors(cls) -> tuple[int, ...]:
    """The GPU generations vLLM's ``supports_compute_capability`` of ``cls``
    accepts (under the current config's DCP size)."""
    from vllm.platforms.interface import DeviceCapability

    return tuple(major for major in GPU_MAJORS
                 if cls.supports_compute_capability(DeviceCapability(major, 0)))


class DCPLimits:
    """Mixin (first in the bases) of a backend class the plugin registers:
    its DCP limits that vLLM has no hook for (``None``: no limit), and
    ``dcp_problems``."""

    dcp_latent: ClassVar[tuple[int, int] | None] = (512, 64)  # kv_lora_rank, rope
    dcp_qk_nope_head_dims: ClassVar[tuple[int, ...] | None] = None
    dcp_v_head_dims: ClassVar[tuple[int, ...] | None] = None
    dcp_max_query_len: ClassVar[int | None] = None  # query tokens per request
    dcp_unquantized_on: ClassVar[tuple[int, ...]] = ()  # GPU majors: bf16/fp16 KV only

    @classmethod
    def dcp_reads(cls, kv_cache_dtype: str, gpu_major: int | None) -> bool:
        if gpu_major in cls.dcp_unquantized_on:
            return kv_cache_dtype in UNQUANTIZED
        return cls.supports_kv_cache_dtype(kv_cache_dtype)  # type: ignore[attr-defined]

    @classmethod
    def dcp_problems(cls, s: DCPSetting, *, layout: bool = True,
                     kernel_blocks: bool = True) -> list[str]:
        """Why this backend cannot run setting ``s`` (none: []).
        ``layout``: judge -dcp against -tp and ``s.block_size`` against the
        interleave (not at selection, before vLLM sets the block size);
        ``kernel_blocks``: the block size against the kernel's pages (on a
        GPU vLLM's own block-size code answers that)."""
        name, flag = cls.get_name(), DRAFT_FLAG if s.draft else TARGET_FLAG  # type: ignore[attr-defined]
        found = layout_problems(s, cls) if layout else []
        sizes = kernel_block_sizes(cls)
        if (kernel_blocks and s.dcp_size > 1
                and not cls.supports_block_size(s.block_size)):  # type: ignore[attr-defined]
            found.append(f"{name} pages the KV cache by {' or '.join(map(str, sizes))} "
                         f"tokens, not {s.block_size}: pass --block-size "
                         f"{math.lcm(s.interleave, max(sizes))}.")
        majors = gpu_majors(cls) if s.gpu_major is not None else ()
        if s.gpu_major is not None and s.gpu_major not in majors:
            gpus = " and ".join(f"sm{major}0" for major in majors)
            found.append(f"{name} runs on {gpus} GPUs only under DCP, not compute "
                         f"capability {s.gpu_major}.x: name "
                         f"{_alternatives(s, name)} in {flag}.")
        if not cls.dcp_reads(s.kv_cache_dtype, s.gpu_major):
            where = (f" on sm{s.gpu_major}0" if s.gpu_major in cls.dcp_unquantized_on
                     else "")
            fix = "auto" if cls.dcp_reads("auto", s.gpu_major) else "fp8"
            what = "a bf16/fp16" if fix == "auto" else "an fp8"
            found.append(
                f"{name}{where} reads {what} KV cache only, not {s.kv_cache_dtype}: "
                f"use --kv-cache-dtype {fix}" + (
                    f', or "kv_cache_dtype": "{fix}" in --speculative-config for '
                    "the draft's layers" if s.draft else "")
                + (f"; or name {_alternatives(s, name)} in {flag}."
                   if s.gpu_major is not None else "."))  # CPU: CPU_MLA alone
        dspark = s.speculative_method == "dspark" and s.dcp_size > 1
        if s.draft and dspark and not cls.supports_non_causal_dcp():  # type: ignore[attr-defined]
            found.append(
                f"{name} has no non-causal attention for the DSpark draft's block "
                f"under DCP: name {_alternatives(s, name)} in {flag}, or leave it "
                "out.")
        if (s.num_speculative_tokens and s.dcp_size > 1 and s.interleave > 1
                and not spec_decodes_at_any_interleave(cls)):
            found.append(
                f"{name} decodes speculative tokens under decode context "
                f"parallelism at --cp-kv-cache-interleave-size 1 only, not "
                f"{s.interleave} (vLLM's model runner refuses its impl): use "
                f"--cp-kv-cache-interleave-size 1, or leave {flag} out (vLLM then "
                "picks a backend that serves this interleave).")
        limit = cls.dcp_max_query_len
        if limit is not None and s.max_decode_query_len > limit:
            found.append(
                f"{name} decodes at most {limit} query tokens per request, this "
                f"setting needs {s.max_decode_query_len}: set num_speculative_tokens "
                f"<= {s.num_speculative_tokens - (s.max_decode_query_len - limit)} "
                "in --speculative-config.")
        for what, got, allowed in (
                ("a kv_lora_rank + qk_rope_head_dim latent of",
                 (s.kv_lora_rank, s.qk_rope_head_dim),
                 cls.dcp_latent and [cls.dcp_latent]),
                ("qk_nope_head_dim in", s.qk_nope_head_dim, cls.dcp_qk_nope_head_dims),
                ("v_head_dim in", s.v_head_dim, cls.dcp_v_head_dims)):
            if allowed and got not in allowed:
                found.append(f"{name} needs {what} {tuple(allowed)}, the model has "
                             f"{got}: name another backend in {flag}.")
        return found


class DCPSelection(DCPLimits):
    """``DCPLimits`` whose selection by vLLM (``validate_configuration``)
    declines, under DCP, a setting ``dcp_problems`` refuses, so that vLLM's
    order moves on (or a named backend is refused with those reasons). The
    block size is vLLM's to judge: its own hooks at selection, its
    block-size code and ``validate_block_size`` after."""

    @classmethod
    def validate_configuration(cls, head_size, dtype, kv_cache_dtype, block_size,
                               *args, **kwargs) -> list[str]:
        vllm_config = get_current_vllm_config()
        reasons = super().validate_configuration(  # type: ignore[misc]
            head_size, dtype, kv_cache_dtype, block_size, *args, **kwargs)
        capability = kwargs.get("device_capability")
        if (current_dcp_size() == 1 or vllm_config.model_config is None
                or capability is None):
            return reasons
        draft = bool(kwargs.get("use_non_causal")) or getattr(
            vllm_config.attention_config, "use_non_causal", False)
        setting = DCPSetting.from_vllm_config(vllm_config, capability.major,
                                              draft=draft)
        if kv_cache_dtype is not None:
            setting = dataclasses.replace(setting, kv_cache_dtype=str(kv_cache_dtype))
        return reasons + [problem for problem in cls.dcp_problems(
            setting, layout=False, kernel_blocks=False) if problem not in reasons]


def _alternatives(s: DCPSetting, exclude: str) -> str:
    """The plugin's backends in vLLM's order on ``s``'s GPU that run its KV
    dtype for its model, by their hooks; TRITON_MLA where none does."""
    if s.gpu_major is None:
        return FALLBACK
    from vllm.platforms.interface import DeviceCapability

    ours = {cls.get_name(): cls for cls in plugin_backends()
            if fixed_block_size(cls) is None}  # not CPU_MLA
    try:
        from vllm.platforms.cuda import _get_backend_priorities
    except ImportError:  # a CPU build of vLLM: the plugin's order
        order = list(ours)
    else:
        order = [backend.name for backend in _get_backend_priorities(
            True, DeviceCapability(s.gpu_major, 0), kv_cache_dtype=s.kv_cache_dtype)]
    names = [name for name in order if name in ours and name not in (exclude, FALLBACK)
             and s.gpu_major in gpu_majors(ours[name])
             and ours[name].dcp_reads(s.kv_cache_dtype, s.gpu_major)
             and (ours[name].supports_non_causal_dcp() or not s.draft)]
    return " or ".join(names) or FALLBACK


def plugin_backend_names() -> tuple[str, ...]:
    from vllm.v1.attention.backends.mla.dcp_vllm_touches import BACKEND_OVERRIDES

    return tuple(name for name, _ in BACKEND_OVERRIDES)


def plugin_backend(name: str) -> type:
    """The plugin's class for backend ``name`` (registered or not)."""
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.attention.backends.mla.dcp_vllm_touches import BACKEND_OVERRIDES

    return resolve_obj_by_qualname(dict(BACKEND_OVERRIDES)[name])


def plugin_backends() -> list[type]:
    """The backend classes the plugin registers (``BACKEND_OVERRIDES``) that
    import in this process (a GPU backend's module may not on a CPU)."""
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.attention.backends.mla.dcp_vllm_touches import BACKEND_OVERRIDES

    found = []
    for _, path in BACKEND_OVERRIDES:
        try:
            found.append(resolve_obj_by_qualname(path))
        except (ImportError, OSError, AssertionError, RuntimeError):
            continue
    return found


def layout_problems(s: DCPSetting, cls=None) -> list[str]:
    """-dcp against -tp, and the interleave against the block size (the
    backend class ``cls``'s fixed size, where vLLM fixes it)."""
    problems = []
    if s.dcp_size > 1 and s.tensor_parallel_size % s.dcp_size:
        problems.append(
            f"--decode-context-parallel-size (-dcp) {s.dcp_size} must divide "
            f"--tensor-parallel-size (-tp) {s.tensor_parallel_size}: change -dcp "
            "or -tp.")
    if s.dcp_size == 1 or s.block_size % s.interleave == 0:
        return problems
    if cls is not None and fixed_block_size(cls):
        divisors = tuple(d for d in range(1, s.block_size + 1)
                         if s.block_size % d == 0)
        problems.append(
            f"--cp-kv-cache-interleave-size {s.interleave} must divide the KV "
            f"block size, which {cls.get_name()} fixes to {s.block_size} (vLLM "
            f"overrides --block-size there): use --cp-kv-cache-interleave-size "
            f"in {divisors}.")
        return problems
    sizes = kernel_block_sizes(cls) if cls is not None else (64,)
    problems.append(
        f"--cp-kv-cache-interleave-size {s.interleave} must divide the "
        f"KV-cache block size, {s.block_size} here: pass --block-size "
        f"{math.lcm(s.interleave, max(sizes))} (a multiple of the interleave), "
        "or a smaller --cp-kv-cache-interleave-size.")
    return problems


def problems(cls, s: DCPSetting, **kwargs) -> list[str]:
    """Why backend class ``cls`` cannot run setting ``s``: its own
    ``dcp_problems``; for a vLLM backend the plugin does not register, that
    vLLM's builders refuse DSpark's multi-token queries under DCP."""
    if isinstance(cls, type) and issubclass(cls, DCPLimits):
        return cls.dcp_problems(s, **kwargs)
    if s.speculative_method != "dspark" or s.dcp_size == 1:
        return []
    flag = DRAFT_FLAG if s.draft else TARGET_FLAG
    return [f"vLLM's {cls.get_name()} has no DSpark multi-token queries under "
            f"decode context parallelism (it refuses them in the workers, after "
            f"the weights load): name {_alternatives(s, cls.get_name())} in "
            f"{flag}, leave it out for vLLM's choice, or pass -dcp 1."]


def raise_if_unsupported(cls, setting: DCPSetting, chosen_by: str | None = None,
                         **kwargs) -> None:
    """Raise one ``ValueError`` listing every problem of ``setting`` for
    backend class ``cls`` (``dcp_problems``' ``kwargs``); ``chosen_by``: what
    picked it (a flag), named in it."""
    found = problems(cls, setting, **kwargs)
    if found:
        chosen = f" (chosen by {chosen_by})" if chosen_by else ""
        raise ValueError(f"{cls.get_name()}{chosen} cannot serve this "
                         "configuration:\n  - " + "\n  - ".join(found))


def current_gpu_major() -> int | None:
    from vllm.platforms import current_platform

    capability = current_platform.get_device_capability()
    return None if capability is None else capability.major
