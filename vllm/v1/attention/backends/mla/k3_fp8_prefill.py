# SPDX-License-Identifier: Apache-2.0
"""Kimi-K3's prefill over a plain fp8 KV cache where vLLM has no fp8 query.

Kimi-K3's MLA layer (``vllm/models/kimi_k3/nvidia/mla.py``) prefills a plain
per-tensor fp8 cache (``--kv-cache-dtype fp8``) only with an fp8 prefill
query, and vLLM quantizes the prefill query only on device capability 10.x
with an fp8-capable MLA prefill backend (``backend_supports_prefill_query_
quantization``) and ``use_prefill_query_quantization``. Elsewhere the layer's
``_forward_prefill_fused`` fails the first prompt with "Kimi-K3 fp8 KV cache
requires an fp8 prefill query" (vLLM issue #51313, on Hopper).

Two answers, one per generation:

* sm100: vLLM's own path runs once the prefill backend and the query
  quantization are named (vLLM PR #52188's ``--attention-config``).
  ``prefill_query_problem`` is the start-up check that says so before the
  model loads; the plugin does not pick a prefill backend for the user.
* Off Blackwell (sm90): ``forward_prefill_bf16_query`` prefills as vLLM's
  generic ``MLAAttention`` does for an fp8 cache without an fp8 query: the
  new tokens attend in the model dtype to their own unquantized keys and
  values, their latent goes into the cache as fp8 (the impl's
  ``do_kv_cache_update``, with the layer's ``_k_scale``), and the chunked context is read back
  dequantized (the layer's ``_compute_prefill_context``, or under DCP the
  impl's context-parallel path, both of which gather a plain fp8 cache with
  ``gather_and_maybe_dequant_cache`` for a model-dtype query).
  ``install`` routes the layer's ``_forward_prefill_fused`` there exactly
  where vLLM's path would fail: a plain fp8 cache, a prefill query that is
  not fp8, not on device capability 10.x.
"""

from __future__ import annotations

import functools

# vLLM's MLA prefill backends that take an fp8 query (those named by
# ``backend_supports_prefill_query_quantization``, device capability 10.x).
FP8_QUERY_PREFILL_BACKENDS = ("FLASHINFER", "TRTLLM_RAGGED", "TOKENSPEED_MLA")
# What vLLM PR #52188 serves Kimi-K3 with on sm100 over an fp8 cache.
SM100_FP8_PREFILL_ATTENTION_CONFIG = (
    '{"mla_prefill_backend":"TRTLLM_RAGGED","use_prefill_query_quantization":true}')
# Models whose attention is Kimi-K3's ``MultiHeadLatentAttention`` and which
# prefill (the K3 DSpark draft, ``K3DSparkModel``, only decodes blocks).
K3_PREFILL_ARCHITECTURES = frozenset({
    "KimiK3ForConditionalGeneration", "KimiK31ForConditionalGeneration",
    "KimiLinearForCausalLM", "KimiK3MTPModel",
})
_MARK = "_dcp_dspark_k3_fp8_prefill"


def is_plain_fp8(kv_cache_dtype: str) -> bool:
    """A per-tensor-scaled fp8 cache (not DeepSeek's ``fp8_ds_mla``)."""
    return str(kv_cache_dtype).startswith("fp8") and kv_cache_dtype != "fp8_ds_mla"


def prefill_query_problem(vllm_config, gpu_major: int | None) -> str | None:
    """Why Kimi-K3's first prompt would fail on an sm``gpu_major``0 GPU with
    ``vllm_config`` (None if it would not): on sm100 a plain fp8 cache with
    a prefill that vLLM leaves in bf16. Off sm100 ``install``'s path runs."""
    if gpu_major != 10 or not is_plain_fp8(vllm_config.cache_config.cache_dtype):
        return None
    model = vllm_config.model_config
    architectures = getattr(getattr(model, "hf_config", None), "architectures",
                            None) or ()
    if not K3_PREFILL_ARCHITECTURES.intersection(architectures):
        return None
    attention = vllm_config.attention_config
    backend = attention.mla_prefill_backend
    if (attention.use_prefill_query_quantization and backend is not None
            and backend.name in FP8_QUERY_PREFILL_BACKENDS):
        return None
    named = (f"mla_prefill_backend {backend.name}" if backend is not None
             else "no mla_prefill_backend (vLLM picks FLASH_ATTN for Kimi-K3)")
    return (
        f"Kimi-K3 with --kv-cache-dtype {vllm_config.cache_config.cache_dtype} "
        "on sm100 prefills with an fp8 query only, which vLLM gives with an "
        f"fp8 MLA prefill backend ({', '.join(FP8_QUERY_PREFILL_BACKENDS)}) and "
        "use_prefill_query_quantization; this config has "
        f"{named} and use_prefill_query_quantization "
        f"{str(attention.use_prefill_query_quantization).lower()}, so the first "
        "prompt would fail. Pass --attention-config "
        f"'{SM100_FP8_PREFILL_ATTENTION_CONFIG}' (as vLLM PR #52188 serves "
        "Kimi-K3), or --kv-cache-dtype auto.")


