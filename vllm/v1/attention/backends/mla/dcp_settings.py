# SPDX-License-Identifier: Apache-2.0
"""The DCP x DSpark setting of a model or a KV-cache group, read once.

``DCPSetting`` is what every consumer reads: the start-up checks
(``dcp_startup_checks``), the backends' selection checks
(``supports_combination``) and the metadata builders. The config-level
fields come from the ``VllmConfig`` (``DCPSetting.from_vllm_config``); a
builder adds what only it knows, its rank, its layers' head count and the
sizes of its persistent buffers (``DCPSetting.for_builder``), once, when it
is made.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass

from vllm.v1.attention.ops.dcp_decode import DCPLayout


def decode_query_len(vllm_config, draft: bool) -> int:
    """Query tokens per request in one decode step of the target (its
    verification: 1 + k) or of the draft (``draft``): vLLM's MRV2 DSpark
    drafter runs k when its block samples from the anchor (the
    checkpoint's ``sample_from_anchor``, default on), else 1 + k
    (``DSparkSpeculator.num_query_per_req``)."""
    spec = vllm_config.speculative_config
    if spec is None:
        return 1
    k = spec.num_speculative_tokens or 0
    if draft and spec.method == "dspark" and getattr(
            spec.draft_model_config.hf_config, "sample_from_anchor", True):
        return k
    return 1 + k


def draft_layer_indices(vllm_config) -> range:
    """The draft model's layer indices in vLLM's layer names: vLLM's draft
    models (Kimi-K3's DSpark draft among them) number their layers on from
    the target's (``start_layer_id`` = the target's layer count)."""
    spec = vllm_config.speculative_config
    if spec is None or spec.draft_model_config is None:
        return range(0)
    start = vllm_config.model_config.get_total_num_hidden_layers()
    return range(start, start + spec.draft_model_config.get_total_num_hidden_layers())


# Architectures whose MLA layers are Kimi-K3's own ``MultiHeadLatentAttention``
# (``vllm/models/kimi_k3/nvidia/mla.py``): it takes ``cache_config.cache_dtype``
# for every layer and never reads ``--kv-cache-dtype-skip-layers`` (vLLM's
# generic ``MLAAttention`` does). Kimi-K3's text model is built as
# ``KimiLinearForCausalLM``; its DSpark draft is ``K3DSparkModel``.
SKIP_LIST_BLIND_ARCHITECTURES = frozenset({
    "KimiK3ForConditionalGeneration", "KimiK31ForConditionalGeneration",
    "KimiLinearForCausalLM", "K3DSparkModel", "KimiK3MTPModel",
})


def reads_kv_cache_dtype_skip_layers(model_config) -> bool:
    """Whether the attention layers vLLM builds for ``model_config`` apply
    ``--kv-cache-dtype-skip-layers``."""
    architectures = getattr(model_config.hf_config, "architectures", None) or ()
    return not SKIP_LIST_BLIND_ARCHITECTURES.intersection(architectures)


def model_kv_cache_dtype(vllm_config, draft: bool) -> str:
    """The KV-cache dtype the target's layers, or the draft's (``draft``),
    are built with, as vLLM's layer classes compute it.

    The draft's loaders (``load_dspark_model`` and the other draft-model
    speculators) build it under ``cache_dtype`` = the speculative config's
    ``kv_cache_dtype`` where that is set, else ``--kv-cache-dtype``. Then
    unquantized (``auto``) where ``--kv-cache-dtype-skip-layers`` names every
    layer of the model, only for layer classes that read that list
    (``MLAAttention``, per layer index; see
    ``reads_kv_cache_dtype_skip_layers``).
    """
    cache = vllm_config.cache_config
    spec = vllm_config.speculative_config
    dtype = cache.cache_dtype
    model_config = vllm_config.model_config
    if draft and spec is not None:
        dtype = getattr(spec, "kv_cache_dtype", None) or dtype
        model_config = spec.draft_model_config or model_config
    skipped = set(getattr(cache, "kv_cache_dtype_skip_layers", None) or ())
    layers = (draft_layer_indices(vllm_config) if draft else
              range(vllm_config.model_config.get_total_num_hidden_layers()))
    if (skipped and layers and all(str(i) in skipped for i in layers)
            and reads_kv_cache_dtype_skip_layers(model_config)):
        return "auto"
    return str(dtype)


def decodes_non_causal_block(vllm_config, layer_names) -> bool:
    """Whether any of ``layer_names`` decodes a DSpark draft's non-causal
    block (vLLM marks such layers ``non_causal_multi_token_decode``)."""
    ctx = vllm_config.compilation_config.static_forward_context
    return any(getattr(ctx.get(name), "non_causal_multi_token_decode", False)
               for name in layer_names)


def is_draft_layer(vllm_config, layer_name: str) -> bool:
    """Whether one attention layer is the draft model's: it decodes a
    non-causal block, vLLM's speculator marked it (``is_draft_layer``), or
    its index is past the target's (``draft_layer_indices``)."""
    layer = vllm_config.compilation_config.static_forward_context.get(layer_name)
    if getattr(layer, "non_causal_multi_token_decode", False) or getattr(
            layer, "is_draft_layer", False):
        return True
    if vllm_config.speculative_config is None:
        return False
    index = re.search(r"layers\.(\d+)\.", layer_name)
    return (index is not None and int(index.group(1))
            >= vllm_config.model_config.get_total_num_hidden_layers())


