# SPDX-License-Identifier: Apache-2.0
"""FLASHMLA under DCP x DSpark the way vLLM drives it, on CPU.

vLLM's own ``VllmConfig``, ``CommonAttentionMetadata`` and this project's
``FlashMLADCPMetadataBuilder`` / ``FlashMLADCPImpl``: the builder fills the
rows and plans FlashMLA once per forward, every layer's ``forward_mqa``
runs. vLLM's FlashMLA kernels (CUDA only) are stood in by
``kernel_stubs.FlashMLAReference`` (FlashMLA's documented contract,
scheduler reuse included); the tail kernel is the real Triton one, so the
``triton_path`` tests run under ``TRITON_INTERPRET=1``
(``test_interpreter_runs_triton_path_tests`` starts them in a subprocess on
every CI run). The ranks' outputs, merged, must equal
``dense_reference.full_attention`` on the same (bf16- or fp8-rounded)
values. The same builder with vLLM's FlashMLA on the H200:
``tests/gpu/test_sm90_vllm_backend.py``.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from tests.support.builder_harness import (
    TINY_MLA_CONFIG, common_metadata, fake_dcp_group, make_builder, make_mla_impl,
    make_vllm_config)
from tests.support.dense_reference import full_attention, random_decode_batch
from tests.support.kernel_stubs import FlashMLAReference
from tests.support.triton_interpreted import (
    needs_triton, run_triton_path_tests, runs_where_triton_cannot)
from vllm.v1.attention.ops import mla_tail_merge
from vllm.v1.attention.ops.dcp_decode import DCPLayout
from tools.dcp_simulated_ranks import decode_on_simulated_ranks

NUM_HEADS = 8  # the tiny model's, every rank's after DCP's query gather (TP = DCP)
BLOCK_SIZE = 64  # FlashMLA's only page size
NUM_LAYERS = 2
NUM_SPEC = 3
TARGET_LAYERS = TINY_MLA_CONFIG["num_hidden_layers"]
FP8 = torch.float8_e4m3fn
Q_SCALE, K_SCALE = 0.05, 0.1

CASES = {  # (seq_lens, query_lens); the rows are padded to R x max(query_lens)
    # Short requests whose first tokens have no local key on some ranks.
    "uniform": ([37, 4, 300, 18, 130], [4, 4, 4, 4, 4]),
    # A CUDA graph's padded batch: trailing zero-length requests, the rows
    # padded to every request's share (Model Runner V2's uniform padding).
    "padded": ([37, 4, 300, 0, 0], [4, 4, 4, 0, 0]),
    # Interleave 64 at W 8: every request shorter than W x I.
    "short": ([70, 5, 200, 64, 129], [4, 4, 4, 4, 4]),
}
# Verify blocks as vLLM's scheduler cuts them (token budget, max_model_len):
# ragged, never padded (vLLM's graphs capture uniform batches only).
RAGGED = {
    "cut_last": ([37, 300, 130], [1 + NUM_SPEC, 1 + NUM_SPEC, 2]),
    "one_and_full": ([70, 9], [1, 1 + NUM_SPEC]),
    "cut_first": ([129, 4, 66, 200], [2, 1 + NUM_SPEC, 1, 3]),
}


@pytest.fixture
def flashmla(monkeypatch):
    """The backend module as on an H200, vLLM's FlashMLA calls stood in."""
    from vllm.v1.attention.backends.mla import flashmla_dcp_mla
    from vllm.v1.attention.ops import flashmla as flashmla_ops

    from vllm.v1.attention.backends.mla import flashmla as upstream

    kernel = FlashMLAReference()
    monkeypatch.setattr(flashmla_dcp_mla.checks, "current_gpu_major", lambda: 9)
    monkeypatch.setattr(upstream, "is_flashmla_dense_supported", lambda: (True, None))
    for name in ("get_mla_metadata", "get_mla_metadata_dense_fp8",
                 "flash_mla_with_kvcache", "flash_mla_with_kvcache_fp8"):
        # Where this project calls them, and where upstream's impl does.
        monkeypatch.setattr(flashmla_ops, name, getattr(kernel, name))
        monkeypatch.setattr(upstream, name, getattr(kernel, name))
    flashmla_dcp_mla.kernel = kernel
    return flashmla_dcp_mla


