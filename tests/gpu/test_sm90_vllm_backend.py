# SPDX-License-Identifier: Apache-2.0
"""FLASHMLA, FLASHINFER_MLA and TRITON_MLA on sm90 as vLLM drives them, on the GPU.

vLLM's own classes on a real sm90 device: its selector, ``VllmConfig``,
``CommonAttentionMetadata``, its ``CudaGraphManager``'s capture shapes, and
this project's builders and impls (``FlashMLADCPMetadataBuilder`` /
``FlashMLADCPImpl`` with vLLM's FlashMLA kernels, bf16 and fp8;
``FlashInferDCPMLAMetadataBuilder`` / ``FlashInferDCPMLAImpl`` with
FlashInfer's FA3; the Triton rows) with the Triton metadata and tail kernels. W DCP ranks
are simulated in one process (a fake DCP group, each rank its own builder
kept across forwards and its own shard of a random paged cache); the ranks'
``forward_mqa`` outputs, merged, must equal float32 dense attention
(``dense_reference.full_attention``).

- eager forwards: causal verify (ragged: blocks cut as vLLM's scheduler cuts
  them) and the non-causal block; per
  builder a first forward, one at the same lengths with new pages and
  queries (FlashInfer's plan reused), one where a request filled a local
  page, one where a request joined (planned again);
- CUDA graphs, as Model Runner V2 captures them (``UNIFORM_BATCH``): for the
  target verify (1 + k tokens per request) and the DSpark draft (a k-token
  block, layers numbered after the target's, up to 2k host over-count),
  every FULL uniform-decode shape vLLM's ``CudaGraphManager`` lists for the
  config is captured once per rank (metadata from
  ``build_for_cudagraph_capture`` into persistent buffers, a warm-up run,
  then the capture of every layer's ``forward_mqa``); afterwards each
  shape is replayed for new batches of that size (fewer real requests,
  random lengths, new block tables and queries) after vLLM's ``build``:
  replay must equal the eager run bitwise and the merged ranks dense
  attention; between verify replays a batch of cut blocks runs eagerly on
  the same builders.

Needs an sm90 GPU, FlashInfer and vLLM's Python (``gpu/README.md``);
skipped otherwise. ``tests/test_flashinfer_dcp_mla.py`` runs the same
builder on CPU with a stand-in for FA3.
"""

from __future__ import annotations

import contextlib
import os
import random
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
    pytest.skip("needs an sm90 GPU", allow_module_level=True)
pytest.importorskip("flashinfer.mla")
pytest.importorskip("vllm.v1.worker.gpu.cudagraph_utils")

from tests.support.builder_harness import (  # noqa: E402
    TINY_MLA_CONFIG, common_metadata, fake_dcp_group, make_builder, make_mla_impl,
    make_vllm_config)
from tests.support.dense_reference import (  # noqa: E402
    LATENT, DecodeBatch, full_attention)
from tests.support.vllm_capture_shapes import full_decode_shapes  # noqa: E402

from vllm.v1.attention.ops.dcp_decode import DCPLayout, merge_partials  # noqa: E402
from tools.dcp_simulated_ranks import (  # noqa: E402
    random_paged_kv, shard_paged_kv)

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda")
NUM_HEADS = 16  # every rank's heads after DCP's query gather
NUM_SPEC = 4
BLOCK_SIZE = 64
NUM_LAYERS = 2
MAX_NUM_SEQS = 16
MAX_LEN = 1200  # global tokens a request slot's pages can hold
SCALE = 0.0721
TARGET_LAYERS = TINY_MLA_CONFIG["num_hidden_layers"]


