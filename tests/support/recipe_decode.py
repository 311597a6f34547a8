# SPDX-License-Identifier: Apache-2.0
"""A recipe's decode steps after its prompt's prefill, one DCP rank's view.

Inside ``recipe_forward.k3_target_layer`` (the target's Kimi-K3 MLA layer of
a recipe, as on its GPU), ``dspark_draft_layer`` builds the DSpark draft's
MLA layer as vLLM's draft model builds it (``K3DSparkDecoderLayer``, in the
draft config vLLM's ``load_dspark_model`` derives: the draft's backend, KV
dtype and non-causal attention) with the metadata builder the DSpark
speculator makes for it (its ``attn_vllm_config``). Then:

* a verify step: 1 + k causal query tokens per request through the target
  layer's decode path, over the latent the prefill cached;
* a DSpark draft block: k non-causal query tokens per request through the
  draft layer, over a context latent in the draft's cache.

At ``-dcp W`` the step runs on rank 0 of W (``RankPartials``: the layer's
DCP collectives as rank 0 sees them; each gathered query is the rank's own
heads repeated, the shapes of ``-dcp W``), and what the backend hands to
vLLM's combine, the rank's partial output and LSE, is checked against
``reference_partial``: float64 attention over the keys rank 0 holds
(vLLM's DCP layout), per query token its causal or non-causal bound.
"""

from __future__ import annotations

import contextlib
import importlib
import math
from dataclasses import dataclass
from unittest import mock

import torch

from tests.support import recipe_forward as rf
from tests.support import recipe_start as rs
from tests.support.gpu_config import on_cuda_host

FP8 = torch.float8_e4m3fn


class _Captured(Exception):
    pass


def draft_vllm_config(config):
    """The draft's ``VllmConfig`` as vLLM's ``load_dspark_model`` makes it,
    taken at its call of ``get_model`` (the model is not built), on the GPU
    host of the current (CUDA) platform, whose config checks it passes."""
    import vllm.platforms
    from vllm.v1.worker.gpu.spec_decode.dspark.utils import load_dspark_model

    def get_model(*, vllm_config, **kwargs):
        raise _Captured(vllm_config)

    major = vllm.platforms.current_platform.get_device_capability().major
    with on_cuda_host(major), \
            mock.patch("vllm.model_executor.model_loader.get_model", get_model):
        try:
            load_dspark_model(None, config)
        except _Captured as captured:
            return captured.args[0]
    raise AssertionError("load_dspark_model did not build a draft model")


def dspark_draft_layer(k3: rf.K3Layer, *, num_blocks: int = 48,
                       seed: int = 5) -> rf.K3Layer:
    """The draft's first MLA layer, its speculator-made builder and a cache
    of its own KV dtype; call inside ``k3_target_layer``."""
    from vllm.config import set_current_vllm_config
    from vllm.models.kimi_k3.nvidia.dspark_mla import K3DSparkDecoderLayer
    from vllm.v1.worker.utils import AttentionGroup

    config = k3.config
    draft_config = draft_vllm_config(config)
    draft_config.cache_config.block_size = rf.BLOCK_SIZE
    hf = config.speculative_config.draft_model_config.hf_config
    with set_current_vllm_config(draft_config):
        block = K3DSparkDecoderLayer(
            vllm_config=draft_config, config=hf, layer_idx=0,
            start_layer_id=config.model_config.hf_text_config.num_hidden_layers,
            prefix="model")
    layer = block.self_attn
    rf._random_weights(layer, seed)
    rf._process_weights(layer)
    speculator_config = rs._speculator(config).attn_vllm_config
    spec = layer.get_kv_cache_spec(draft_config)
    group = AttentionGroup(layer.get_attn_backend(), [layer.layer_name], spec, 0)
    with set_current_vllm_config(speculator_config):
        group.create_metadata_builders(speculator_config, torch.device("cpu"))
    kv_cache = torch.zeros(num_blocks, rf.BLOCK_SIZE, layer.head_size,
                           dtype=rf._kv_cache_dtype(layer.kv_cache_dtype))
    layer.bind_kv_cache(kv_cache.unsqueeze(1))
    return rf.K3Layer(layer, group, config, kv_cache, k3.prefill, "none")


