# SPDX-License-Identifier: Apache-2.0
"""TRITON_MLA under DCP x DSpark the way vLLM drives it.

vLLM's own ``VllmConfig`` and ``CommonAttentionMetadata``, the real
``TritonDCPMLAMetadataBuilder`` (rows once per forward) and the real
``TritonDCPMLAImpl.forward_mqa`` running vLLM's ``decode_attention_fwd``,
bf16 and fp8 caches; each simulated rank's partial, merged by LSE, must
equal ``dense_reference.full_attention`` over the cache as the kernel reads
it (fp8 dequantized with the layer's scale, rounded to bf16). Tests whose
name holds ``triton_path`` launch the kernel: on CUDA where present (the
module runs there as it is), otherwise under ``TRITON_INTERPRET=1`` in the
subprocess ``test_interpreter_runs_triton_path_tests`` starts on every CI
run. Small shapes (4 heads, at most 12 rows, sequences under 100 tokens)
keep the interpreter fast.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from tests.support.triton_interpreted import (
    DEVICE, enable_vllm_triton_kernels, needs_triton, run_triton_path_tests,
    runs_where_triton_cannot)

enable_vllm_triton_kernels()  # before vLLM's Triton kernels are imported

from tests.support.builder_harness import (  # noqa: E402
    common_metadata, fake_dcp_group, make_builder, make_mla_impl, make_vllm_config)
from tests.support.dense_reference import (  # noqa: E402
    KV_LORA_RANK, ROPE_DIM, full_attention, random_decode_batch)
from vllm.v1.attention.backends.mla import triton_mla  # noqa: E402
from vllm.v1.attention.backends.mla import triton_dcp_mla as ours  # noqa: E402
from vllm.v1.attention.ops.dcp_decode import DCPLayout, merge_partials  # noqa: E402
from tools.dcp_simulated_ranks import (  # noqa: E402
    decode_on_simulated_ranks)

# Query heads after vLLM's DCP query gather (more than 1: the kernel's MLA
# path is its grouped one).
NUM_HEADS = 4
BLOCK_SIZE = 16
NUM_SPEC = 3
SCALE = 0.0721
K_SCALE = 0.5  # the layer's fp8 scale

CASES = {  # (seq_lens, query_lens): q_len <= 1 + NUM_SPEC
    # Uniform; a request shorter than its block (its first tokens see nothing).
    "uniform": ([37, 3, 90], [4, 4, 4]),
    # CUDA-graph padding: trailing zero-length requests.
    "padded": ([37, 3, 90, 0, 0], [4, 4, 4, 0, 0]),
    "ragged": ([37, 2, 90, 18], [4, 1, 3, 2]),
}


def _config(tmp_path, *, world, interleave, kv_cache_dtype="auto", dspark=False):
    config = make_vllm_config(tmp_path / "model", dcp=world, interleave=interleave,
                              block_size=BLOCK_SIZE, num_speculative_tokens=NUM_SPEC)
    config.model_config.dtype = torch.bfloat16
    config.cache_config.cache_dtype = kv_cache_dtype
    if dspark:  # vLLM validates DSpark x DCP support only for this method
        config.speculative_config.method = "dspark"
    return config


def _make_impl(impl_cls, kv_cache_dtype="auto"):
    return make_mla_impl(impl_cls, num_heads=NUM_HEADS, scale=SCALE,
                         kv_cache_dtype=kv_cache_dtype)


def _layer(k_scale=1.0):
    return SimpleNamespace(_k_scale=torch.tensor(k_scale, device=DEVICE),
                           _k_scale_float=k_scale)


def _on_device(common):
    """vLLM's common metadata with its device tensors on DEVICE."""
    return dataclasses.replace(
        common, query_start_loc=common.query_start_loc.to(DEVICE),
        seq_lens=common.seq_lens.to(DEVICE),
        block_table_tensor=common.block_table_tensor.to(DEVICE),
        slot_mapping=common.slot_mapping.to(DEVICE),
        dcp_local_seq_lens=common.dcp_local_seq_lens.to(DEVICE))


