# SPDX-License-Identifier: Apache-2.0
"""What vLLM itself will run for a config's MLA layers, asked of vLLM's own
code on a copy of the config before any model loads.

``ask_vllm(vllm_config)`` answers, for the target's MLA layers and a draft
model's (DSpark, MTP, EAGLE, a draft model), per KV-cache dtype among them:

* the backend vLLM's selector (``get_attn_backend``) returns, called as
  vLLM's ``MLAAttention`` calls it (head size, model dtype, the layer's KV
  dtype, ``use_sparse``, heads per rank) under the config the layers are
  built with: the target's, or the draft's as vLLM's loaders derive it
  (``draft_vllm_config``: the draft's own backend and KV dtype, non-causal
  attention for a DSpark block). Every reason vLLM's selection has, the
  installed kernels, the GPU, the plugin's own hooks on its backend classes,
  comes with it; a refusal comes back as vLLM's message.
* the block size vLLM pages them all with: the platform's own
  ``update_block_size_for_backend`` (the backends' preferred size, the hybrid
  alignment to a recurrent state's page, ``--kv-cache-dtype-skip-layers``)
  over stand-in layers that answer with the selected backends, then the
  config's ``validate_block_size`` (DCP's interleave against it), on a copy
  of the cache config;
* what the model runner's ``check_attention_cp_compatibility`` says of the
  selected backends' impls (speculative decoding at an interleave above 1,
  the LSE DCP's combine needs), over the same stand-in layers.

On a GPU the question runs in a spawned child process (``ask_in_child``):
vLLM's selector imports the backend modules it tries, and some allocate on
the GPU at import (CUTLASS MLA's workspace); the process that parses
``vllm serve``'s command line must not hold a CUDA context. A process that
already holds one (a worker rebuilding a draft's config) asks in place.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from dataclasses import dataclass

from vllm.v1.attention.backends.mla.dcp_config_checks import DRAFT_FLAG, TARGET_FLAG
from vllm.v1.attention.backends.mla.dcp_settings import (
    draft_layer_indices,
    reads_kv_cache_dtype_skip_layers,
)


@dataclass(frozen=True)
class LayersAnswer:
    """One model's MLA layers of one KV-cache dtype, and vLLM's pick."""

    draft: bool
    named: str | None  # the backend named for them (by ``flag``)
    flag: str
    kv_cache_dtype: str
    backend: str | None  # vLLM's pick; None where vLLM refused them
    refusal: str | None = None  # vLLM's ValueError


@dataclass(frozen=True)
class VllmAnswer:
    layers: tuple[LayersAnswer, ...]
    block_size: int | None  # None: no pick, or vLLM refused the block size
    block_refusal: str | None = None  # vLLM's error on the block size
    cp_refusal: str | None = None  # vLLM's model runner's, on the picked impls

    @property
    def backends(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(layer.backend for layer in self.layers
                                   if layer.backend is not None))


def _sparse_mla(hf_config) -> bool:
    """Whether vLLM builds this model's MLA layers sparse (an indexer's
    ``index_topk``; DeepSeek-V4's ``compress_ratios``)."""
    return any(hasattr(hf_config, marker)
               for marker in ("index_topk", "compress_ratios"))


def dense_mla_latent(model_config) -> tuple[int, int] | None:
    """``(kv_lora_rank, qk_rope_head_dim)`` of a dense MLA model; None where
    its layers are not dense latent MLA (no ``kv_lora_rank``, or sparse)."""
    hf = getattr(model_config, "hf_text_config", None)
    rank = getattr(hf, "kv_lora_rank", None)
    rope = getattr(hf, "qk_rope_head_dim", None)
    if rank is None or rope is None or _sparse_mla(hf):
        return None
    return rank, rope


def draft_vllm_config(vllm_config):
    """The config a draft model's layers are built under, derived as vLLM's
    loaders derive it (``load_dspark_model``, the EAGLE/MTP proposers'
    draft config): the speculative config's ``attention_backend`` (a
    DeepSeek-V4 DSpark draft: the target's, vLLM's own resolution), its
    ``kv_cache_dtype`` over ``--kv-cache-dtype`` (a rebuilt cache config, whose
    provisional block size then counts as given), non-causal attention for a
    DSpark block. None without a draft model of MLA layers."""
    from vllm.config import replace

    spec = vllm_config.speculative_config
    if (spec is None or spec.draft_model_config is None
            or not spec.uses_draft_kv_cache()
            or not getattr(spec.draft_model_config, "use_mla", False)):
        return None
    attention = vllm_config.attention_config
    backend, non_causal = spec.attention_backend, False
    if spec.method == "dspark":
        from vllm.model_executor.models.qwen3_dflash import dflash_has_any_non_causal
        from vllm.v1.worker.gpu.spec_decode.dspark import utils as dspark

        backend = dspark._resolve_dspark_attention_backend(
            spec.draft_model_config, spec.attention_backend, attention.backend)
        non_causal = dflash_has_any_non_causal(spec.draft_model_config.hf_config)
    draft = copy.copy(vllm_config)
    draft.attention_config = replace(attention, backend=backend,
                                     use_non_causal=non_causal)
    if spec.kv_cache_dtype is not None:
        draft.cache_config = replace(vllm_config.cache_config,
                                     cache_dtype=spec.kv_cache_dtype)
    return draft