def needs_bf16_query_prefill(layer, prefill_metadata) -> bool:
    """Whether vLLM's K3 prefill cannot run ``layer`` here: a plain fp8
    cache, a prefill query vLLM left unquantized, not on capability 10.x
    (where the start-up check has asked for the fp8 query instead)."""
    from vllm.platforms import current_platform

    return (is_plain_fp8(layer.kv_cache_dtype)
            and prefill_metadata.q_data_type != current_platform.fp8_dtype()
            and not current_platform.is_device_capability_family(100))


def forward_prefill_bf16_query(layer, q, kv_c_normed, k_pe, positions,
                               cos_sin_cache, slot_mapping, attn_metadata,
                               out) -> None:
    """Prefill ``layer``'s new tokens over its plain fp8 cache, query and
    new keys in the model dtype, as ``_forward_prefill_fused`` is called.

    Args:
        q: [T, H, qk_nope + qk_rope] query, model dtype (RoPE not yet applied).
        kv_c_normed: [T, kv_lora_rank] normalized latent, model dtype.
        k_pe: [T, 1, qk_rope] rope key, model dtype (not yet rotated).
        positions, cos_sin_cache: RoPE inputs, both None for NoPE layers.
        slot_mapping: [T] int64 cache slots of the new tokens.
        out: [T, H * v_head_dim] written in place (model dtype).
    """
    from vllm import _custom_ops as ops
    from vllm.models.kimi_k3.nvidia.ops.fused_mla_key_concat_kv_cache import (
        fused_mla_kv_concat,
    )
    from vllm.v1.attention.ops.merge_attn_states import merge_attn_states

    prefill = attn_metadata.prefill
    has_context = prefill.chunked_context is not None
    heads, nope, v_dim = layer.num_local_heads, layer.qk_nope_head_dim, layer.v_head_dim

    if cos_sin_cache is not None:
        # GPT-J RoPE on q and k_pe in place, from the fp32 table the fused
        # epilogue reads (the DSpark draft's context insert calls it so too).
        ops.rotary_embedding(positions, q[..., nope:], k_pe,
                             layer.qk_rope_head_dim, cos_sin_cache, False)
    kv_nope = layer.kv_b_proj(kv_c_normed)[0].view(-1, heads, nope + v_dim)
    k_nope, v = kv_nope.split([nope, v_dim], dim=-1)
    k = fused_mla_kv_concat(k_nope, k_pe)
    # vLLM's MLA cache write: the latent quantized with the layer's _k_scale.
    layer.impl.do_kv_cache_update(kv_c_normed, k_pe, layer.kv_cache, slot_mapping,
                                  layer.kv_cache_dtype, layer._k_scale)

    writes_out = not has_context and prefill.prefill_backend.supports_out()
    new_tokens = prefill.prefill_backend.run_prefill_new_tokens(
        q=q, k=k, v=v, return_softmax_lse=has_context,
        out=out.view(-1, heads, v_dim) if writes_out else None)
    if not has_context:
        if not writes_out:
            out.copy_(new_tokens[..., :v_dim].flatten(start_dim=-2))
        return
    if layer.dcp_world_size > 1:
        context_out, context_lse = layer.impl._context_parallel_compute_prefill_context(
            q, layer._attn_read_kv_cache(), attn_metadata, k_scale=layer._k_scale,
            dcp_world_size=layer.dcp_world_size,
            fused_mla_kv_concat_fn=layer._fused_mla_kv_concat)
    else:
        context_out, context_lse = layer._compute_prefill_context(q, attn_metadata)
    suffix_out, suffix_lse = new_tokens
    merge_attn_states(output=out.view(-1, heads, v_dim),
                      prefix_output=context_out[..., :v_dim], prefix_lse=context_lse,
                      suffix_output=suffix_out[..., :v_dim], suffix_lse=suffix_lse)


def install() -> bool:
    """Route Kimi-K3's ``_forward_prefill_fused`` to
    ``forward_prefill_bf16_query`` where ``needs_bf16_query_prefill``."""
    from vllm.models.kimi_k3.nvidia.mla import MultiHeadLatentAttention

    upstream = MultiHeadLatentAttention._forward_prefill_fused
    if getattr(upstream, _MARK, False):
        return True

    @functools.wraps(upstream)
    def _forward_prefill_fused(self, q, kv_c_normed, k_pe, positions,
                               cos_sin_cache, slot_mapping, attn_metadata, out):
        if needs_bf16_query_prefill(self, attn_metadata.prefill):
            return forward_prefill_bf16_query(self, q, kv_c_normed, k_pe, positions,
                                              cos_sin_cache, slot_mapping,
                                              attn_metadata, out)
        return upstream(self, q, kv_c_normed, k_pe, positions, cos_sin_cache,
                        slot_mapping, attn_metadata, out)

    setattr(_forward_prefill_fused, _MARK, True)
    MultiHeadLatentAttention._forward_prefill_fused = _forward_prefill_fused
    return True
