# SPDX-License-Identifier: Apache-2.0
"""What each MLA backend serves under DCP x DSpark, and the problems of a
``DCPSetting`` against it.

Each backend class the plugin registers carries its record,
``dcp_limits: ClassVar[DCPLimits]`` (one of ``LIMITS``), beside vLLM's own
hooks on it (``supports_compute_capability``, ``supported_kv_cache_dtypes``,
``get_supported_kernel_block_sizes``, ``supports_non_causal_dcp``: the
record repeats their answers under DCP, ``tests/test_dcp_backend_limits.py``
checks that they agree) and what vLLM has no hook for (interleaves, query
lengths, head dims, DSpark under DCP). The records live here, not in the
backend modules, because the start-up checks read them in vLLM's front-end
process, where importing a backend's kernels would touch the GPU.

``problems`` turns a setting into ``ValueError`` lines naming the flag to
change; the selection hook (``DCPLimitsSelection``), the builders
(``raise_if_unsupported``) and the start-up checks (``dcp_startup_checks``)
all ask it.
"""

from __future__ import annotations

import dataclasses
import math

from vllm.config import get_current_vllm_config
from vllm.v1.attention.backends.mla.dcp_compat import current_dcp_size
from vllm.v1.attention.backends.mla.dcp_settings import DCPSetting

FP8 = ("fp8", "fp8_e4m3")
UNQUANTIZED = ("auto", "float16", "bfloat16")
TARGET_FLAG = "--attention-backend"
DRAFT_FLAG = "attention_backend in --speculative-config"


@dataclasses.dataclass(frozen=True)
class DCPLimits:
    """What one MLA backend serves under DCP x DSpark (``None``: no limit)."""

    name: str
    gpu_majors: tuple[int, ...] | None  # compute capability majors; None: any
    kv_cache_dtypes: tuple[str, ...]  # vLLM's ``supported_kv_cache_dtypes``
    # vLLM's ``get_supported_kernel_block_sizes``: a block size must be a
    # multiple of one of them.
    kernel_block_sizes: tuple[int, ...]
    non_causal: bool = True  # a DSpark draft's block (``supports_non_causal_dcp``)
    dspark: bool = True  # DSpark's multi-token queries under DCP at all
    unquantized_on: tuple[int, ...] = ()  # GPU majors where it reads bf16/fp16 only
    max_query_len: int | None = None  # query tokens per request in one decode
    latent: tuple[int, int] | None = (512, 64)  # kv_lora_rank, qk_rope_head_dim
    qk_nope_head_dims: tuple[int, ...] | None = None
    v_head_dims: tuple[int, ...] | None = None
    dspark_interleave: int | None = None  # the only one it serves DSpark at
    fixed_block_size: int | None = None  # set by vLLM's platform (CPU)
    overridden: bool = True  # registered by the plugin (its selection hook)

    def reads(self, kv_cache_dtype: str, gpu_major: int | None) -> bool:
        if gpu_major in self.unquantized_on:
            return kv_cache_dtype in UNQUANTIZED
        return kv_cache_dtype in self.kv_cache_dtypes

    def pages_by(self, block_size: int) -> bool:
        if self.fixed_block_size is not None:  # vLLM's CPU_MLA: exactly
            return block_size == self.fixed_block_size
        return any(block_size % size == 0 for size in self.kernel_block_sizes)