def _layer_kv_cache_dtypes(vllm_config, model_config, draft: bool) -> list[str]:
    """The KV-cache dtypes among one model's layers: ``--kv-cache-dtype``
    (the draft config's), and ``auto`` for layers that
    ``--kv-cache-dtype-skip-layers`` names, where the model's layer class
    reads that list."""
    cache = vllm_config.cache_config
    skipped = set(cache.kv_cache_dtype_skip_layers or ())
    indices = (draft_layer_indices(vllm_config) if draft else
               range(vllm_config.model_config.get_total_num_hidden_layers()))
    if not skipped or not reads_kv_cache_dtype_skip_layers(model_config):
        return [str(cache.cache_dtype)]
    found = {"auto" if str(index) in skipped else str(cache.cache_dtype)
             for index in indices}
    return sorted(found)


def select_backend(config, model_config, kv_cache_dtype: str) -> tuple[str | None, str | None]:
    """vLLM's selector for one MLA layer built under ``config``: (backend
    name, None), or (None, vLLM's refusal)."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.selector import get_attn_backend

    latent = dense_mla_latent(model_config)
    head_size = sum(latent) if latent is not None else model_config.get_head_size()
    try:
        with set_current_vllm_config(config):
            backend = get_attn_backend(
                head_size, model_config.dtype, kv_cache_dtype, use_mla=True,
                use_sparse=_sparse_mla(model_config.hf_text_config),
                num_heads=model_config.get_num_attention_heads(config.parallel_config))
    except ValueError as error:
        return None, str(error)
    return backend.get_name(), None


def _layer_groups(vllm_config):
    """(draft, config, model config, flag) of each model's MLA layers."""
    yield False, vllm_config, vllm_config.model_config, TARGET_FLAG
    draft = draft_vllm_config(vllm_config)
    if draft is not None:
        yield (True, draft, vllm_config.speculative_config.draft_model_config,
               DRAFT_FLAG)


@functools.cache
def _selected_layer_cls() -> type:
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    class SelectedLayer(AttentionLayerBase):
        """An MLA layer of a selected backend, as vLLM's block-size code and
        its model runner's CP check see it: its backend, and an impl made
        without ``__init__`` whose DCP size is the config's (vLLM's
        ``__new__`` reads it from the DCP group, which does not exist before
        the workers start)."""

        def __init__(self, backend, dcp_size: int):
            self.backend = backend
            impl_cls = backend.get_impl_cls()
            self.impl = object.__new__(impl_cls)
            self.impl.dcp_world_size = dcp_size
            self.impl.need_to_return_lse_for_decode = (
                dcp_size > 1 and impl_cls.can_return_lse_for_decode)

        def get_attn_backend(self):
            return self.backend

        def get_kv_cache_spec(self, vllm_config):
            return None

    return SelectedLayer


def _probe(vllm_config, backend_names):
    """A copy of ``vllm_config`` whose layers are stand-ins of
    ``backend_names``' layers, its cache config a copy too."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    layer_cls = _selected_layer_cls()
    dcp_size = vllm_config.parallel_config.decode_context_parallel_size
    probe = copy.copy(vllm_config)
    probe.cache_config = copy.deepcopy(vllm_config.cache_config)
    probe.compilation_config = copy.copy(vllm_config.compilation_config)
    probe.compilation_config.static_forward_context = {
        f"dcp_probe.{i}": layer_cls(AttentionBackendEnum[name].get_class(), dcp_size)
        for i, name in enumerate(backend_names)}
    return probe


def _paged_block_size(probe) -> tuple[int | None, str | None]:
    """The block size vLLM's own code pages the probe's layers with; or
    (None, vLLM's error)."""
    from vllm.platforms import current_platform

    try:
        current_platform.update_block_size_for_backend(probe)
        probe.validate_block_size()
    except (AssertionError, ValueError) as error:
        return None, str(error)
    return probe.cache_config.block_size, None


def _cp_refusal(probe) -> str | None:
    """vLLM's model runner's CP check on the probe's layers, or None."""
    from vllm.v1.worker.cp_utils import check_attention_cp_compatibility

    try:
        check_attention_cp_compatibility(probe)
    except AssertionError as error:
        return str(error)
    return None


def ask_vllm(vllm_config) -> VllmAnswer:
    """vLLM's backend for each model's MLA layers and its block size, asked in
    this process (see the module docstring)."""
    layers = []
    for draft, config, model_config, flag in _layer_groups(vllm_config):
        backend = config.attention_config.backend
        for kv_cache_dtype in _layer_kv_cache_dtypes(config, model_config, draft):
            pick, refusal = select_backend(config, model_config, kv_cache_dtype)
            layers.append(LayersAnswer(
                draft=draft, named=None if backend is None else backend.name,
                flag=flag, kv_cache_dtype=kv_cache_dtype, backend=pick,
                refusal=refusal))
    answer = VllmAnswer(tuple(layers), None)
    if any(layer.refusal for layer in layers):
        return answer
    probe = _probe(vllm_config, answer.backends)
    block_size, refusal = _paged_block_size(probe)
    return dataclasses.replace(answer, block_size=block_size, block_refusal=refusal,
                               cp_refusal=_cp_refusal(probe))


def with_block_size(vllm_config, block_size: int):
    """A copy of ``vllm_config`` as if ``--block-size block_size`` were passed."""
    config = copy.copy(vllm_config)
    config.cache_config = copy.deepcopy(vllm_config.cache_config)
    config.cache_config.block_size = block_size
    config.cache_config.user_specified_block_size = True
    return config
