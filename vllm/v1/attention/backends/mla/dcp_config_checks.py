# SPDX-License-Identifier: Apache-2.0
"""Start-up checks of the DCP x DSpark MLA backends.

Every unsupported combination of backend, GPU generation, DCP size,
interleave, KV-cache dtype, query length and head dims is reported at
start-up as a ``ValueError`` that names the flag to change, never as a wrong
answer or a crash inside a kernel. ``dcp_startup_checks`` runs these checks
when vLLM builds its config, before any worker starts; the builders and
backend selection run them again as a second line.
"""

from __future__ import annotations

from vllm.v1.attention.backends.mla.dcp_settings import DCPSetting

FLASHINFER_MLA = "FLASHINFER_MLA"
TOKENSPEED_MLA = "TOKENSPEED_MLA"
CPU_MLA = "CPU_MLA"
TRITON_MLA = "TRITON_MLA"
FLASHMLA = "FLASHMLA"
FLASH_ATTN_MLA = "FLASH_ATTN_MLA"

# MLA latent layout every kernel here is built for (DeepSeek-V3 / Kimi-K3).
KV_LORA_RANK = 512
QK_ROPE_HEAD_DIM = 64
FLASHINFER_QK_NOPE_HEAD_DIMS = (64, 128, 192)
TOKENSPEED_HEAD_DIMS = (128, 64, 128)  # qk_nope, qk_rope, v
TOKENSPEED_MAX_QUERY_LEN = 8
FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3")
# The kernels' block sizes (their backends' ``get_supported_kernel_block_sizes``),
# read off here so that the config-time check need not import the kernels
# (flashinfer's import queries the GPU, which must not happen in vLLM's
# front-end process).
KERNEL_BLOCK_SIZES = {FLASHINFER_MLA: (32, 64), TOKENSPEED_MLA: (32, 64),
                      FLASHMLA: (64,),
                      # any multiple of 16: vLLM's default stands (16 or 64)
                      FLASH_ATTN_MLA: (16, 64)}


# vLLM's hybrid alignment (``Platform._align_hybrid_block_size``): an MLA
# model with recurrent-state layers (Kimi-K3's KDA) gets a block size that is
# a multiple of 128 (and at least the one it had), so that the attention
# page covers the state's; it may override --block-size.
HYBRID_MLA_BLOCK_ALIGNMENT = 128


def default_block_size(backend: str) -> int:
    """The block size vLLM gives ``backend`` without --block-size: vLLM's
    default (16 in 0.32, 64 in 0.34) if the kernel takes it, else the
    kernel's smallest (vLLM's ``get_preferred_block_size`` rule)."""
    from vllm.config.cache import CacheConfig

    sizes = KERNEL_BLOCK_SIZES[backend]
    default = CacheConfig.DEFAULT_BLOCK_SIZE
    return default if default in sizes else min(sizes)


def aligns_hybrid_block_size(vllm_config) -> bool:
    """Whether vLLM aligns this model's block size for its recurrent-state
    layers (``HYBRID_MLA_BLOCK_ALIGNMENT``): a hybrid MLA model (GPU platforms;
    vLLM's CPU platform fixes MLA's block size itself)."""
    model = getattr(vllm_config, "model_config", None)
    return bool(model is not None and model.use_mla
                and getattr(model, "is_hybrid", False))


def backend_block_size(backend: str, block_size: int | None,
                       vllm_config=None) -> int:
    """The block size vLLM pages ``backend`` with, from the ``block_size``
    its selector passes (``--block-size`` if given, else None: the config
    then still holds CacheConfig's provisional default, and a worker later
    gives the backend ``default_block_size``).

    For a hybrid MLA model (``vllm_config``, ``aligns_hybrid_block_size``)
    the size vLLM's alignment then sets, which is a multiple of the value
    returned: that, not the provisional or a smaller --block-size, is what
    the layers are paged with, whatever the selector passed.
    """
    if vllm_config is not None and aligns_hybrid_block_size(vllm_config):
        return hybrid_aligned_block_size(block_size)
    return default_block_size(backend) if block_size is None else block_size


def hybrid_aligned_block_size(block_size: int | None) -> int:
    """The block size vLLM's hybrid alignment leaves ``block_size`` at."""
    return max(block_size or 0, HYBRID_MLA_BLOCK_ALIGNMENT)