# ---------------------------------------------------------------------------
# The decode kernels, stood in where vLLM's and the plugin's modules call them

_TAIL_MERGE_USERS = ("vllm.v1.attention.ops.flashmla_dcp_rows",
                     "vllm.v1.attention.ops.flashinfer_sm90_mla")
_TRTLLM_USERS = ("vllm.v1.attention.backends.mla.flashinfer_dcp_mla",
                 "vllm.v1.attention.backends.mla.flashinfer_mla")

# The kernels' GPU workspaces (none on CPU), where each backend allocates it.
_WORKSPACES = (("vllm.v1.attention.backends.mla.flashinfer_dcp_mla", "_get_workspace_buffer"),
               ("vllm.v1.attention.backends.mla.flashinfer_mla", "_get_workspace_buffer"),
               ("vllm.v1.attention.backends.mla.tokenspeed_dcp_mla", "_get_workspace"),
               ("vllm.v1.attention.backends.mla.tokenspeed_mla", "_get_workspace"))


@contextlib.contextmanager
def decode_stand_ins(major: int):
    """The decode kernels of an sm``major``0 recipe: FA3 (FlashInfer's, the
    plan-honouring fake of ``flashinfer_fa3_fake``, on sm90;
    FlashAttention's, ``FlashAttnMLAReference``), the tail launch, FLASHMLA's
    empty-row mask and vLLM's Triton MLA decode (``decode_kernel_stubs``);
    FlashInfer's MLA decode and Tokenspeed's (``kernel_stubs``). FlashMLA is
    ``recipe_forward.kernel_stand_ins``'."""
    from tests.support import decode_kernel_stubs as stubs
    from tests.support.flashinfer_fa3_fake import flashinfer_mla_faked
    from tests.support.kernel_stubs import (TokenspeedMLAReference,
                                            TrtllmMLAReference, import_on_cpu)

    flash_attn = stubs.FlashAttnMLAReference()
    with contextlib.ExitStack() as stack:
        enter = stack.enter_context
        for module in _TAIL_MERGE_USERS:
            owner = import_on_cpu(module)
            enter(mock.patch.object(owner, "tail_merge", stubs.tail_merge))
        # FLASHMLA's token rows / DSpark blocks as heads mask their empty rows.
        enter(mock.patch.object(import_on_cpu("vllm.v1.attention.ops.flashmla_dcp_rows"),
                                "mask_empty_rows", stubs.mask_empty_rows))
        owner = importlib.import_module("vllm.v1.attention.backends.mla.flashattn_mla")
        for name in ("flash_attn_varlen_func", "get_scheduler_metadata"):
            enter(mock.patch.object(owner, name, getattr(flash_attn, name)))
        owner = importlib.import_module("vllm.v1.attention.backends.mla.triton_mla")
        enter(mock.patch.object(owner, "decode_attention_fwd", stubs.decode_attention_fwd))
        # Its split count comes from Triton's helpers (absent on CPU); the
        # stand-in takes no splits.
        enter(mock.patch.object(owner, "_compute_num_kv_splits", lambda *args: 1))
        trtllm = TrtllmMLAReference()
        for module in _TRTLLM_USERS:
            owner = import_on_cpu(module)
            enter(mock.patch.object(owner, "trtllm_batch_decode_with_kv_cache_mla",
                                    trtllm))
        for module, name in _WORKSPACES:
            enter(mock.patch.object(import_on_cpu(module), name,
                                    lambda *args, **kwargs: torch.empty(8, dtype=torch.int8)))
        enter(mock.patch("tokenspeed_mla.tokenspeed_mla_decode", TokenspeedMLAReference()))
        if major == 9:
            enter(flashinfer_mla_faked())
        yield


# ---------------------------------------------------------------------------
# One rank's view of the DCP collectives