def is_draft_group(vllm_config, layer_names) -> bool:
    """Whether a metadata builder over ``layer_names`` builds the draft
    model's forwards: a non-causal drafter's attention config (DFlash,
    DSpark: the builders ``DFlashSpeculator.attn_vllm_config`` makes), or
    every layer the draft's (``is_draft_layer``).

    A builder over target and draft layers together (vLLM puts both models'
    MLA layers in one KV-cache group when their specs merge, and one builder
    serves a group's layers of one backend) is the target runner's: it
    builds the target's forwards only, the speculator building the draft's
    with its own builders. Its setting is the target's."""
    if getattr(vllm_config.attention_config, "use_non_causal", False):
        return True
    return bool(layer_names) and all(is_draft_layer(vllm_config, name)
                                     for name in layer_names)


def layer_roles(vllm_config, layer_names) -> tuple[bool, ...]:
    """The models (False: the target, True: the draft) whose layers are
    among ``layer_names``, in that order."""
    drafts = {is_draft_layer(vllm_config, name) for name in layer_names}
    return tuple(sorted(drafts))


@dataclass(frozen=True)
class DCPSetting:
    """The DCP setting of a model's layers (``from_vllm_config``) or of one
    metadata builder's KV-cache group (``for_builder``).

    The builder-only fields are 0 in a model's setting.
    """

    gpu_major: int | None  # compute capability major; None without a GPU
    tensor_parallel_size: int
    dcp_size: int
    interleave: int
    block_size: int
    kv_cache_dtype: str
    num_speculative_tokens: int
    max_decode_query_len: int  # of the model checked (``decode_query_len``)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    draft: bool = False  # the draft model's layers (``is_draft_group``)
    speculative_method: str | None = None  # --speculative-config's method
    # Builder-only:
    dcp_rank: int = 0
    gathered_heads: int = 0  # query heads a rank attends after DCP's gather
    row_capacity: int = 0  # decode query tokens of the largest forward
    block_table_width: int = 0  # columns of the block tables vLLM passes

    @classmethod
    def from_vllm_config(cls, vllm_config, gpu_major: int | None, *,
                         draft: bool = False) -> "DCPSetting":
        """The setting of the target's layers, or of the draft's (``draft``)."""
        parallel = vllm_config.parallel_config
        hf = vllm_config.model_config.hf_text_config
        spec = vllm_config.speculative_config
        num_spec = (spec.num_speculative_tokens or 0) if spec is not None else 0
        return cls(
            gpu_major=gpu_major,
            tensor_parallel_size=parallel.tensor_parallel_size,
            dcp_size=parallel.decode_context_parallel_size,
            interleave=parallel.cp_kv_cache_interleave_size,
            block_size=vllm_config.cache_config.block_size,
            kv_cache_dtype=model_kv_cache_dtype(vllm_config, draft),
            num_speculative_tokens=num_spec,
            max_decode_query_len=decode_query_len(vllm_config, draft),
            kv_lora_rank=getattr(hf, "kv_lora_rank", 0) or 0,
            qk_nope_head_dim=getattr(hf, "qk_nope_head_dim", 0) or 0,
            qk_rope_head_dim=getattr(hf, "qk_rope_head_dim", 0) or 0,
            v_head_dim=getattr(hf, "v_head_dim", 0) or 0,
            draft=draft,
            speculative_method=spec.method if spec is not None else None,
        )

    @classmethod
    def for_builder(cls, builder, layer_names: list[str], gpu_major: int | None,
                    dcp_rank: int, *, draft: bool | None = None) -> "DCPSetting":
        """The setting of the forwards an ``MLACommonMetadataBuilder`` over
        ``layer_names`` builds (the draft's or the target's:
        ``is_draft_group``; or ``draft`` if given: the setting of that
        model's layers among them), seen from ``dcp_rank``.

        Read after the base ``__init__``: its DCP size (1 for a cache every
        rank holds whole, vLLM >= 0.33), interleave, head count and reorder
        threshold are vLLM's for this group.
        """
        vllm_config = builder.vllm_config
        dcp_size = builder.dcp_world_size
        if draft is None:
            draft = is_draft_group(vllm_config, layer_names)
        setting = cls.from_vllm_config(vllm_config, gpu_major, draft=draft)
        query_len_bound = max(1 + setting.num_speculative_tokens,
                              builder.reorder_batch_threshold or 1)
        return dataclasses.replace(
            setting,
            dcp_size=dcp_size,
            interleave=builder.cp_kv_cache_interleave_size,
            dcp_rank=dcp_rank,
            gathered_heads=builder.num_heads * dcp_size,
            row_capacity=row_capacity(vllm_config, query_len_bound),
            block_table_width=block_table_width(builder.kv_cache_spec, vllm_config))

    @functools.cached_property
    def layout(self) -> DCPLayout:
        """The KV split seen from this setting's rank."""
        return DCPLayout(self.dcp_size, self.dcp_rank, self.interleave)

    @property
    def host_length_slack(self) -> int:
        """Most that vLLM's host sequence lengths exceed the device's.

        With k speculative tokens under async scheduling the target's host
        length assumes every draft of the last step accepted (up to k
        over). A draft model's is the target's plus its query block, while
        its device length starts after the last token the target accepted
        this step: up to k more (``DFlashSpeculator``'s
        ``seq_lens_cpu_upper_bound + step`` against ``last_valid_pos + 1``).
        """
        return (2 if self.draft else 1) * self.num_speculative_tokens