# backend -> (module, builder class, impl class, KV-cache dtype): this
# project's overrides.
BACKENDS = {
    "flashinfer": ("flashinfer_dcp_mla", "FlashInferDCPMLAMetadataBuilder",
                   "FlashInferDCPMLAImpl", "auto"),
    "triton": ("triton_dcp_mla", "TritonDCPMLAMetadataBuilder", "TritonDCPMLAImpl",
               "auto"),
    "flashmla": ("flashmla_dcp_mla", "FlashMLADCPMetadataBuilder", "FlashMLADCPImpl",
                 "auto"),
    "flashmla-fp8": ("flashmla_dcp_mla", "FlashMLADCPMetadataBuilder",
                     "FlashMLADCPImpl", "fp8"),
}
BACKENDS["flashmla-tokens"] = BACKENDS["flashmla"]
BACKENDS["flashmla-fp8-tokens"] = BACKENDS["flashmla-fp8"]
# FLASHMLA with its rows as one-token FlashMLA requests, forced on (these
# tests' 16 heads would keep the tiles): flashmla_token_rows.
TOKEN_ROWS = ("flashmla-tokens", "flashmla-fp8-tokens")
# Backends whose graph replay must equal their eager run bitwise.
BITWISE_REPLAY = ("flashinfer", "flashmla", "flashmla-fp8") + TOKEN_ROWS
# fp8 per-tensor scales of the stand-in layer (vLLM's _q_scale / _k_scale).
Q_SCALE, K_SCALE = 0.05, 0.1
FP8 = torch.float8_e4m3fn


def _module(backend="flashinfer"):
    import importlib

    return importlib.import_module(
        f"vllm.v1.attention.backends.mla.{BACKENDS[backend][0]}")


def _classes(backend):
    module = _module(backend)
    _, builder, impl, _ = BACKENDS[backend]
    return getattr(module, builder), getattr(module, impl)


def _layer(fp8=False):
    q_scale, k_scale = (Q_SCALE, K_SCALE) if fp8 else (1.0, 1.0)
    return SimpleNamespace(_q_scale_float=q_scale, _k_scale_float=k_scale,
                           _q_scale=torch.tensor([q_scale], device=DEVICE),
                           _k_scale=torch.tensor([k_scale], device=DEVICE),
                           dcp_manager=SimpleNamespace(combine=mock.Mock()))


def _fp8_rounded(values, scale):
    """``values`` as an fp8 tensor of scale ``scale`` holds them (float32)."""
    return (values.float() / scale).to(FP8).float() * scale