class RankPartials:
    """``layer``'s DCP query gather and combine as rank 0 of W runs them
    alone: the gather repeats the rank's heads W times; the combine records
    the backend's partial (out [T, W * h, 512], LSE [T, W * h]) and hands
    the layer back the rank's own heads of it."""

    def __init__(self, layer, world: int):
        self.world = world
        self.out = self.lse = None
        manager = layer.dcp_manager
        manager.query_gather = self._gather
        # The combine may have been wrapped by the plugin's builder (its
        # rows mask); the wrapped collective is the one vLLM would call.
        collective = getattr(manager.combine, "__wrapped__", manager.combine)
        collective.side_effect = self._combine

    def _gather(self, q: torch.Tensor) -> torch.Tensor:
        raw = q.view(torch.uint8) if q.dtype == FP8 else q
        gathered = raw.repeat(1, self.world, 1)
        return gathered.view(FP8) if q.dtype == FP8 else gathered

    def _combine(self, out, lse, *args, **kwargs):
        self.out, self.lse = out.clone(), lse.clone()
        return out[:, :out.shape[1] // self.world].contiguous()


# ---------------------------------------------------------------------------
# The steps

@dataclass
class DecodeStep:
    """Per request: ``context`` tokens already cached, ``new`` query tokens."""

    context: list[int]
    new: list[int]

    def as_prefill_step(self) -> rf.PrefillStep:
        return rf.PrefillStep(self.context, self.new)


def fill_context(k3: rf.K3Layer, table: torch.Tensor, context: list[int],
                 seed: int) -> torch.Tensor:
    """Random context latents (as the draft's context KV precompute stores
    them) at rank 0's slots of ``k3``'s cache. Returns their values, all
    positions (the other ranks' too): [R, max(context), 576] float64 (fp8
    times ``_k_scale``)."""
    world = k3.config.parallel_config.decode_context_parallel_size
    interleave = k3.config.parallel_config.cp_kv_cache_interleave_size
    generator = torch.Generator().manual_seed(seed)
    latent = torch.randn(len(context), max(context), k3.layer.head_size,
                         generator=generator) * 0.5
    latent = latent.to(FP8 if k3.kv_cache.dtype == torch.uint8 else k3.kv_cache.dtype)
    cache = k3.kv_cache.view(FP8) if k3.kv_cache.dtype == torch.uint8 else k3.kv_cache
    for r, length in enumerate(context):
        position = torch.arange(length)
        mine = (position // interleave) % world == 0
        local = ((position // (interleave * world)) * interleave
                 + position % interleave)[mine]
        blocks = table[r, local // rf.BLOCK_SIZE].long()
        cache[blocks, local % rf.BLOCK_SIZE] = latent[r, :length][mine]
    if k3.kv_cache.dtype == torch.uint8:
        return latent.double() * float(k3.layer._k_scale)
    return latent.double()


def run_decode(k3: rf.K3Layer, step: DecodeStep, inputs: rf.PrefillInputs,
               table: torch.Tensor, *, causal: bool) -> RankPartials | torch.Tensor:
    """``step`` through ``k3``'s decode path: at ``-dcp W`` > 1 the rank's
    partials (``RankPartials``), else the layer's output [T, H * v]."""
    world = k3.config.parallel_config.decode_context_parallel_size
    partials = RankPartials(k3.layer, world) if world > 1 else None
    out = rf.run_step(k3, step.as_prefill_step(), inputs, table, decode=True,
                      causal=causal)
    return partials if partials is not None else out


# ---------------------------------------------------------------------------
# The reference

def kernel_query(k3: rf.K3Layer, inputs: rf.PrefillInputs) -> torch.Tensor:
    """[T, H, 576] float64: the query the decode kernel should get,
    ``[q_nope W_UK | q_pe]`` (RoPE'd for a draft layer), fp8-rounded with
    ``_q_scale`` over an fp8 cache."""
    layer = k3.layer
    q_nope, q_pe = inputs.q.split([layer.qk_nope_head_dim, layer.qk_rope_head_dim], -1)
    ql = torch.bmm(q_nope.transpose(0, 1), layer.W_UK_T).transpose(0, 1)
    if layer.rotary_emb is not None:
        q_pe = rf._rope_gptj(q_pe, inputs.positions, layer.rotary_emb.cos_sin_cache)
    mqa_q = torch.cat([ql, q_pe.to(ql.dtype)], dim=-1)
    if k3.kv_cache.dtype == torch.uint8:
        scale = layer._q_scale.float()
        return (mqa_q.float() / scale).to(FP8).double() * float(scale)
    return mqa_q.double()


def step_latent(k3: rf.K3Layer, inputs: rf.PrefillInputs) -> torch.Tensor:
    """[T, 576] float64: the latent the step's tokens should leave in the
    cache (k_pe RoPE'd for a draft layer; fp8 with ``_k_scale``)."""
    layer = k3.layer
    k_pe = inputs.k_pe[:, 0]
    if layer.rotary_emb is not None:
        k_pe = rf._rope_gptj(k_pe, inputs.positions,
                             layer.rotary_emb.cos_sin_cache).to(k_pe.dtype)
    return as_cached(k3, torch.cat([inputs.kv_c_normed, k_pe], dim=-1))


def as_cached(k3: rf.K3Layer, latent: torch.Tensor) -> torch.Tensor:
    """``latent`` as the cache holds it, float64 (fp8 times ``_k_scale``)."""
    if k3.kv_cache.dtype == torch.uint8:
        scale = k3.layer._k_scale.float()
        return (latent.float() / scale).to(FP8).double() * float(scale)
    return latent.to(k3.kv_cache.dtype).double()


def reference_partial(k3: rf.K3Layer, q: torch.Tensor, latent: torch.Tensor,
                      positions: torch.Tensor, *, causal: bool):
    """Rank 0's partial attention of ``q`` [n, H, 576] (float64, global
    ``positions``) over the keys of ``latent`` [L, 576] (global positions
    0..L-1) that rank 0 holds: (out [n, H, 512], natural-log LSE [n, H]).
    Causal: a token sees keys up to its own position; else all L."""
    config = k3.config.parallel_config
    world, interleave = (config.decode_context_parallel_size,
                         config.cp_kv_cache_interleave_size)
    key = torch.arange(latent.shape[0])
    mine = (key // interleave) % world == 0
    visible = mine[None, :].expand(q.shape[0], -1)
    if causal:
        visible = visible & (key[None, :] <= positions[:, None])
    scores = torch.einsum("qhd,kd->qhk", q, latent) * k3.layer.scale
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("qhk,kd->qhd", torch.softmax(scores, -1),
                       latent[:, :k3.layer.kv_lora_rank])
    return out, lse


def partial_errors(k3: rf.K3Layer, got_out, got_lse, expected_out, expected_lse,
                   world: int) -> tuple[float, float]:
    """(output error relative to the largest output, largest LSE error) of a
    rank's partial (``got_out`` [n, W * h, 512], ``got_lse`` [n, W * h], the
    gathered heads the rank's h repeated) against the reference of its h
    heads; the kernel's LSE read in the base the layer tells vLLM's combine."""
    got_lse = got_lse.double()
    if not k3.layer.impl.lse_base_on_e:
        got_lse = got_lse * math.log(2.0)
    assert got_out.shape[1] == expected_out.shape[1] * world
    out_error = rf.relative_error(got_out, expected_out.repeat(1, world, 1))
    lse_error = (got_lse - expected_lse.repeat(1, world)).abs().max().item()
    return out_error, lse_error


def up_projected(k3: rf.K3Layer, latent_out: torch.Tensor) -> torch.Tensor:
    """[n, H * v]: the latent output [n, H, 512] through the layer's W_UV."""
    return torch.einsum("qhl,hlv->qhv", latent_out,
                        k3.layer.W_UV.double()).flatten(1)


def table_columns(k3: rf.K3Layer, max_columns: int = 20) -> int:
    """Block-table columns a request may use: at most the rank's share of
    ``max_model_len`` (what the DCP builders size at start-up)."""
    config = k3.config
    share = config.model_config.max_model_len // (
        config.parallel_config.decode_context_parallel_size * rf.BLOCK_SIZE)
    return min(max_columns, share)