def row_capacity(vllm_config, query_len_bound: int) -> int:
    """Most decode query tokens one forward can carry, from vLLM's bounds.

    At most ``max_num_seqs`` decode requests of at most ``query_len_bound``
    tokens (1 + num_speculative_tokens, or the batch reorder's decode
    threshold if larger), within the token budget ``max_num_batched_tokens``
    (vLLM's own cap on decode tokens); a CUDA graph pads a decode-only batch
    up to a capture size, at most ``max_cudagraph_capture_size``.
    """
    sched = vllm_config.scheduler_config
    decode_tokens = min(sched.max_num_batched_tokens,
                        sched.max_num_seqs * query_len_bound)
    capture = vllm_config.compilation_config.max_cudagraph_capture_size
    return max(decode_tokens, capture or 0)


def block_table_width(kv_cache_spec, vllm_config) -> int:
    """Columns of the block table vLLM hands a builder of ``kv_cache_spec``.

    The worker's block table (``MultiGroupBlockTable`` / MRV2's
    ``BlockTables``) is ``max_num_blocks_per_req(max_model_len)`` of the
    group's spec (DCP-sharded: ``max_model_len / (block_size x DCP)``)
    aligned to 128 tokens by ``get_block_table_width``, in kernel blocks
    when the backend pages finer than the group (``AttentionGroup``). A
    builder only sees the kernel-block spec, so the group's block size is
    taken as the cache's when it is a multiple, and the wider of the two
    readings is kept.
    """
    from vllm.v1.attention.backends.mla.dcp_compat import get_block_table_width

    max_model_len = vllm_config.model_config.max_model_len
    kernel_block = kv_cache_spec.block_size
    group_blocks = {kernel_block}
    cache_block = vllm_config.cache_config.block_size
    if cache_block and cache_block % kernel_block == 0:
        group_blocks.add(cache_block)
    widths = []
    for group_block in group_blocks:
        group_spec = kv_cache_spec.copy_with_new_block_size(group_block)
        blocks = group_spec.max_num_blocks_per_req(vllm_config, max_model_len)
        widths.append(get_block_table_width(blocks, group_block)
                      * (group_block // kernel_block))
    return max(widths)


def kv_split_over_dcp(kv_cache_spec, vllm_config) -> bool:
    """Whether a KV-cache group is split over the DCP ranks (vLLM >= 0.33
    keeps a cache every rank holds whole, e.g. a DCP-1 draft, unsplit)."""
    return (vllm_config.parallel_config.decode_context_parallel_size > 1
            and getattr(kv_cache_spec, "dcp_sharded", True))