def _layer(fp8):
    q_scale, k_scale = (Q_SCALE, K_SCALE) if fp8 else (1.0, 1.0)
    return SimpleNamespace(_q_scale=torch.tensor([q_scale]),
                           _k_scale=torch.tensor([k_scale]),
                           _q_scale_float=q_scale, _k_scale_float=k_scale,
                           dcp_manager=SimpleNamespace(combine=mock.Mock()))


def _rounded(values, fp8, scale):
    """float32 values as the kernel's storage holds them."""
    if fp8:
        return (values / scale).to(FP8).float() * scale
    return values.bfloat16().float()


def _stored(values, fp8, scale):
    return (values / scale).to(FP8) if fp8 else values.bfloat16()


def _run_ranks(flashmla, tmp_path, *, world, interleave, causal, shape, fp8,
               seed=0, kept=None, host_slack=0, column_cut=True):
    """Every rank: the real builder (kept across calls in ``kept``) + every
    layer's ``forward_mqa``; returns the merged (out, lse) of the real rows
    and the dense reference over exactly the device lengths' keys. The host
    upper bounds of the lengths lie ``host_slack`` above them."""
    from vllm.config import set_current_vllm_config

    seq_lens, query_lens = CASES[shape] if shape in CASES else RAGGED[shape]
    batch = random_decode_batch(seq_lens, query_lens, block_size=BLOCK_SIZE,
                                num_heads=NUM_HEADS, seed=seed)
    batch.q = _rounded(batch.q, fp8, Q_SCALE)
    null = batch.kv_cache[0].clone()
    batch.kv_cache = _rounded(batch.kv_cache, fp8, K_SCALE)
    batch.kv_cache[0] = null
    ref_out, ref_lse = full_attention(batch, causal=causal)
    kept = {} if kept is None else kept
    if "config" not in kept:
        config = make_vllm_config(tmp_path / "model", dcp=world, interleave=interleave,
                                  block_size=BLOCK_SIZE, num_speculative_tokens=NUM_SPEC)
        config.model_config.dtype = torch.bfloat16
        config.cache_config.cache_dtype = "fp8" if fp8 else "auto"
        kept["config"] = config
    config = kept["config"]
    first_layer = 0 if causal else TARGET_LAYERS  # the draft's come after
    layer_names = [f"model.layers.{first_layer + i}.self_attn.attn"
                   for i in range(NUM_LAYERS)]
    layer = _layer(fp8)
    real = int(batch.query_start_loc[-1])
    num_rows = len(query_lens) * max(query_lens) if shape in CASES else real
    q_rows = torch.cat([batch.q, torch.randn(num_rows - real, *batch.q.shape[1:])])

    def decode_rank(layout, cache, table):
        rank = layout.rank
        with fake_dcp_group(world, rank), set_current_vllm_config(config):
            if rank not in kept:
                kept[rank] = make_builder(flashmla.FlashMLADCPMetadataBuilder, config,
                                          layer_names=layer_names,
                                          non_causal=not causal)
            builder = kept[rank]
            impl = make_mla_impl(flashmla.FlashMLADCPImpl, num_heads=NUM_HEADS,
                                 scale=batch.scale,
                                 kv_cache_dtype="fp8" if fp8 else "auto")
            common = common_metadata(seq_lens, query_lens, table, world_size=world,
                                     rank=rank, interleave=interleave, causal=causal,
                                     host_slack=host_slack)
            common.num_actual_tokens = num_rows
            metadata = builder.build(0, common)
            assert (metadata.num_decodes, metadata.num_prefills) == (len(seq_lens), 0), (
                "every speculative block decodes on the rows")
            q = _stored(q_rows, fp8, Q_SCALE)
            results = [impl.forward_mqa(q, _stored(cache, fp8, K_SCALE), metadata, layer)
                       for _ in layer_names]
        for out, lse in results[1:]:
            assert torch.equal(out, results[0][0]) and torch.equal(lse, results[0][1])
        out, lse = results[0]
        assert bool((out[real:] == 0).all()) and bool((lse[real:] == -torch.inf).all()), (
            "padding rows must be out 0, LSE -inf")
        return out[:real].float(), lse[:real]

    with mock.patch.object(mla_tail_merge, "SMALL_GRID",
                           mla_tail_merge.SMALL_GRID if column_cut else 0):
        out, lse = decode_on_simulated_ranks(
            batch.kv_cache, batch.block_table, batch.seq_lens, decode_rank,
            layout=DCPLayout(world, interleave=interleave))
    return out, lse, ref_out, ref_lse