class SimulatedRanks:
    """W ranks of one KV-cache group: builders, impls, sharded caches and the
    persistent input buffers a model runner keeps (block table, lengths,
    query offsets, queries), all on the GPU."""

    def __init__(self, tmp_path, *, world, interleave, draft, seed,
                 backend="flashinfer"):
        builder_cls, impl_cls = _classes(backend)
        kv_cache_dtype = BACKENDS[backend][3]
        self.fp8 = kv_cache_dtype == "fp8"
        self.world, self.interleave, self.draft = world, interleave, draft
        self.causal = not draft
        # Made before any capture: a CUDA graph cannot copy a new scale in.
        self.layer = _layer(self.fp8)
        self.query_len = NUM_SPEC if draft else 1 + NUM_SPEC
        self.config = make_vllm_config(
            tmp_path / "model", dcp=world, interleave=interleave,
            block_size=BLOCK_SIZE, num_speculative_tokens=NUM_SPEC,
            max_num_seqs=MAX_NUM_SEQS, num_heads=NUM_HEADS, executor="mp")
        self.config.model_config.dtype = torch.bfloat16
        self.config.cache_config.cache_dtype = kv_cache_dtype
        self.shapes = full_decode_shapes(self.config, self.query_len)
        # As DFlashSpeculator.attn_vllm_config gives the draft's builders.
        self.config.attention_config.use_non_causal = draft
        first = TARGET_LAYERS if draft else 0
        self.layer_names = [f"model.layers.{first + i}.self_attn.attn"
                            for i in range(NUM_LAYERS)]
        # Request slots of MAX_LEN tokens; every layer pages them alike (one
        # KV-cache group), with its own contents, rounded to bf16.
        gen = torch.Generator().manual_seed(seed)
        paged = [random_paged_kv([MAX_LEN] * MAX_NUM_SEQS, BLOCK_SIZE,
                                 generator=gen, width=LATENT)
                 for _ in range(NUM_LAYERS)]
        self.slot_table = paged[0].block_table
        caches = [_fp8_rounded(p.kv_cache, K_SCALE) if self.fp8
                  else p.kv_cache.bfloat16().float() for p in paged]
        layout = DCPLayout(world, interleave=interleave)
        full = torch.tensor([MAX_LEN] * MAX_NUM_SEQS, dtype=torch.int32)
        shards = [shard_paged_kv(cache, self.slot_table, full, layout=layout,
                                 generator=torch.Generator().manual_seed(7))
                  for cache in caches]
        self.ranks = []
        token_rows = {"VLLM_DCP_FLASHMLA_TOKEN_ROWS": "1" if backend in TOKEN_ROWS else "0"}
        for rank in range(world):
            with self.rank_context(rank), mock.patch.dict(os.environ, token_rows):
                builder = make_builder(builder_cls, self.config,
                                       layer_names=self.layer_names,
                                       non_causal=draft, device=DEVICE)
                impl = make_mla_impl(impl_cls, num_heads=NUM_HEADS, scale=SCALE,
                                     kv_cache_dtype=kv_cache_dtype)
            width = builder._dcp_rows.block_table.shape[1]
            local_table = shards[0][rank][1]
            table = torch.zeros(MAX_NUM_SEQS, width, dtype=torch.int32)
            table[:, :local_table.shape[1]] = local_table
            self.ranks.append(SimpleNamespace(
                builder=builder, impl=impl, local_table=table,
                caches=[self.stored(shards[i][rank][0], K_SCALE).to(DEVICE)
                        for i in range(NUM_LAYERS)],
                table=torch.zeros_like(table, device=DEVICE),
                seq_lens=torch.zeros(MAX_NUM_SEQS, dtype=torch.int32, device=DEVICE),
                qsl=torch.zeros(MAX_NUM_SEQS + 1, dtype=torch.int32, device=DEVICE)))
        # The builders read the group's softmax scale off the layers' impls.
        context = self.config.compilation_config.static_forward_context
        for name in self.layer_names:
            context[name].impl = self.ranks[0].impl
        max_tokens = builder._dcp_rows.num_rows
        self.q = [torch.zeros(max_tokens, NUM_HEADS, LATENT,
                              dtype=FP8 if self.fp8 else torch.bfloat16,
                              device=DEVICE) for _ in range(NUM_LAYERS)]
        self.dense_caches = [cache.to(DEVICE) for cache in caches]

    def stored(self, values, scale):
        """``values`` (already representable) in the kernels' storage dtype:
        fp8 of ``scale``, or bf16."""
        if self.fp8:
            return (values / scale).to(FP8)
        return values.bfloat16()

    @contextlib.contextmanager
    def rank_context(self, rank):
        from vllm.config import set_current_vllm_config

        with fake_dcp_group(self.world, rank), set_current_vllm_config(self.config):
            yield

    def common(self, rank, batch):
        """vLLM's metadata of ``batch`` on ``rank``, over the persistent
        buffers (written here, as the model runner writes its own)."""
        state = self.ranks[rank]
        num_reqs = len(batch.seq_lens)
        state.table[:num_reqs].copy_(state.local_table[batch.slots])
        state.seq_lens[:num_reqs].copy_(torch.tensor(batch.seq_lens))
        common = common_metadata(batch.seq_lens, batch.query_lens,
                                 state.table[:num_reqs], world_size=self.world,
                                 rank=rank, interleave=self.interleave,
                                 causal=self.causal)
        state.qsl[:num_reqs + 1].copy_(common.query_start_loc)
        common.query_start_loc = state.qsl[:num_reqs + 1]
        common.seq_lens = state.seq_lens[:num_reqs]
        common.dcp_local_seq_lens = common.dcp_local_seq_lens.to(DEVICE)
        common.slot_mapping = common.slot_mapping.to(DEVICE)
        common.num_actual_tokens = batch.num_tokens
        common.max_query_len = max(max(batch.query_lens), 1)
        common.seq_lens_cpu_upper_bound = torch.tensor(
            [n + over if n else 0 for n, over in zip(batch.seq_lens, batch.overcount)],
            dtype=torch.int32)
        return common

    def set_queries(self, batch):
        for q, layer_q in zip(self.q, batch.q):
            q[:batch.num_tokens].copy_(self.stored(layer_q.float(), Q_SCALE))

    def forward(self, rank, metadata, num_tokens):
        """Every layer's ``forward_mqa``: [(out, lse)] per layer."""
        state = self.ranks[rank]
        return [state.impl.forward_mqa(q[:num_tokens], cache, metadata, self.layer)
                for q, cache in zip(self.q, state.caches)]

    def dense(self, batch):
        """Per layer, float32 dense attention of the batch's real tokens."""
        refs = []
        for cache, q in zip(self.dense_caches, batch.q):
            real = sum(batch.query_lens)
            dense_batch = DecodeBatch(
                kv_cache=cache,
                block_table=self.slot_table[batch.slots].to(DEVICE),
                seq_lens=torch.tensor(batch.seq_lens, dtype=torch.int32),
                query_start_loc=torch.tensor(
                    [0] + list(_cumsum(batch.query_lens)), dtype=torch.int32),
                q=q[:real].float().to(DEVICE), scale=SCALE)
            refs.append(full_attention(dense_batch, causal=self.causal))
        return refs