def selection_block_size(block_size: int | None) -> int | None:
    """The block size a DCP backend's selection judges for the current
    config: ``backend_block_size``'s under DCP for a hybrid MLA model (the
    selector passes the provisional 16 of a draft's rebuilt cache config as
    if given, and None elsewhere), else the selector's own."""
    from vllm.config import get_current_vllm_config

    from vllm.v1.attention.backends.mla.dcp_compat import current_dcp_size

    vllm_config = get_current_vllm_config()
    if current_dcp_size() > 1 and aligns_hybrid_block_size(vllm_config):
        return hybrid_aligned_block_size(block_size)
    return block_size


class PagedBlockSizeSelection:
    """Mixin for a DCP backend class (first in its bases): vLLM's selection
    (``validate_configuration``) judges the block size the layers will be
    paged with, ``selection_block_size``: under DCP vLLM's hybrid alignment
    for Kimi-K3 (KDA layers), not the provisional size a DSpark draft's
    rebuilt cache config passes."""

    @classmethod
    def validate_configuration(cls, head_size, dtype, kv_cache_dtype, block_size,
                               *args, **kwargs) -> list[str]:
        return super().validate_configuration(  # type: ignore[misc]
            head_size, dtype, kv_cache_dtype, selection_block_size(block_size),
            *args, **kwargs)


def _dcp_divides_tp(s: DCPSetting) -> list[str]:
    if s.dcp_size > 1 and s.tensor_parallel_size % s.dcp_size:
        return [
            f"--decode-context-parallel-size (-dcp) {s.dcp_size} must divide "
            f"--tensor-parallel-size (-tp) {s.tensor_parallel_size}: change -dcp "
            "or -tp."]
    return []


def _interleave_divides_block(s: DCPSetting) -> bool:
    return s.dcp_size == 1 or s.block_size % s.interleave == 0


def kernel_block_problems(backend: str, s: DCPSetting) -> list[str]:
    """The block size a layer is selected at against the backend's kernel
    block sizes (vLLM's ``supports_block_size``: a multiple of one of them).
    A start-up check: a builder's group has a block size its backend took."""
    sizes = KERNEL_BLOCK_SIZES[backend]
    if s.dcp_size > 1 and all(s.block_size % size for size in sizes):
        return [f"{backend} pages the KV cache by {' or '.join(map(str, sizes))} "
                f"tokens, not {s.block_size}: pass --block-size "
                f"{max(sizes)}."]
    return []


def _layout_problems(s: DCPSetting) -> list[str]:
    problems = _dcp_divides_tp(s)
    if not _interleave_divides_block(s):
        problems.append(
            f"--cp-kv-cache-interleave-size {s.interleave} must divide "
            f"the KV-cache block size, {s.block_size} here: pass --block-size "
            f"a multiple of {s.interleave}, or a smaller "
            "--cp-kv-cache-interleave-size.")
    return problems


def cpu_problems(s: DCPSetting) -> list[str]:
    """Why CPU_MLA with DCP cannot run this setting (none: [])."""
    problems = _dcp_divides_tp(s)
    if not _interleave_divides_block(s):
        # vLLM's CPU platform sets MLA's block size, whatever --block-size says.
        divisors = [d for d in range(1, s.block_size + 1) if s.block_size % d == 0]
        problems.append(
            f"--cp-kv-cache-interleave-size {s.interleave} must divide the KV "
            f"block size, which CPU_MLA fixes to {s.block_size} (vLLM overrides "
            f"--block-size on CPU): use --cp-kv-cache-interleave-size in "
            f"{tuple(divisors)}.")
    if s.kv_cache_dtype != "auto":
        problems.append(
            f"CPU_MLA reads an unquantized KV cache, not {s.kv_cache_dtype}: use "
            "--kv-cache-dtype auto.")
    if (s.kv_lora_rank, s.qk_rope_head_dim) != (KV_LORA_RANK, QK_ROPE_HEAD_DIM):
        problems.append(
            f"CPU_MLA needs a {KV_LORA_RANK} + {QK_ROPE_HEAD_DIM} latent cache, "
            f"the model has {s.kv_lora_rank} + {s.qk_rope_head_dim}: no CPU "
            "backend serves it with DCP; drop -dcp.")
    return problems