@needs_triton
@pytest.mark.parametrize("world,interleave,shape", [
    (2, 1, "uniform"), (4, 16, "padded"), (8, 64, "short"), (8, 1, "padded")])
@pytest.mark.parametrize("causal", [True, False], ids=["verify", "draft"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_triton_path_ranks_merge_to_full_attention(flashmla, tmp_path, world,
                                                   interleave, shape, causal, fp8):
    out, lse, ref_out, ref_lse = _run_ranks(
        flashmla, tmp_path, world=world, interleave=interleave, causal=causal,
        shape=shape, fp8=fp8, seed=world, column_cut=world < 8)
    kinds = {kind for kind, _ in flashmla.kernel.calls}
    assert kinds == {"fp8" if fp8 else "bf16"}
    assert all(not call["causal"] for _, call in flashmla.kernel.calls), (
        "FlashMLA's own causal mask is wrong on a shard; the rows use causal=False")
    # A DSpark block's tokens go to FlashMLA as heads (no finishing launch
    # but the empty rows' mask); a verify block's as tokens.
    q_len = max(CASES[shape][1])
    assert {call["shape"][1:3] for _, call in flashmla.kernel.calls} == (
        {(q_len, NUM_HEADS)} if causal else {(1, q_len * NUM_HEADS)})
    torch.testing.assert_close(out, ref_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)


@needs_triton
@pytest.mark.parametrize("world,interleave", [(2, 1), (4, 16), (8, 64), (8, 1)])
@pytest.mark.parametrize("shape", list(RAGGED))
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_triton_path_cut_verify_blocks_merge_to_full_attention(
        flashmla, tmp_path, world, interleave, shape, fp8):
    """Verify blocks cut short by the token budget decode on the rows, each
    request tiled to the batch's longest block, over exactly its device
    length's keys; the host's upper bounds lie k or 2k above (async
    scheduling). Upstream's UNIFORM routing sent the short blocks to the
    prefill path, which reads the host bound's keys."""
    # The rows read device lengths only; the routing under both host slacks
    # is test_cut_verify_routing's.
    slack = NUM_SPEC if interleave < 16 else 2 * NUM_SPEC
    out, lse, ref_out, ref_lse = _run_ranks(
        flashmla, tmp_path, world=world, interleave=interleave, causal=True,
        shape=shape, fp8=fp8, seed=world + slack, host_slack=slack)
    tiles = {call["shape"][:2] for _, call in flashmla.kernel.calls}
    assert tiles == {(len(RAGGED[shape][1]), 1 + NUM_SPEC)}, tiles
    torch.testing.assert_close(out, ref_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)


@needs_triton
@pytest.mark.parametrize("world,interleave,seq_len,causal,pieces", [
    (2, 1, 700, True, 4), (2, 1, 700, False, 4), (8, 64, 70, True, 2),
    (8, 1, 700, False, 3)])
def test_triton_path_lone_request_pieces_merge_to_full_attention(
        flashmla, tmp_path, monkeypatch, world, interleave, seq_len, causal, pieces):
    """A lone bf16 request per rank: FlashMLA attends its prefix as N pieces
    (``flashmla_pieces``, N chosen from the GPU's SM count: forced here, the
    CPU builder reports one SM), some of them empty on some ranks; the
    finishing launch merges them with the tails to full attention."""
    from vllm.v1.attention.ops import flashmla_dcp_rows

    monkeypatch.setattr(flashmla_dcp_rows, "pieces_for",
                        lambda *, num_reqs, fp8, **_: 1 if fp8 or num_reqs > 1 else pieces)
    monkeypatch.setitem(CASES, "lone", ([seq_len], [NUM_SPEC + 1]))
    out, lse, ref_out, ref_lse = _run_ranks(
        flashmla, tmp_path, world=world, interleave=interleave, causal=causal,
        shape="lone", fp8=False, seed=world + pieces)
    assert {call["shape"][0] for _, call in flashmla.kernel.calls} == {pieces}
    torch.testing.assert_close(out, ref_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)


@needs_triton
@pytest.mark.parametrize("world,interleave,shape,causal", [
    (2, 1, "uniform", True), (2, 1, "uniform", False), (4, 16, "padded", True),
    (4, 16, "padded", False), (8, 64, "short", True), (8, 64, "short", False),
    (8, 1, "padded", True), (8, 1, "padded", False), (2, 1, "cut_last", True),
    (4, 16, "cut_first", True), (8, 64, "one_and_full", True), (8, 1, "cut_first", True)])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_triton_path_token_rows_merge_to_full_attention(
        flashmla, tmp_path, monkeypatch, world, interleave, shape, causal, fp8):
    """FlashMLA given every row as a request of one token over its own local
    bound (``flashmla_token_rows``, forced here: the tiny model's 8 heads are
    no multiple of 64): no tail launch, ragged and padded batches alike, the
    rows with no local key (FlashMLA's stand-in gives them NaN; fp8 attends
    the one key its length is raised to) masked to out 0 / LSE -inf; every
    rank's rows merge to full attention."""
    from vllm.v1.attention.ops import flashmla_dcp_rows

    monkeypatch.setattr(flashmla_dcp_rows, "token_rows_preferred",
                        lambda *, num_heads, query_len, fp8, num_reqs: query_len >= 2)
    tails = mock.Mock(side_effect=AssertionError("token rows run no tail launch"))
    monkeypatch.setattr(flashmla_dcp_rows, "tail_merge", tails)
    out, lse, ref_out, ref_lse = _run_ranks(
        flashmla, tmp_path, world=world, interleave=interleave, causal=causal,
        shape=shape, fp8=fp8, seed=world + interleave)
    seq_lens, query_lens = CASES[shape] if shape in CASES else RAGGED[shape]
    rows = len(query_lens) * max(query_lens) if shape in CASES else sum(query_lens)
    assert {call["shape"][:2] for _, call in flashmla.kernel.calls} == {(rows, 1)}
    assert all(not call["causal"] for _, call in flashmla.kernel.calls)
    torch.testing.assert_close(out, ref_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)


@needs_triton
@pytest.mark.parametrize("with_prefix", [False, True])
def test_triton_path_mask_empty_rows_writes_only_empty_and_bad_rows(with_prefix):
    """``mask_empty_rows``: a row with no key gets out 0 / LSE -inf, a row
    whose bound is not the prefix FlashMLA attended NaN (with prefixes), every
    other row keeps FlashMLA's values bit for bit; 20 heads (a partial head
    block)."""
    from vllm.v1.attention.ops.flashmla_token_rows import mask_empty_rows

    gen = torch.Generator().manual_seed(3)
    out = torch.randn(6, 20, 512, generator=gen).bfloat16()
    lse = torch.randn(6, 20, generator=gen)
    seq_lens = torch.tensor([5, 0, 7, 0, 1, 9], dtype=torch.int32)
    prefix = torch.tensor([5, 0, 6, 0, 1, 9], dtype=torch.int32)  # row 2 has a tail
    want_out, want_lse = out.clone(), lse.clone()
    want_out[[1, 3]], want_lse[[1, 3]] = 0, -torch.inf
    if with_prefix:
        want_out[2], want_lse[2] = torch.nan, torch.nan
    mask_empty_rows(out, lse, seq_lens, prefix_lens=prefix if with_prefix else None)
    assert torch.equal(out.isnan(), want_out.isnan())
    assert torch.equal(lse.isnan(), want_lse.isnan())
    assert torch.equal(out.nan_to_num(), want_out.nan_to_num())
    assert torch.equal(lse.nan_to_num(), want_lse.nan_to_num())


def test_token_rows_preferred_by_flashmla_tiles():
    """One-token requests for an fp8 cache where they cost FlashMLA no more
    64-row tiles: 128 heads (DeepSeek-V3's at -dcp = -tp), not 96 (Kimi-K3's)
    or 8; only for multi-token blocks; bf16 keeps the tiles (slower at
    32-64K on the H100)."""
    from vllm.v1.attention.ops.flashmla_token_rows import token_rows_preferred

    def preferred(heads, q_len, fp8, reqs=4):
        return token_rows_preferred(num_heads=heads, query_len=q_len, fp8=fp8,
                                    num_reqs=reqs)

    assert preferred(128, 4, True) and preferred(128, 4, True, reqs=8)
    assert preferred(64, 2, True)
    assert not preferred(128, 4, True, reqs=9)  # 1.06-1.10 x at batch 64
    assert not preferred(128, 4, False)
    assert not preferred(96, 4, True)
    assert not preferred(8, 4, True)
    assert not preferred(128, 1, True)


@contextlib.contextmanager
def _fa3_on_a_fake_hopper(flashmla, monkeypatch, *, scale, num_sms=12):
    """The builder's FA3 rows (``flashmla_fa3_rows``) as on an H100 with
    FlashInfer: the device plan's FlashInfer calls stood in by a wrapper that
    executes the plan arrays the device planner rewrote."""
    from tests.support.fa3_plan_interpreter import flashinfer_planned_fa3
    from vllm.v1.attention.ops.flashmla_fa3_rows import FA3RowPlans

    def fa3_row_plans(builder, *, fp8, **_):  # the CPU builder counts one SM
        if fp8:
            return None
        return FA3RowPlans(num_heads=builder.dcp_setting.gathered_heads,
                           page_size=BLOCK_SIZE, dtype=torch.bfloat16,
                           max_cols=builder.dcp_setting.block_table_width,
                           num_sms=num_sms, kv_lora_rank=512, rope_dim=64,
                           device=builder.device)

    monkeypatch.setattr(flashmla.FlashMLADCPMetadataBuilder, "_fa3_row_plans",
                        fa3_row_plans)
    # The builder reads the scale off the group's impls; these tests make
    # the impls outside vLLM's forward context.
    monkeypatch.setattr(flashmla.FlashMLADCPMetadataBuilder, "_group_softmax_scale",
                        lambda self, what: scale)
    with flashinfer_planned_fa3() as wrapper:
        yield wrapper


@needs_triton
@pytest.mark.parametrize("world,interleave,seq_len,causal", [
    (2, 1, 700, True), (8, 64, 70, False), (8, 1, 300, True), (4, 16, 3, False)])
def test_triton_path_lone_request_fa3_merges_to_full_attention(
        flashmla, tmp_path, monkeypatch, world, interleave, seq_len, causal):
    """A lone bf16 request per rank on Hopper runs FA3 with its plan made
    on the device (no FlashMLA call), ranks with no key (a request shorter
    than W x I) included; every rank's rows merge to full attention. A
    batch of more requests than ``FA3_MAX_REQS`` keeps FlashMLA (checked at
    W 2)."""
    monkeypatch.setitem(CASES, "lone", ([seq_len], [NUM_SPEC + 1]))
    from vllm.v1.attention.ops.flashmla_fa3_rows import FA3_MAX_REQS

    more = FA3_MAX_REQS + 1
    monkeypatch.setitem(CASES, "more", ([seq_len] + [129] * FA3_MAX_REQS,
                                        [NUM_SPEC + 1] * more))
    scale = random_decode_batch([1], [1], block_size=BLOCK_SIZE,
                                num_heads=NUM_HEADS).scale
    with _fa3_on_a_fake_hopper(flashmla, monkeypatch, scale=scale) as wrapper:
        out, lse, ref_out, ref_lse = _run_ranks(
            flashmla, tmp_path, world=world, interleave=interleave, causal=causal,
            shape="lone", fp8=False, seed=world + seq_len)
        assert flashmla.kernel.calls == [] and wrapper.runs == world * NUM_LAYERS
        torch.testing.assert_close(out, ref_out, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)
        if world > 2:
            return
        out, lse, ref_out, ref_lse = _run_ranks(
            flashmla, tmp_path, world=world, interleave=interleave, causal=causal,
            shape="more", fp8=False, seed=world)
        assert flashmla.kernel.calls and wrapper.runs == world * NUM_LAYERS
        torch.testing.assert_close(out, ref_out, atol=2e-2, rtol=2e-2)


@needs_triton
def test_triton_path_builder_kept_across_forwards(flashmla, tmp_path):
    """The real builders kept as vLLM keeps them: every forward makes a new
    FlashMLA scheduler object (the stand-in refuses one reused over new
    lengths) and merges to full attention."""
    kept = {}
    for shape, seed in (("uniform", 0), ("cut_last", 3), ("short", 1), ("padded", 2),
                        ("cut_first", 4)):
        out, lse, ref_out, ref_lse = _run_ranks(
            flashmla, tmp_path, world=2, interleave=1, causal=True, shape=shape,
            fp8=False, seed=seed, kept=kept)
        torch.testing.assert_close(out, ref_out, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)


@contextlib.contextmanager
def _rank0_of_2(flashmla, tmp_path, *, dcp=2, causal=True):
    from vllm.config import set_current_vllm_config

    config = make_vllm_config(tmp_path / "model", dcp=dcp, block_size=BLOCK_SIZE,
                              num_speculative_tokens=NUM_SPEC)
    config.model_config.dtype = torch.bfloat16
    seq_lens, query_lens = CASES["uniform"]
    batch = random_decode_batch(seq_lens, query_lens, block_size=BLOCK_SIZE,
                                num_heads=NUM_HEADS)
    with fake_dcp_group(dcp, 0), set_current_vllm_config(config):
        builder = make_builder(flashmla.FlashMLADCPMetadataBuilder, config,
                               non_causal=not causal)
        impl = make_mla_impl(flashmla.FlashMLADCPImpl, num_heads=NUM_HEADS,
                             scale=batch.scale)
        common = common_metadata(seq_lens, query_lens, batch.block_table,
                                 world_size=dcp, rank=0, interleave=1, causal=causal)
        yield config, builder, impl, batch, common


def test_layer_refuses_a_forward_the_builder_did_not_plan(flashmla, tmp_path):
    with _rank0_of_2(flashmla, tmp_path) as (_, builder, impl, batch, common):
        first = builder.build(0, common)
        builder.build(0, common)
        with pytest.raises(RuntimeError, match="no plan for this forward"):
            impl.forward_mqa(batch.q.bfloat16(), batch.kv_cache.bfloat16(), first,
                             _layer(False))


def test_rows_beyond_the_requests_are_refused(flashmla, tmp_path):
    """More rows than the requests' tiles hold is an error, not a tiling."""
    with _rank0_of_2(flashmla, tmp_path) as (_, builder, _, _, common):
        metadata = builder.build(0, common)
        planner = builder._flashmla_rows
        with pytest.raises(ValueError, match="do not fit 5 requests of at most 4"):
            planner.plan(metadata.decode.flat, common.block_table_tensor,
                         query_start_loc=common.query_start_loc,
                         query_start_loc_cpu=common.query_start_loc_cpu,
                         num_rows=21, causal=True, forward_id=9)


def test_dcp_decodes_speculative_blocks_only(flashmla, tmp_path):
    """Under DCP the verify block (1 + k) and the draft block decode on the
    rows; upstream's 128-token small-prefill threshold stays for DCP 1."""
    from vllm.v1.attention.backends.mla.dcp_metadata import DCPDecodeMetadata

    for causal in (True, False):
        with _rank0_of_2(flashmla, tmp_path, causal=causal) as (_, builder, *_):
            assert builder.reorder_batch_threshold == 1 + NUM_SPEC
    with _rank0_of_2(flashmla, tmp_path, dcp=1) as (_, builder, _, _, common):
        assert builder.reorder_batch_threshold == 128
        assert builder.dcp_setting is None
        metadata = builder.build(0, common)
        assert not isinstance(metadata.decode, DCPDecodeMetadata)
        assert type(metadata.decode).__name__ == "FlashMLADecodeMetadata"


def test_dcp1_is_upstreams_flashmla(flashmla, tmp_path):
    """At DCP 1 the impl's decode is upstream's call, bit for bit: FlashMLA
    with its own causal mask over the whole sequence."""
    with _rank0_of_2(flashmla, tmp_path, dcp=1) as (config, builder, impl, batch, common):
        metadata = builder.build(0, common)
        q = batch.q.bfloat16()
        ours = impl.forward_mqa(q, batch.kv_cache.bfloat16(), metadata, _layer(False))
        from vllm.v1.attention.backends.mla.flashmla import FlashMLAImpl

        theirs = FlashMLAImpl.forward_mqa(impl, q, batch.kv_cache.bfloat16(), metadata,
                                          _layer(False))
    assert all(call["causal"] for _, call in flashmla.kernel.calls)
    assert torch.equal(ours[0], theirs[0])


def test_selection_flags_follow_the_dcp_size(flashmla, tmp_path):
    """Non-causal DSpark blocks and the host-offset rule are this backend's
    only under DCP; at DCP 1 they are upstream's."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.mla.flashmla import FlashMLABackend

    backend = flashmla.FlashMLADCPBackend
    for dcp, non_causal, mismatch in ((1, FlashMLABackend.supports_non_causal(),
                                       FlashMLABackend.supports_device_cpu_query_lens_mismatch()),
                                      (2, True, False)):
        with set_current_vllm_config(make_vllm_config(tmp_path / f"m{dcp}", dcp=dcp)):
            assert backend.supports_non_causal() is non_causal
            assert backend.supports_device_cpu_query_lens_mismatch() is mismatch


def test_fa3_rows_where_hopper_bf16_and_flashinfer(flashmla, tmp_path, monkeypatch):
    """The builder gives FLASHMLA's planner FA3 rows on an sm90 CUDA device
    in bf16 / fp16 with FlashInfer installed, unless
    ``VLLM_DCP_FLASHMLA_FA3=0``; never for an fp8 cache, on another GPU or
    on the CPU; and the planner takes them for one request's block only."""
    import importlib.util

    from vllm.v1.attention.ops.flashmla_fa3_rows import FA3RowPlans, fa3_rows_preferred

    with _rank0_of_2(flashmla, tmp_path) as (config, builder, *_):
        assert builder._flashmla_rows._fa3 is None  # the CPU builder
        hopper = SimpleNamespace(vllm_config=config, device=torch.device("cuda", 0),
                                 dcp_setting=builder.dcp_setting, mla_dims=builder.mla_dims)
        monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())

        def fa3(fp8=False, dtype=torch.bfloat16, major=9, switch=None, self=hopper):
            monkeypatch.setattr(flashmla.checks, "current_gpu_major", lambda: major)
            if switch is None:
                monkeypatch.delenv(flashmla.FA3_SWITCH, raising=False)
            else:
                monkeypatch.setenv(flashmla.FA3_SWITCH, switch)
            config.model_config.dtype = dtype
            return flashmla.FlashMLADCPMetadataBuilder._fa3_row_plans(
                self, fp8=fp8, num_sms=132)

        plans = fa3()
        assert isinstance(plans, FA3RowPlans)
        assert (plans.num_heads, plans.page_size, plans.num_sms, plans.max_cols) == (
            NUM_HEADS, BLOCK_SIZE, 132, builder.dcp_setting.block_table_width)
        assert isinstance(fa3(dtype=torch.float16), FA3RowPlans)
        assert isinstance(fa3(switch="1"), FA3RowPlans)
        assert fa3(fp8=True) is None and fa3(major=10) is None and fa3(switch="0") is None
        assert fa3(self=SimpleNamespace(**{**vars(hopper), "device": torch.device("cpu")})
                   ) is None
        monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
        assert fa3() is None
    assert fa3_rows_preferred(num_reqs=1, query_len=1 + NUM_SPEC, fp8=False)
    assert fa3_rows_preferred(num_reqs=1, query_len=2, fp8=False)
    assert not fa3_rows_preferred(num_reqs=1, query_len=1, fp8=False)
    assert not fa3_rows_preferred(num_reqs=2, query_len=1 + NUM_SPEC, fp8=False)
    assert not fa3_rows_preferred(num_reqs=1, query_len=1 + NUM_SPEC, fp8=True)


@runs_where_triton_cannot
def test_interpreter_runs_triton_path_tests():
    """Every CI run: the triton_path tests under Triton's interpreter."""
    run_triton_path_tests(__file__)