def _as_kernel_reads(cache, kv_cache_dtype):
    """(the cache stored as the kernel's input, float32 of what it computes
    with): bf16, or fp8 holding cache / K_SCALE, dequantized and cast to the
    query's bf16 in the kernel. The NaN null block stays NaN."""
    if kv_cache_dtype == "fp8":
        stored = (cache / K_SCALE).to(torch.float8_e4m3fn)
        return stored, (stored.float() * K_SCALE).bfloat16().float()
    stored = cache.bfloat16()
    return stored, stored.float()


def _run_ranks(tmp_path, *, world, interleave, causal, shape, kv_cache_dtype,
               seed=0):
    """Every rank: the real builder (rows) and forward_mqa; returns the
    merged ``(out, lse)`` of the real tokens and the dense reference."""
    seq_lens, query_lens = CASES[shape]
    batch = random_decode_batch(seq_lens, query_lens, block_size=BLOCK_SIZE,
                                num_heads=NUM_HEADS, seed=seed)
    stored, computed = _as_kernel_reads(batch.kv_cache, kv_cache_dtype)
    q = batch.q.bfloat16()
    ref_out, ref_lse = full_attention(
        dataclasses.replace(batch, q=q.float(), kv_cache=computed, scale=SCALE),
        causal=causal)
    config = _config(tmp_path, world=world, interleave=interleave,
                     kv_cache_dtype=kv_cache_dtype)

    def decode_rank(layout, local_cache, local_table):
        from vllm.config import set_current_vllm_config

        with fake_dcp_group(world, layout.rank), set_current_vllm_config(config):
            builder = make_builder(ours.TritonDCPMLAMetadataBuilder, config,
                                   non_causal=not causal, device=DEVICE)
            impl = _make_impl(ours.TritonDCPMLAImpl, kv_cache_dtype)
            common = common_metadata(seq_lens, query_lens, local_table,
                                     world_size=world, rank=layout.rank,
                                     interleave=interleave, causal=causal)
            metadata = builder.build(0, _on_device(common))
            # The shard holds exact fp8 / bf16 values: storing it is lossless.
            cache = local_cache.to(stored.dtype).to(DEVICE)
            out, lse = impl.forward_mqa(q.to(DEVICE), cache, metadata,
                                        _layer(K_SCALE if kv_cache_dtype == "fp8"
                                               else 1.0))
        assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
        # What vLLM's combine needs from a rank without keys for a row.
        empty = metadata.decode.flat.empty[:out.shape[0]].cpu()
        out, lse = out.float().cpu(), lse.cpu()
        assert not out.isnan().any()
        assert bool((out[empty] == 0).all()) and bool((lse[empty] == -math.inf).all())
        return out, lse

    # Shard the exact stored values (as float32, NaN null block kept); merge
    # in the LSE base the impl declares to vLLM's combine.
    out, lse = decode_on_simulated_ranks(
        stored.float(), batch.block_table, batch.seq_lens, decode_rank,
        layout=DCPLayout(world, interleave=interleave),
        merge=functools.partial(merge_partials,
                                lse_base_e=ours.TritonDCPMLAImpl.lse_base_on_e))
    if not ours.TritonDCPMLAImpl.lse_base_on_e:
        lse = lse * math.log(2.0)
    real = int(batch.query_start_loc[-1])
    return out[:real], lse[:real], ref_out, ref_lse


# (W, interleave, causal, shape, KV-cache dtype): every W x interleave pair
# with causal and non-causal blocks, both dtypes, ragged and padded batches.
MERGE_CASES = [
    (2, 1, True, "uniform", "auto"), (2, 1, True, "ragged", "fp8"),
    (2, 1, False, "padded", "auto"), (2, 16, True, "padded", "fp8"),
    (2, 16, False, "uniform", "fp8"), (2, 16, True, "ragged", "auto"),
    (4, 16, True, "uniform", "auto"), (4, 16, True, "ragged", "auto"),
    (4, 16, False, "padded", "fp8"), (4, 1, True, "padded", "auto"),
    (4, 1, False, "uniform", "fp8"), (4, 1, True, "ragged", "fp8"),
]


@needs_triton
@pytest.mark.parametrize("world,interleave,causal,shape,kv_cache_dtype", MERGE_CASES)
def test_triton_path_ranks_merge_to_full_attention(tmp_path, world, interleave,
                                                   causal, shape, kv_cache_dtype):
    out, lse, ref_out, ref_lse = _run_ranks(
        tmp_path, world=world, interleave=interleave, causal=causal, shape=shape,
        kv_cache_dtype=kv_cache_dtype, seed=world + interleave)
    torch.testing.assert_close(out, ref_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)