LIMITS = {limits.name: limits for limits in (
    DCPLimits("FLASHINFER_MLA", (9, 10), UNQUANTIZED + FP8, (32, 64),
              unquantized_on=(9,), qk_nope_head_dims=(64, 128, 192)),
    DCPLimits("TOKENSPEED_MLA", (10,), FP8, (32, 64), max_query_len=8,
              qk_nope_head_dims=(128,), v_head_dims=(128,)),
    DCPLimits("FLASHMLA", (9,), UNQUANTIZED + FP8, (64,)),
    DCPLimits("FLASH_ATTN_MLA", (9,), UNQUANTIZED, (16,), non_causal=False,
              latent=None, dspark_interleave=1),
    DCPLimits("TRITON_MLA", None, UNQUANTIZED + FP8, (16,), latent=None),
    DCPLimits("CPU_MLA", None, ("auto",), (16,), fixed_block_size=16),
    # vLLM's own: its builder refuses DSpark's causal verify under DCP
    # (``supports_dcp_with_varlen``), its selection the non-causal block.
    DCPLimits("CUTLASS_MLA", (10,), UNQUANTIZED + FP8, (128,), non_causal=False,
              dspark=False, latent=None, overridden=False),
)}
FALLBACK = "TRITON_MLA"
FLASHINFER_MLA, TOKENSPEED_MLA, FLASHMLA = "FLASHINFER_MLA", "TOKENSPEED_MLA", "FLASHMLA"
FLASH_ATTN_MLA, TRITON_MLA, CPU_MLA = "FLASH_ATTN_MLA", "TRITON_MLA", "CPU_MLA"


def _alternatives(s: DCPSetting, exclude: str) -> str:
    """The backends that run ``s``'s GPU and KV dtype for its model."""
    names = [name for name, each in LIMITS.items()
             if name not in (exclude, FALLBACK) and each.overridden
             and s.gpu_major in (each.gpu_majors or ())
             and each.reads(s.kv_cache_dtype, s.gpu_major)
             and (each.non_causal or not s.draft)] or [FALLBACK]
    return " or ".join(names)


def layout_problems(s: DCPSetting, limits: DCPLimits | None = None) -> list[str]:
    """-dcp against -tp, and the interleave against the block size."""
    problems = []
    if s.dcp_size > 1 and s.tensor_parallel_size % s.dcp_size:
        problems.append(
            f"--decode-context-parallel-size (-dcp) {s.dcp_size} must divide "
            f"--tensor-parallel-size (-tp) {s.tensor_parallel_size}: change -dcp "
            "or -tp.")
    if s.dcp_size == 1 or s.block_size % s.interleave == 0:
        return problems
    if limits is not None and limits.fixed_block_size:
        divisors = tuple(d for d in range(1, s.block_size + 1)
                         if s.block_size % d == 0)
        problems.append(
            f"--cp-kv-cache-interleave-size {s.interleave} must divide the KV "
            f"block size, which {limits.name} fixes to {s.block_size} (vLLM "
            f"overrides --block-size there): use --cp-kv-cache-interleave-size "
            f"in {divisors}.")
        return problems
    sizes = limits.kernel_block_sizes if limits is not None else (64,)
    works = math.lcm(s.interleave, max(sizes))
    problems.append(
        f"--cp-kv-cache-interleave-size {s.interleave} must divide the "
        f"KV-cache block size, {s.block_size} here: pass --block-size {works} "
        "(a multiple of the interleave), or a smaller "
        "--cp-kv-cache-interleave-size.")
    return problems