def flashinfer_problems(s: DCPSetting) -> list[str]:
    """Why FLASHINFER_MLA with DCP/DSpark cannot run this setting (none: [])."""
    problems = _layout_problems(s)
    if s.gpu_major not in (9, 10):
        problems.append(
            f"FLASHINFER_MLA runs on sm90 (Hopper) and sm100 (Blackwell) GPUs, "
            f"not compute capability {s.gpu_major}.x: choose another backend "
            "with --attention-backend.")
    if s.gpu_major == 9 and s.kv_cache_dtype in FP8_KV_CACHE_DTYPES:
        problems.append(
            f"FLASHINFER_MLA on sm90 reads a bf16/fp16 KV cache, not "
            f"{s.kv_cache_dtype}: use --kv-cache-dtype auto, or keep the draft's "
            "layers unquantized with \"kv_cache_dtype\": \"auto\" in "
            "--speculative-config.")
    if s.qk_nope_head_dim not in FLASHINFER_QK_NOPE_HEAD_DIMS:
        problems.append(
            f"FLASHINFER_MLA needs qk_nope_head_dim in "
            f"{FLASHINFER_QK_NOPE_HEAD_DIMS}, the model has {s.qk_nope_head_dim}: "
            "choose another backend with --attention-backend.")
    if (s.kv_lora_rank, s.qk_rope_head_dim) != (KV_LORA_RANK, QK_ROPE_HEAD_DIM):
        problems.append(
            f"FLASHINFER_MLA needs a {KV_LORA_RANK} + {QK_ROPE_HEAD_DIM} latent "
            f"cache, the model has {s.kv_lora_rank} + {s.qk_rope_head_dim}: "
            "choose another backend with --attention-backend.")
    return problems


def tokenspeed_problems(s: DCPSetting) -> list[str]:
    """Why TOKENSPEED_MLA with DCP/DSpark cannot run this setting (none: [])."""
    problems = _layout_problems(s)
    if s.gpu_major != 10:
        problems.append(
            f"TOKENSPEED_MLA runs on sm100 (Blackwell) GPUs only, not compute "
            f"capability {s.gpu_major}.x: use --attention-backend FLASHINFER_MLA "
            "on Hopper.")
    if s.kv_cache_dtype not in FP8_KV_CACHE_DTYPES:
        problems.append(
            f"TOKENSPEED_MLA reads an fp8 KV cache only, not {s.kv_cache_dtype}: "
            "use --kv-cache-dtype fp8.")
    excess = s.max_decode_query_len - TOKENSPEED_MAX_QUERY_LEN
    if excess > 0:
        problems.append(
            f"TOKENSPEED_MLA decodes at most {TOKENSPEED_MAX_QUERY_LEN} query "
            f"tokens per request, this setting needs {s.max_decode_query_len}: "
            "set num_speculative_tokens <= "
            f"{s.num_speculative_tokens - excess} in --speculative-config.")
    dims = (s.qk_nope_head_dim, s.qk_rope_head_dim, s.v_head_dim)
    if dims != TOKENSPEED_HEAD_DIMS or s.kv_lora_rank != KV_LORA_RANK:
        problems.append(
            f"TOKENSPEED_MLA needs (qk_nope, qk_rope, v) head dims "
            f"{TOKENSPEED_HEAD_DIMS} and kv_lora_rank {KV_LORA_RANK}, the model "
            f"has {dims} and {s.kv_lora_rank}: choose another backend with "
            "--attention-backend.")
    return problems


def flashmla_problems(s: DCPSetting) -> list[str]:
    """Why FLASHMLA with DCP/DSpark cannot run this setting (none: []).

    vLLM's FlashMLA dense decode: Hopper, a 512 + 64 latent, pages of 64, bf16
    or fp8 KV (vLLM's own checks); here the DCP layout and the GPU."""
    problems = _layout_problems(s)
    if s.gpu_major != 9:
        problems.append(
            f"FLASHMLA's dense decode runs on sm90 (Hopper) GPUs only, not "
            f"compute capability {s.gpu_major}.x: choose another backend with "
            "--attention-backend.")
    if (s.kv_lora_rank, s.qk_rope_head_dim) != (KV_LORA_RANK, QK_ROPE_HEAD_DIM):
        problems.append(
            f"FLASHMLA needs a {KV_LORA_RANK} + {QK_ROPE_HEAD_DIM} latent cache, "
            f"the model has {s.kv_lora_rank} + {s.qk_rope_head_dim}: choose "
            "another backend with --attention-backend.")
    return problems