def _cumsum(values):
    total = 0
    for value in values:
        total += value
        yield total


def make_batch(sim, rng, *, num_reqs, num_tokens, query_lens=None, seq_lens=None,
               overcount=None, slots=None, dummy=False):
    """A decode batch padded to ``num_reqs`` requests / ``num_tokens`` rows.

    ``dummy``: vLLM's capture batch (every request ``query_len`` tokens of
    ``query_len`` length, as ``InputBatch.make_dummy``); otherwise real
    requests of random lengths (some below W x I) and host over-counts up
    to what vLLM hands over (k for the target, 2k for the draft)."""
    q_len = sim.query_len
    if dummy:
        query_lens, seq_lens = [q_len] * num_reqs, [q_len] * num_reqs
        overcount = [0] * num_reqs
    else:
        if query_lens is None:
            real = rng.randint(max(1, num_reqs // 2), num_reqs)
            query_lens = [q_len] * real + [0] * (num_reqs - real)
        if seq_lens is None:
            short = sim.world * sim.interleave
            seq_lens = [0 if not n else
                        (rng.randint(n, max(n, short)) if rng.random() < 0.3
                         else rng.randint(n, MAX_LEN - 2 * NUM_SPEC)) for n in query_lens]
        if overcount is None:
            most = 2 * NUM_SPEC if sim.draft else NUM_SPEC
            overcount = [rng.choice([0, most, rng.randint(0, most)]) for _ in query_lens]
    if slots is None:
        slots = rng.sample(range(MAX_NUM_SEQS), num_reqs)
    gen = torch.Generator().manual_seed(rng.randint(0, 1 << 30))
    q = [torch.randn(num_tokens, NUM_HEADS, LATENT, generator=gen) for _ in range(NUM_LAYERS)]
    q = [(_fp8_rounded(x, Q_SCALE) if sim.fp8 else x.bfloat16().float()).to(DEVICE)
         for x in q]
    return SimpleNamespace(query_lens=list(query_lens), seq_lens=list(seq_lens),
                           overcount=list(overcount), slots=list(slots), q=q,
                           num_tokens=num_tokens)


def fp8_kernel_alone_errors(sim, batch, layer, ref_out, ref_lse):
    """How far vLLM's fp8 FlashMLA alone (no DCP: upstream's call over the
    whole cache, its own mask) is from float32 attention on the same fp8
    values: (max out error, max LSE error). Its fp8 kernel rounds more than
    the bf16 one; the DCP rows may differ from dense by about as much."""
    from vllm.v1.attention.ops import flashmla

    cache = sim.stored(sim.dense_caches[layer], K_SCALE).unsqueeze(-2)
    outs, lses, start = [], [], 0
    # One call per request (b = 1, s = its query length): ragged batches too.
    for q_len, seq_len, slot in zip(batch.query_lens, batch.seq_lens, batch.slots):
        if not q_len:
            continue
        q = sim.stored(batch.q[layer][start:start + q_len].float(), Q_SCALE)
        start += q_len
        lens = torch.tensor([seq_len], dtype=torch.int32, device=DEVICE)
        tile, splits = flashmla.get_mla_metadata_dense_fp8(lens, q_len * NUM_HEADS, 1)
        out, lse = flashmla.flash_mla_with_kvcache_fp8(
            q=q.view(1, q_len, NUM_HEADS, LATENT), k_cache=cache,
            block_table=sim.slot_table[[slot]].to(DEVICE),
            cache_seqlens=lens, head_dim_v=LATENT - 64, tile_scheduler_metadata=tile,
            num_splits=splits, softmax_scale=SCALE, causal=sim.causal,
            descale_q=sim.layer._q_scale, descale_k=sim.layer._k_scale)
        outs.append(out.float().view(-1, NUM_HEADS, LATENT - 64))
        lses.append(lse.transpose(1, 2).reshape(-1, NUM_HEADS))
    out, lse = torch.cat(outs), torch.cat(lses)
    return ((out - ref_out.to(DEVICE)).abs().max().item(),
            (lse - ref_lse.to(DEVICE)).abs().max().item())


def check_merged(sim, batch, per_rank):
    """The ranks' partials of every layer, merged, against dense attention:
    within bf16 rounding, or for fp8 within twice the fp8 kernel's own error
    without DCP (``fp8_kernel_alone_errors``)."""
    real = sum(batch.query_lens)
    for layer, (ref_out, ref_lse) in enumerate(sim.dense(batch)):
        outs = torch.stack([r[layer][0][:real].float() for r in per_rank])
        lses = torch.stack([r[layer][1][:real] for r in per_rank])
        out, lse = merge_partials(outs, lses)
        out_tol, lse_tol = 2e-2, 1e-3
        if sim.fp8:
            alone_out, alone_lse = fp8_kernel_alone_errors(sim, batch, layer,
                                                           ref_out, ref_lse)
            out_tol, lse_tol = max(out_tol, 2 * alone_out), max(lse_tol, 2 * alone_lse)
        torch.testing.assert_close(out, ref_out.to(out.device), atol=out_tol, rtol=2e-2)
        torch.testing.assert_close(lse, ref_lse.to(lse.device), atol=lse_tol, rtol=1e-4)
        assert all(bool((r[layer][0][real:batch.num_tokens] == 0).all())
                   for r in per_rank), "padding rows must be 0"


def test_selector_picks_the_dcp_backends_on_sm90(tmp_path):
    """vLLM's selector on this sm90 GPU at -dcp 2, with vLLM's FlashMLA
    kernels loaded: the non-causal DSpark block gets this project's FLASHMLA
    (no upstream Hopper backend serves it under DCP), bf16 and fp8; an fp8
    target too (FLASH_ATTN_MLA has no fp8)."""
    from vllm.config import set_current_vllm_config
    from vllm.platforms import current_platform
    from vllm.plugins import load_general_plugins
    from vllm.v1.attention.ops.flashmla import is_flashmla_dense_supported
    from vllm.v1.attention.selector import get_attn_backend

    assert current_platform.get_device_capability().major == 9
    assert is_flashmla_dense_supported() == (True, None)
    load_general_plugins()  # as every vLLM process does: the entry point
    config = make_vllm_config(tmp_path / "model", dcp=2, block_size=BLOCK_SIZE,
                              num_speculative_tokens=NUM_SPEC, executor="mp")
    for non_causal, kv_cache_dtype in ((True, "auto"), (True, "fp8"), (False, "fp8")):
        config.attention_config.use_non_causal = non_causal
        with set_current_vllm_config(config):
            backend = get_attn_backend(LATENT, torch.bfloat16, kv_cache_dtype,
                                       use_mla=True, num_heads=NUM_HEADS)
        assert backend is _module("flashmla").FlashMLADCPBackend, (
            non_causal, kv_cache_dtype, backend)


@pytest.mark.parametrize("world,interleave", [(2, 1), (4, 16), (8, 1), (8, 64)])
@pytest.mark.parametrize("draft", [False, True], ids=["verify", "draft"])
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_eager_forwards_merge_to_dense(tmp_path, backend, world, interleave, draft):
    """Four forwards per builder; on FLASHINFER_MLA each rank plans FA3 on
    the first, reuses the plan on the second (new pages, same schedule) and
    plans again after a page filled and after a request joined."""
    sim = SimulatedRanks(tmp_path, world=world, interleave=interleave, draft=draft,
                         seed=world, backend=backend)
    rng = random.Random(world * 10 + draft)
    q_len = sim.query_len
    # Verify blocks as vLLM's scheduler cuts them (token budget): ragged on
    # every backend (FLASHMLA tiles them to the longest); a DSpark block is
    # always k tokens.
    query_lens = [q_len] * 5 if draft else [5, 1, 3, 2, 4]
    seq_lens = [rng.randint(400, 600), rng.randint(1, 8), rng.randint(200, 500),
                world * interleave - 1, rng.randint(50, 120)]
    seq_lens = [max(n, q) for n, q in zip(seq_lens, query_lens)]
    overcount = [2 * NUM_SPEC if draft else NUM_SPEC] * 5
    slots = rng.sample(range(MAX_NUM_SEQS), 6)
    # One more local page on every rank.
    grown = [n + BLOCK_SIZE * world if i == 0 else n
             for i, n in enumerate(seq_lens)]
    steps = [  # (query lens, seq lens, slots, FA3 plans expected on each rank)
        (query_lens, seq_lens, slots[:5], 1),
        (query_lens, seq_lens, slots[1:6], 0),  # new pages, same schedule
        (query_lens, grown, slots[:5], 1),  # request 0 filled a local page
        (query_lens + [q_len], grown + [300], slots, 1),  # a request joined
    ]
    for query_lens_i, seq_lens_i, slots_i, expected_plans in steps:
        batch = make_batch(sim, rng, num_reqs=len(query_lens_i),
                           num_tokens=sum(query_lens_i), query_lens=query_lens_i,
                           seq_lens=seq_lens_i, overcount=overcount[:1] * len(seq_lens_i),
                           slots=slots_i)
        sim.set_queries(batch)
        per_rank = []
        for rank, state in enumerate(sim.ranks):
            with sim.rank_context(rank):
                planner = getattr(state.builder, "_sm90", None)  # FLASHINFER_MLA
                kernel = planner.kernel if planner is not None else None
                before = kernel.fa3_plans if kernel is not None else 0
                metadata = state.builder.build(0, sim.common(rank, batch))
                per_rank.append(sim.forward(rank, metadata, batch.num_tokens))
                if backend == "flashinfer":
                    kernel = metadata.decode.plan
                    assert type(kernel).__name__ == "FlashInferSm90MLA"
                    assert kernel.fa3_plans - before == expected_plans, (
                        rank, seq_lens_i)
        check_merged(sim, batch, per_rank)


@pytest.mark.parametrize("world,interleave", [(2, 1), (4, 16), (8, 1), (8, 64)])
@pytest.mark.parametrize("draft", [False, True], ids=["verify", "draft"])
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_graphs_at_every_shape_vllm_captures(tmp_path, backend, world, interleave,
                                             draft):
    """Replay equals the eager run of the same metadata: bitwise on
    FLASHINFER_MLA; on TRITON_MLA within bf16 rounding (its split count is
    set from the batch's max_seq_len, the captured dummy batch's in a
    graph)."""
    sim = SimulatedRanks(tmp_path, world=world, interleave=interleave, draft=draft,
                         seed=100 + world, backend=backend)
    rng = random.Random(world * 100 + draft)
    pool = torch.cuda.graph_pool_handle()
    captured = {}  # (rank, num_tokens) -> (graph, outputs)
    # Capture: every shape on every rank, as vLLM does before serving.
    for num_tokens, num_reqs in sim.shapes:
        dummy = make_batch(sim, rng, num_reqs=num_reqs, num_tokens=num_tokens,
                           dummy=True, slots=list(range(num_reqs)))
        sim.set_queries(dummy)
        for rank, state in enumerate(sim.ranks):
            with sim.rank_context(rank):
                for warmup in (True, False):
                    metadata = state.builder.build_for_cudagraph_capture(
                        sim.common(rank, dummy))
                    if warmup:
                        sim.forward(rank, metadata, num_tokens)
                        torch.cuda.synchronize()
                        continue
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        outputs = sim.forward(rank, metadata, num_tokens)
                    captured[rank, num_tokens] = (graph, outputs)
    # Serve: each shape replayed for new batches of its size; for the
    # verify, a batch of cut blocks between replays runs eagerly (vLLM
    # captures uniform batches only) over the same builder's buffers.
    order = [shape for shape in sim.shapes for _ in range(2)]
    rng.shuffle(order)
    for step, (num_tokens, num_reqs) in enumerate(order):
        if not draft and step % 2:
            cut = [sim.query_len, 2, sim.query_len, 1][:max(2, min(4, num_reqs))]
            ragged = make_batch(sim, rng, num_reqs=len(cut), num_tokens=sum(cut),
                                query_lens=cut)
            sim.set_queries(ragged)
            per_rank = []
            for rank, state in enumerate(sim.ranks):
                with sim.rank_context(rank):
                    metadata = state.builder.build(0, sim.common(rank, ragged))
                    assert metadata.num_decodes == len(cut), "a cut block went to prefill"
                    per_rank.append(sim.forward(rank, metadata, ragged.num_tokens))
            check_merged(sim, ragged, per_rank)
        batch = make_batch(sim, rng, num_reqs=num_reqs, num_tokens=num_tokens)
        sim.set_queries(batch)
        per_rank = []
        for rank, state in enumerate(sim.ranks):
            with sim.rank_context(rank):
                metadata = state.builder.build(0, sim.common(rank, batch))
                if backend.startswith("flashmla"):
                    # A lone bf16 request's block runs FA3 (flashmla_fa3_rows).
                    fa3 = metadata.decode.plan.fa3 is not None
                    bf16 = BACKENDS[backend][3] == "auto"
                    assert fa3 == (bf16 and num_reqs == 1), (backend, num_reqs, fa3)
                    tokens = metadata.decode.plan.token_rows
                    assert tokens == (backend in TOKEN_ROWS and not fa3), (
                        backend, num_reqs, tokens)
                graph, outputs = captured[rank, num_tokens]
                for out, lse in outputs:
                    out.fill_(float("nan"))
                    lse.fill_(float("nan"))
                graph.replay()
                replayed = [(out.clone(), lse.clone()) for out, lse in outputs]
                eager = sim.forward(rank, metadata, num_tokens)
            for (g_out, g_lse), (e_out, e_lse) in zip(replayed, eager):
                assert torch.equal(g_lse.isinf(), e_lse.isinf())
                if backend in BITWISE_REPLAY:
                    assert torch.equal(g_out, e_out), (rank, num_tokens, num_reqs)
                    torch.testing.assert_close(g_lse, e_lse, atol=1e-5, rtol=0)
                else:
                    torch.testing.assert_close(g_out, e_out, atol=2e-2, rtol=2e-2)
                    torch.testing.assert_close(g_lse, e_lse, atol=1e-4, rtol=1e-4)
            per_rank.append(replayed)
        check_merged(sim, batch, per_rank)