def problems(limits: DCPLimits, s: DCPSetting, *, layout: bool = True,
             kernel_blocks: bool = True) -> list[str]:
    """Why ``limits``' backend cannot run setting ``s`` (none: []);
    ``layout``: judge -dcp against -tp and ``s.block_size`` against the
    interleave (not at selection, before vLLM sets the block size);
    ``kernel_blocks``: the block size against the kernel's pages (on a GPU
    vLLM's own block-size code answers that)."""
    name, flag = limits.name, DRAFT_FLAG if s.draft else TARGET_FLAG
    found = layout_problems(s, limits) if layout else []
    if kernel_blocks and s.dcp_size > 1 and not limits.pages_by(s.block_size):
        sizes = " or ".join(map(str, limits.kernel_block_sizes))
        found.append(f"{name} pages the KV cache by {sizes} tokens, not "
                     f"{s.block_size}: pass --block-size "
                     f"{math.lcm(s.interleave, max(limits.kernel_block_sizes))}.")
    if limits.gpu_majors is not None and s.gpu_major not in limits.gpu_majors:
        gpus = " and ".join(f"sm{major}0" for major in limits.gpu_majors)
        found.append(f"{name} runs on {gpus} GPUs only under DCP, not compute "
                     f"capability {s.gpu_major}.x: name "
                     f"{_alternatives(s, name)} in {flag}.")
    if not limits.reads(s.kv_cache_dtype, s.gpu_major):
        where = (f" on sm{s.gpu_major}0" if s.gpu_major in limits.unquantized_on
                 else "")
        fix = "auto" if limits.reads("auto", s.gpu_major) else "fp8"
        what = "a bf16/fp16" if fix == "auto" else "an fp8"
        found.append(
            f"{name}{where} reads {what} KV cache only, not {s.kv_cache_dtype}: "
            f"use --kv-cache-dtype {fix}" + (
                f', or "kv_cache_dtype": "{fix}" in --speculative-config for '
                "the draft's layers" if s.draft else "")
            + f"; or name {_alternatives(s, name)} in {flag}.")
    dspark = s.speculative_method == "dspark" and s.dcp_size > 1
    if dspark and not limits.dspark:
        found.append(
            f"vLLM's {name} has no DSpark multi-token queries under decode "
            f"context parallelism (it refuses them in the workers, after the "
            f"weights load): name {_alternatives(s, name)} in {flag}, leave it "
            "out for vLLM's choice, or pass -dcp 1.")
    elif s.draft and dspark and not limits.non_causal:
        found.append(
            f"{name} has no non-causal attention for the DSpark draft's block "
            f"under DCP: name {_alternatives(s, name)} in {flag}, or leave it "
            "out.")
    elif (dspark and limits.dspark_interleave is not None
          and s.interleave != limits.dspark_interleave):
        found.append(
            f"{name} serves DSpark under decode context parallelism at "
            f"--cp-kv-cache-interleave-size {limits.dspark_interleave} only, not "
            f"{s.interleave}: use --cp-kv-cache-interleave-size "
            f"{limits.dspark_interleave}, or leave {flag} out (vLLM then picks "
            "a backend that serves this interleave).")
    excess = (s.max_decode_query_len - limits.max_query_len
              if limits.max_query_len is not None else 0)
    if excess > 0:
        found.append(
            f"{name} decodes at most {limits.max_query_len} query tokens per "
            f"request, this setting needs {s.max_decode_query_len}: set "
            f"num_speculative_tokens <= {s.num_speculative_tokens - excess} in "
            "--speculative-config.")
    for what, got, allowed in (
            ("a kv_lora_rank + qk_rope_head_dim latent of",
             (s.kv_lora_rank, s.qk_rope_head_dim), limits.latent and [limits.latent]),
            ("qk_nope_head_dim in", s.qk_nope_head_dim, limits.qk_nope_head_dims),
            ("v_head_dim in", s.v_head_dim, limits.v_head_dims)):
        if allowed and got not in allowed:
            found.append(f"{name} needs {what} {tuple(allowed)}, the model has "
                         f"{got}: name another backend in {flag}.")
    return found


def raise_if_unsupported(backend: str, setting: DCPSetting,
                         chosen_by: str | None = None, **kwargs) -> None:
    """Raise one ``ValueError`` listing every problem of ``setting`` for
    ``backend`` (``problems``' ``kwargs``); ``chosen_by``: what picked it (a
    flag), named in it."""
    found = problems(LIMITS[backend], setting, **kwargs)
    if found:
        chosen = f" (chosen by {chosen_by})" if chosen_by else ""
        raise ValueError(f"{backend}{chosen} cannot serve this configuration:"
                         "\n  - " + "\n  - ".join(found))


class DCPLimitsSelection:
    """Mixin for a DCP backend class (first in its bases) with a
    ``dcp_limits`` record: under DCP vLLM's selection
    (``validate_configuration``) declines a setting the record does not
    serve, so that vLLM's order moves on (or a named backend is refused with
    the record's reasons). The block size is vLLM's to judge: its own hooks
    at selection, its block-size code and ``validate_block_size`` after."""

    dcp_limits: DCPLimits

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
        return reasons + problems(cls.dcp_limits, setting, layout=False,
                                  kernel_blocks=False)


def current_gpu_major() -> int | None:
    from vllm.platforms import current_platform

    capability = current_platform.get_device_capability()
    return None if capability is None else capability.major