def triton_problems(s: DCPSetting) -> list[str]:
    """Why TRITON_MLA with DCP/DSpark cannot run this setting (none: []).

    Only the DCP layout: vLLM's kernel takes any head dims, block size
    (multiple of 16, vLLM's own check) and its KV-cache dtypes on every GPU
    it selects it for."""
    return _layout_problems(s)


def flashattn_dspark_problem(s: DCPSetting) -> str | None:
    """Why vLLM's FLASH_ATTN_MLA builder refuses this setting at model load:
    it serves DSpark's multi-token queries under DCP at interleave 1 only
    (``supports_dcp_with_varlen=(interleave_size == 1)``)."""
    if s.dcp_size > 1 and s.interleave > 1 and s.speculative_method == "dspark":
        return (
            f"FLASH_ATTN_MLA serves DSpark under decode context parallelism at "
            f"--cp-kv-cache-interleave-size 1 only, not {s.interleave}: use "
            "--cp-kv-cache-interleave-size 1, or leave --attention-backend "
            "out (vLLM then picks a backend that serves this interleave).")
    return None


def flashattn_problems(s: DCPSetting) -> list[str]:
    """Why vLLM's FLASH_ATTN_MLA, named, cannot run this DCP setting (none:
    []): what its selector check and builder refuse at model load."""
    problems = _layout_problems(s)
    if s.kv_cache_dtype not in ("auto", "bfloat16", "float16"):
        problems.append(
            f"FLASH_ATTN_MLA reads a bf16/fp16 KV cache, not {s.kv_cache_dtype}: "
            "use --kv-cache-dtype auto, or leave the backend out (vLLM picks "
            "FLASHMLA for fp8 on Hopper).")
    if s.draft:
        problems.append(
            "FLASH_ATTN_MLA has no non-causal attention for the DSpark draft's "
            "block: drop attention_backend from --speculative-config (or name "
            "FLASHINFER_MLA there).")
    elif (problem := flashattn_dspark_problem(s)) is not None:
        problems.append(problem)
    return problems


PROBLEMS = {FLASHINFER_MLA: flashinfer_problems, TOKENSPEED_MLA: tokenspeed_problems,
            CPU_MLA: cpu_problems, TRITON_MLA: triton_problems,
            FLASHMLA: flashmla_problems, FLASH_ATTN_MLA: flashattn_problems}
# The CUDA backends the start-up checks judge when a flag names them.
NAMED_CUDA_BACKENDS = (FLASHINFER_MLA, TOKENSPEED_MLA, FLASHMLA, FLASH_ATTN_MLA)


def raise_if_unsupported(backend: str, setting: DCPSetting,
                         chosen_by: str | None = None, *,
                         kernel_blocks: bool = False) -> None:
    """Raise one ``ValueError`` listing every problem of ``setting``.

    ``chosen_by``: what picked ``backend`` (a flag), named in the message;
    ``kernel_blocks``: also judge the block size against the kernel's
    (``kernel_block_problems``).
    """
    problems = PROBLEMS[backend](setting)
    if kernel_blocks and backend in KERNEL_BLOCK_SIZES:
        problems += kernel_block_problems(backend, setting)
    if problems:
        chosen = f" (chosen by {chosen_by})" if chosen_by else ""
        raise ValueError(
            f"{backend}{chosen} cannot serve this configuration:\n  - "
            + "\n  - ".join(problems))


def raise_if_layout_unsupported(setting: DCPSetting) -> None:
    """Raise a ``ValueError`` if no backend can lay out this DCP setting."""
    problems = _layout_problems(setting)
    if problems:
        raise ValueError(
            "decode context parallelism cannot run this configuration:\n  - "
            + "\n  - ".join(problems))


def current_gpu_major() -> int | None:
    from vllm.platforms import current_platform

    capability = current_platform.get_device_capability()
    return None if capability is None else capability.major