@needs_triton
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_triton_path_any_split_count_is_exact(tmp_path, monkeypatch, kv_cache_dtype):
    """The split count is fixed when a CUDA graph is captured and replayed
    over other lengths: with a split per 8 keys (up to 4 splits, many rows
    split unevenly or not at all) the merge is still full attention."""
    monkeypatch.setattr(triton_mla, "_MIN_WORK_PER_SPLIT", 8)
    monkeypatch.setattr(triton_mla, "_SPLIT_OCCUPANCY_MULTIPLIER", 64)
    calls = []
    real_fwd = ours.decode_attention_fwd

    def spy(*args, **kwargs):
        calls.append(args[8])  # num_kv_splits
        return real_fwd(*args, **kwargs)

    monkeypatch.setattr(ours, "decode_attention_fwd", spy)
    out, lse, ref_out, ref_lse = _run_ranks(
        tmp_path, world=2, interleave=16, causal=True, shape="ragged",
        kv_cache_dtype=kv_cache_dtype)
    assert calls and min(calls) > 1, calls
    torch.testing.assert_close(out, ref_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------
# -dcp 1: upstream's builder and kernel call

@needs_triton
@pytest.mark.parametrize("causal", [True, False])
def test_triton_path_dcp1_is_upstream(tmp_path, causal):
    """At -dcp 1 the builder makes upstream's metadata (no rows) with
    upstream's thresholds, and forward_mqa returns upstream's bits."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention.mla_attention import (
        MLACommonDecodeMetadata)

    config = _config(tmp_path, world=1, interleave=1)
    seq_lens, query_lens = [37, 3, 90], [4, 4, 4]
    batch = random_decode_batch(seq_lens, query_lens, block_size=BLOCK_SIZE,
                                num_heads=NUM_HEADS)
    results = {}
    with fake_dcp_group(1, 0), set_current_vllm_config(config):
        for name, module in (("upstream", triton_mla), ("ours", ours)):
            prefix = "" if name == "upstream" else "DCP"
            builder = make_builder(getattr(module, f"Triton{prefix}MLAMetadataBuilder"),
                                   config, non_causal=not causal, device=DEVICE)
            impl = _make_impl(getattr(module, f"Triton{prefix}MLAImpl"))
            common = common_metadata(seq_lens, query_lens, batch.block_table,
                                     world_size=1, rank=0, interleave=1,
                                     causal=causal)
            metadata = builder.build(0, _on_device(common))
            assert type(metadata.decode) is MLACommonDecodeMetadata
            out, lse = impl.forward_mqa(batch.q.bfloat16().to(DEVICE),
                                        batch.kv_cache.bfloat16().to(DEVICE),
                                        metadata, _layer())
            results[name] = (builder.reorder_batch_threshold,
                             builder.query_len_support,
                             builder.supports_draft_decode_metadata_update,
                             metadata.decode.seq_lens.tolist(),
                             out.cpu(), None if lse is None else lse.cpu())
    upstream, got = results["upstream"], results["ours"]
    assert got[:4] == upstream[:4]
    # Bit for bit, NaN where upstream leaves a row without keys NaN.
    torch.testing.assert_close(got[4], upstream[4], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(got[5], upstream[5], rtol=0, atol=0, equal_nan=True)


def test_dcp1_builder_flags_and_graph_mode_are_upstreams(tmp_path):
    from vllm.config import set_current_vllm_config

    config = _config(tmp_path, world=1, interleave=1)
    with fake_dcp_group(1, 0), set_current_vllm_config(config):
        builder = make_builder(ours.TritonDCPMLAMetadataBuilder, config)
        upstream = make_builder(triton_mla.TritonMLAMetadataBuilder, config)
    for attr in ("reorder_batch_threshold", "query_len_support",
                 "supports_draft_decode_metadata_update", "dcp_world_size"):
        assert getattr(builder, attr) == getattr(upstream, attr), attr
    assert builder._dcp_rows is None  # no rows allocated
    assert (ours.TritonDCPMLAMetadataBuilder.get_cudagraph_support(config, None)
            == triton_mla.TritonMLAMetadataBuilder.get_cudagraph_support(config, None))


# ---------------------------------------------------------------------------
# DCP > 1: what vLLM reads off the builder and impl

@pytest.mark.parametrize("non_causal", [False, True])
def test_dspark_dcp_builder_accepts_what_upstream_refuses(tmp_path, non_causal):
    """vLLM's own DSpark x DCP validation: upstream TRITON_MLA refuses the
    causal target and the non-causal draft at -dcp 2; the rows builder takes
    both, as multi-token decodes of any query-length mix."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention.mla_attention import QueryLenSupport
    from vllm.v1.attention.backend import AttentionCGSupport

    config = _config(tmp_path, world=2, interleave=16, dspark=True)
    with fake_dcp_group(2, 0), set_current_vllm_config(config):
        with pytest.raises(ValueError, match="decode context parallelism"):
            make_builder(triton_mla.TritonMLAMetadataBuilder, config,
                         non_causal=non_causal)
        builder = make_builder(ours.TritonDCPMLAMetadataBuilder, config,
                               non_causal=non_causal)
    assert builder.reorder_batch_threshold == 1 + NUM_SPEC
    assert builder.query_len_support == QueryLenSupport.VARLEN
    assert not builder.supports_draft_decode_metadata_update
    assert ours.TritonDCPMLABackend.supports_non_causal_dcp()
    assert not triton_mla.TritonMLABackend.supports_non_causal_dcp()
    assert ours.TritonDCPMLAImpl.supports_mtp_with_cp_non_trivial_interleave_size
    assert ours.TritonDCPMLAImpl.lse_base_on_e
    assert (ours.TritonDCPMLAMetadataBuilder.get_cudagraph_support(config, None)
            == AttentionCGSupport.UNIFORM_BATCH)
    # The layer's combine trusts the rows' mask (routed once, here).
    layer = config.compilation_config.static_forward_context["model.layers.0.attn"]
    assert layer.dcp_manager.combine_masked_by_rows


def test_builder_names_the_flag_at_start_up(tmp_path):
    from vllm.config import set_current_vllm_config

    config = _config(tmp_path, world=2, interleave=1)
    config.parallel_config.tensor_parallel_size = 3
    with fake_dcp_group(2, 0), set_current_vllm_config(config), \
            pytest.raises(ValueError, match="TRITON_MLA cannot serve") as error:
        make_builder(ours.TritonDCPMLAMetadataBuilder, config)
    assert "-dcp) 2 must divide --tensor-parallel-size (-tp) 3" in str(error.value)


def test_kernel_reads_the_same_rows_memory_every_forward(tmp_path, monkeypatch):
    """What a CUDA graph replays: two forwards of one row count (different
    lengths, query mixes and causality) hand the kernel views at the same
    addresses (the persistent rows), with this forward's contents."""
    from vllm.config import set_current_vllm_config

    seen = []
    monkeypatch.setattr(ours, "_compute_num_kv_splits", lambda *args: 2)
    monkeypatch.setattr(ours, "decode_attention_fwd",
                        lambda *args, **kwargs: seen.append(
                            (args[5].data_ptr(), args[5].stride(), args[6].data_ptr(),
                             args[6].tolist())))
    config = _config(tmp_path, world=2, interleave=1)
    gen = torch.Generator().manual_seed(0)
    table = torch.randint(1, 99, (4, 8), generator=gen, dtype=torch.int32)
    with fake_dcp_group(2, 1), set_current_vllm_config(config):
        builder = make_builder(ours.TritonDCPMLAMetadataBuilder, config,
                               non_causal=True)
        impl = _make_impl(ours.TritonDCPMLAImpl)
        for seq_lens, query_lens, causal in (([37, 3, 90], [4, 4, 4], False),
                                             ([50, 9, 20, 7], [4, 2, 4, 2], True)):
            common = common_metadata(seq_lens, query_lens, table[:len(seq_lens)],
                                     world_size=2, rank=1, interleave=1,
                                     causal=causal)
            metadata = builder.build(0, common)
            q = torch.randn(12, NUM_HEADS, KV_LORA_RANK + ROPE_DIM).bfloat16()
            with mock.patch.object(ours, "finish_rows_decode",
                                   lambda impl, out, lse, rows: (out, lse)):
                impl.forward_mqa(q, torch.zeros(99, BLOCK_SIZE, 576).bfloat16(),
                                 metadata, _layer())
            assert seen[-1][3] == metadata.decode.flat.seq_lens.tolist()
    (ptr0, stride0, lens_ptr0, _), (ptr1, stride1, lens_ptr1, _) = seen
    assert (ptr0, stride0, lens_ptr0) == (ptr1, stride1, lens_ptr1)


@pytest.mark.parametrize("role", ["target", "draft"])
def test_every_graph_vllm_captures_replays_on_the_same_rows(tmp_path, monkeypatch,
                                                            role):
    """Every FULL uniform-decode graph vLLM's own CudaGraphManager captures
    (default sizes; the target verifies 1 + k tokens, the DSpark draft a
    k-token block): the kernel launch vLLM records when it builds the
    graph's metadata for capture and the one of a later batch replayed in it
    (fewer real requests, padded) take the same arguments but the rows'
    contents: same row count, rows and scratch at the same addresses; the
    padding rows are empty (masked), and upstream's workspace reservation
    holds the scratch."""
    from vllm.config import set_current_vllm_config
    from tests.support.vllm_capture_shapes import full_decode_shapes

    num_spec = 4
    draft = role == "draft"
    query_len = num_spec if draft else 1 + num_spec
    config = make_vllm_config(tmp_path / "model", dcp=2, block_size=BLOCK_SIZE,
                              num_speculative_tokens=num_spec)
    config.model_config.dtype = torch.bfloat16
    shapes = full_decode_shapes(config, query_len)
    config.attention_config.use_non_causal = draft
    launches = []

    def launch(q, k_buffer, v_buffer, o, lse, block_table, seq_lens, logits,
               num_kv_splits, *args, **kwargs):
        launches.append(dict(rows=q.shape[0], table=(block_table.data_ptr(),
                                                     block_table.stride()),
                             lens=seq_lens.data_ptr(), logits=logits.shape,
                             splits=num_kv_splits, row_lens=seq_lens.clone()))

    monkeypatch.setattr(ours, "decode_attention_fwd", launch)
    # The count the graph keeps is the one computed at capture.
    monkeypatch.setattr(ours, "_compute_num_kv_splits", lambda *args: 4)
    with fake_dcp_group(2, 0), set_current_vllm_config(config):
        builder = make_builder(ours.TritonDCPMLAMetadataBuilder, config,
                               non_causal=draft)
        impl = _make_impl(ours.TritonDCPMLAImpl)
        num_cols = builder._dcp_rows.block_table.shape[1]
        max_rows = config.scheduler_config.max_num_seqs * builder.reorder_batch_threshold
        for num_tokens, num_reqs in shapes:
            assert num_tokens <= max_rows, (num_tokens, max_rows)
            gen = torch.Generator().manual_seed(num_tokens)
            for capture in (True, False):
                real = num_reqs if capture else max(num_reqs - 1, 1)
                seq_lens = ([query_len] * real if capture else (torch.randint(
                    0, 900, (real,), generator=gen) + query_len).tolist())
                pad = num_reqs - real
                table = torch.randint(1, 99, (num_reqs, num_cols), generator=gen,
                                      dtype=torch.int32)
                common = common_metadata(seq_lens + [0] * pad,
                                         [query_len] * real + [0] * pad, table,
                                         world_size=2, rank=0, interleave=1,
                                         causal=not draft)
                common.num_actual_tokens = num_tokens
                common.max_query_len = query_len
                metadata = (builder.build_for_cudagraph_capture(common) if capture
                            else builder.build(0, common))
                q = torch.zeros(num_tokens, NUM_HEADS, KV_LORA_RANK + ROPE_DIM,
                                dtype=torch.bfloat16)
                out, _ = impl.forward_mqa(q, torch.zeros(99, BLOCK_SIZE, 576,
                                                         dtype=torch.bfloat16),
                                          metadata, _layer())
            captured, replayed = launches[-2], launches[-1]
            assert replayed.pop("row_lens")[real * query_len:].eq(0).all()
            captured.pop("row_lens")
            assert captured == replayed and captured["rows"] == num_tokens
            assert out[real * query_len:].eq(0).all()  # padding rows masked


@runs_where_triton_cannot
def test_interpreter_runs_triton_path_tests():
    """Every CI run: the triton_path tests under Triton's interpreter."""
    run_triton_path_tests(__file__)
