# SPDX-License-Identifier: Apache-2.0
"""An MLA prefill with a paged context on CPU, checked in float64.

vLLM's own prefill (``MLACommonBaseImpl.forward_mha``: the context chunk
loop, the CPU SDPA prefill backend's LSE, ``merge_attn_states``; under DCP
``_context_parallel_compute_prefill_context`` with ``reorg_kvcache``) runs
over chunked-context metadata from vLLM's planner
(``build_mla_chunked_context_metadata``) with a workspace small enough to
cut each context into several chunks. Its cache gathers are the plugin's
torch kernels, called through vLLM's wrappers in ``vllm._custom_ops``
(``torch.ops._C_cache_ops``). Under DCP (W 2 and 4, interleave 1 and 16)
every rank's cache holds its interleaved share of the context (in pages as
a busy KV manager hands them out: out of order, unused pages between them,
null entries past each request's pages, NaN in every slot without context)
and the DCP group's all-gather hands the layer each rank's local gather,
made by the same gather call over that rank's cache, in rank order. The
output must equal float64 causal attention over context + new tokens, and
the context vLLM reassembles must equal the context exactly.

fp8: vLLM's CPU_MLA declares only ``--kv-cache-dtype auto``
(``supported_kv_cache_dtypes``; vLLM's CPU selector does not enforce it),
so with an fp8 cache the plugin leaves both features off, as vLLM's CPU
platform sets them; the dequantizing gather, which vLLM's DCP context path
calls for an fp8 cache, is still checked here with a float32 scale of 0.05
under DCP.

Then the config side, built by vLLM's ``EngineArgs``: where the plugin keeps
the features on, what it leaves to vLLM (fp8, the switch
``VLLM_DCP_CPU_PREFILL_FEATURES=0``, sparse MLA, no gathers) and its log line.
"""

from __future__ import annotations

import contextlib
import itertools
from unittest import mock

import pytest
import torch

from vllm.model_executor.layers.attention.mla_attention import (
    MLACommonBaseImpl,
    MLACommonPrefillMetadata,
    build_mla_chunked_context_metadata,
)
from vllm.v1.attention.backends.mla import cpu_mla_prefill_context
from vllm.v1.attention.backends.mla.prefill.cpu_sdpa import CPUSDPAMLAPrefillBackend

HEADS, KV_LORA, ROPE, NOPE, V = 2, 32, 16, 16, 16
BLOCK = 16
# Context and new tokens per prefill: one without context, one shorter than
# a chunk, two longer than the workspace holds (several chunks each).
CONTEXT = [0, 37, 90, 150]
NEW = [5, 3, 8, 4]
WORKSPACE_ROWS = 64
DTYPE = torch.float32  # the model dtype; merge_attn_states takes no float64
FP8_SCALE = float(torch.tensor(0.05))  # a float32 scale, as vLLM's _k_scale


@pytest.fixture(autouse=True, scope="module")
def context_gathers():
    cpu_mla_prefill_context.install_context_gathers()
    assert cpu_mla_prefill_context.context_gathers_present()


class KVBProj(torch.nn.Linear):
    """``kv_b_proj`` as vLLM's layer calls it: ``(out, bias)``."""

    def forward(self, x):
        return super().forward(x), None


class PrefillLayer:
    """What ``MLACommonBaseImpl``'s prefill reads off its impl; its methods
    are vLLM's."""

    forward_mha = MLACommonBaseImpl.forward_mha
    _compute_prefill_context = MLACommonBaseImpl._compute_prefill_context
    _context_parallel_compute_prefill_context = (
        MLACommonBaseImpl._context_parallel_compute_prefill_context)
    _concat_k_nope_k_pe = MLACommonBaseImpl._concat_k_nope_k_pe
    _use_flashinfer_concat_mla_k = False

    def __init__(self, world: int, kv_cache_dtype: str, seed: int):
        gen = torch.Generator().manual_seed(seed)
        self.dcp_world_size = world
        self.num_heads = HEADS
        self.kv_lora_rank, self.qk_rope_head_dim = KV_LORA, ROPE
        self.qk_nope_head_dim, self.v_head_dim = NOPE, V
        self.scale = (NOPE + ROPE) ** -0.5
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_b_proj = KVBProj(KV_LORA, HEADS * (NOPE + V), bias=False,
                                 dtype=DTYPE)
        with torch.no_grad():
            self.kv_b_proj.weight.copy_(
                torch.randn(self.kv_b_proj.weight.shape, generator=gen) * 0.3)


def owner_and_local(position: torch.Tensor, world: int, interleave: int):
    """vLLM's DCP layout: the rank holding ``position`` and its local index."""
    owner = (position // interleave) % world
    local = (position // (interleave * world)) * interleave + position % interleave
    return owner, local


def block_table(world: int, interleave: int, seed: int):
    """Each request's pages, as vLLM's KV manager hands them out after other
    requests came and went: page ids in random order, a random half of the
    pool left unused between them (gaps), page 0 (vLLM's null block) where a
    row needs no page. Returns ``(table [requests, pages per request], pool
    size)``; the table is the same on every rank."""
    gen = torch.Generator().manual_seed(1000 + seed)
    per_request = -(-max(CONTEXT) // (BLOCK * world)) + 1
    needed = [0 if c == 0 else -(-(int(owner_and_local(
        torch.arange(c), world, interleave)[1].max()) + 1) // BLOCK)
        for c in CONTEXT]
    pool = 1 + 2 * sum(needed)
    pages = (1 + torch.randperm(pool - 1, generator=gen))[:sum(needed)]
    table = torch.zeros(len(CONTEXT), per_request, dtype=torch.int32)
    for request, (n, start) in enumerate(zip(needed, [0, *itertools.accumulate(
            needed)])):
        table[request, :n] = pages[start:start + n]
    return table, pool


def paged_caches(context: list[torch.Tensor], world: int, interleave: int,
                 cache_dtype: torch.dtype, seed: int = 0):
    """Every rank's paged cache [pages, BLOCK, D] holding its share of each
    request's ``context`` [C, D] in the pages of ``block_table`` (every slot
    without context NaN: a gather reading a wrong page or slot shows), and
    the table."""
    table, pool = block_table(world, interleave, seed)
    caches = [torch.full((pool, BLOCK, KV_LORA + ROPE), float("nan"),
                         dtype=torch.float32).to(cache_dtype) for _ in range(world)]
    for request, latent in enumerate(context):
        owner, local = owner_and_local(torch.arange(latent.shape[0]), world,
                                       interleave)
        for rank in range(world):
            mine = owner == rank
            blocks = table[request, local[mine] // BLOCK].long()
            caches[rank][blocks, local[mine] % BLOCK] = latent[mine].to(cache_dtype)
    return caches, table


def chunk_context(latent: torch.Tensor, start: int, length: int, world: int,
                  interleave: int) -> torch.Tensor:
    """Positions ``start .. start + length - 1`` of ``latent`` [C, D] in the
    order vLLM's DCP context path reassembles a chunk (``reorg_kvcache``):
    rank by rank, each rank's positions in order."""
    position = torch.arange(start, start + length)
    owner, _ = owner_and_local(position, world, interleave)
    return latent[position[torch.argsort(owner * len(latent) + position)]]


@contextlib.contextmanager
def every_ranks_gather(caches: list[torch.Tensor], rank_order: list[int],
                       reassembled: list[torch.Tensor]):
    """The DCP group's all-gather: the layer's last gather call (through
    vLLM's wrapper, to the plugin's op) repeated over each rank's cache,
    placed in ``rank_order``; each chunk's reassembled context is kept."""
    from vllm import _custom_ops
    from vllm.model_executor.layers.attention import mla_attention

    last = {}

    def recording(name):
        upstream = getattr(_custom_ops, name)

        def gather(*args, **kwargs):
            last["call"] = (upstream, kwargs)
            return upstream(*args, **kwargs)
        return gather

    def kv_gather(gathered_kv, local_kv):
        upstream, kwargs = last.pop("call")
        toks = local_kv.shape[0]
        for slot, rank in enumerate(rank_order):
            dst = torch.zeros_like(kwargs["dst"])
            upstream(**{**kwargs, "src_cache": caches[rank], "dst": dst})
            gathered_kv[slot * toks:(slot + 1) * toks] = dst[:toks]

    reorg = mla_attention.reorg_kvcache

    def keeping_reorg(*args, **kwargs):
        kv_c, k_pe = reorg(*args, **kwargs)
        reassembled.append(torch.cat([kv_c[:, 0], k_pe[:, 0]], dim=-1).clone())
        return kv_c, k_pe

    with mock.patch.object(_custom_ops, "cp_gather_cache",
                           recording("cp_gather_cache")), \
            mock.patch.object(_custom_ops, "gather_and_maybe_dequant_cache",
                              recording("gather_and_maybe_dequant_cache")), \
            mock.patch.object(mla_attention, "reorg_kvcache", keeping_reorg):
        yield mock.Mock(kv_gather=kv_gather)


def reference(layer, q, context, new_latent):
    """Float64 causal attention of each request's new tokens over its
    context and new tokens: [T, H, V]."""
    outs, start = [], 0
    w_kv = layer.kv_b_proj.weight.double()
    q, new_latent = q.double(), new_latent.double()
    for request, latent in enumerate(context):
        n = NEW[request]
        keys = torch.cat([latent, new_latent[start:start + n]])
        kv = (keys[:, :KV_LORA] @ w_kv.T).view(-1, HEADS, NOPE + V)
        k = torch.cat([kv[..., :NOPE], keys[:, None, KV_LORA:].expand(-1, HEADS, -1)],
                      dim=-1)
        scores = torch.einsum("qhd,khd->hqk", q[start:start + n], k) * layer.scale
        seen = torch.arange(keys.shape[0])[None, :] <= (
            CONTEXT[request] + torch.arange(n))[:, None]
        scores = scores.masked_fill(~seen, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), kv[..., NOPE:]))
        start += n
    return torch.cat(outs)


def run_prefill(world: int, interleave: int, kv_cache_dtype: str = "auto",
                rank_order: list[int] | None = None, seed: int = 0):
    """vLLM's prefill with context as rank 0: ``(output [T, H, V], reference
    [T, H, V], [(reassembled, expected context) per chunk])``."""
    gen = torch.Generator().manual_seed(seed)
    layer = PrefillLayer(world, kv_cache_dtype, seed)
    fp8 = kv_cache_dtype != "auto"
    context = [torch.randn(c, KV_LORA + ROPE, generator=gen).double()
               for c in CONTEXT]
    if fp8:  # the cache holds fp8 values of latent / scale
        context = [(c / FP8_SCALE).to(torch.float8_e4m3fn).double() * FP8_SCALE
                   for c in context]
        caches, table = paged_caches([c / FP8_SCALE for c in context], world,
                                     interleave, torch.float8_e4m3fn, seed)
        caches = [c.view(torch.uint8) for c in caches]
    else:
        caches, table = paged_caches(context, world, interleave, DTYPE, seed)
    tokens = sum(NEW)
    q = torch.randn(tokens, HEADS, NOPE + ROPE, generator=gen)
    new_latent = torch.randn(tokens, KV_LORA + ROPE, generator=gen)
    query_start_loc = torch.tensor([0, *NEW], dtype=torch.int32).cumsum(0).to(torch.int32)

    rows = WORKSPACE_ROWS + (WORKSPACE_ROWS // world if world > 1 else 0)
    workspace = torch.empty(rows, KV_LORA + ROPE, dtype=DTYPE)
    reassembled: list[torch.Tensor] = []
    with every_ranks_gather(caches, rank_order or list(range(world)),
                            reassembled) as dcp_manager:
        chunked = build_mla_chunked_context_metadata(
            context_lens_cpu=torch.tensor(CONTEXT, dtype=torch.int32),
            prefill_query_start_loc_cpu=query_start_loc,
            chunked_prefill_workspace=workspace,
            chunked_prefill_workspace_size=WORKSPACE_ROWS,
            block_size=BLOCK, align_chunk_to_block=False, device=torch.device("cpu"),
            dcp_world_size=world, dcp_local_block_size=interleave,
            dcp_virtual_block_size=interleave * world,
            dcp_manager=dcp_manager if world > 1 else None)
        backend = CPUSDPAMLAPrefillBackend(
            num_heads=HEADS, scale=layer.scale, kv_lora_rank=KV_LORA,
            qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V,
            vllm_config=None)
        prefill = MLACommonPrefillMetadata(
            block_table=table, query_start_loc=query_start_loc,
            max_query_len=max(NEW), chunked_context=chunked,
            q_data_type=DTYPE, prefill_backend=backend)
        backend.prepare_metadata(prefill)
        output = torch.empty(tokens, HEADS * V, dtype=DTYPE)
        layer.forward_mha(q, new_latent[:, :KV_LORA], new_latent[:, None, KV_LORA:],
                          caches[0], mock.Mock(prefill=prefill),
                          torch.tensor([FP8_SCALE if fp8 else 1.0]), output)
    expected = [torch.cat([
        chunk_context(context[request].to(DTYPE), start, length, world, interleave)
        for request, start, length in zip(
            range(chunk.request_slice.start, chunk.request_slice.stop),
            chunk.starts.tolist() if world == 1 else
            [local_start * world for local_start in chunk.local_starts],
            chunk.seq_lens.tolist())])
        for chunk in chunked.chunks]
    return (output.view(tokens, HEADS, V), reference(layer, q, context, new_latent),
            list(zip(reassembled, expected)), len(chunked.chunks))


@pytest.mark.parametrize("world,interleave", [(1, 1), (2, 1), (2, 16), (4, 1),
                                              (4, 16)])
def test_prefill_with_chunked_context_equals_float64(world, interleave):
    output, expected, chunks, num_chunks = run_prefill(world, interleave)
    assert num_chunks >= 3  # the context is read in several chunks
    if world > 1:
        assert len(chunks) == num_chunks
        for reassembled, context in chunks:
            assert torch.equal(reassembled, context)
    # CPU SDPA computes in float32.
    torch.testing.assert_close(output.double(), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("world,interleave", [(2, 1), (4, 16)])
def test_fp8_cache_with_scale_under_dcp(world, interleave):
    output, expected, chunks, num_chunks = run_prefill(world, interleave, "fp8")
    assert num_chunks >= 3
    for reassembled, context in chunks:
        assert torch.equal(reassembled, context)
    torch.testing.assert_close(output.double(), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("world,interleave", [(1, 1), (2, 16), (4, 1)])
def test_pages_are_scattered(world, interleave):
    """The tables above are not one run of pages: ids out of order, unused
    pages between them, null (0) entries past each request's pages."""
    table, pool = block_table(world, interleave, 0)
    used = table[table > 0]
    assert used.unique().numel() == used.numel() < pool - 1
    assert (used.diff() != 1).any() and (used.diff() < 0).any()
    assert (table[0] == 0).all() and (table[1:, -1] == 0).all()


def test_wrong_rank_order_is_seen():
    """The check above can fail: ranks all-gathered out of order."""
    output, expected, chunks, _ = run_prefill(4, 1, rank_order=[1, 0, 2, 3])
    assert not all(torch.equal(r, c) for r, c in chunks)
    # (A rank's gather may reach the unwritten, NaN slots of another's.)
    assert not torch.allclose(output.double(), expected, rtol=0, atol=1e-2)


def test_cp_gather_cache_and_dequant_gather_alone():
    """The ops as vLLM's wrappers call them, against the cache entries:
    sequence starts, row offsets, and fp8 bytes times the scale."""
    from vllm import _custom_ops as ops

    gen = torch.Generator().manual_seed(3)
    cache = torch.randn(9, BLOCK, 8, generator=gen, dtype=torch.float64)
    table = torch.tensor([[3, 1, 7], [2, 8, 5]], dtype=torch.int32)
    cu_seq_lens = torch.tensor([0, 20, 27], dtype=torch.int32)
    starts = torch.tensor([5, 30], dtype=torch.int32)
    expected = torch.cat([
        torch.cat([cache[3], cache[1], cache[7]])[5:25],
        torch.cat([cache[2], cache[8], cache[5]])[30:37]])
    dst = torch.zeros(27, 8, dtype=torch.float64)
    ops.cp_gather_cache(cache, dst, table, cu_seq_lens, 2, starts)
    assert torch.equal(dst, expected)

    fp8 = (cache / FP8_SCALE).to(torch.float8_e4m3fn)
    dst = torch.zeros(27, 8, dtype=torch.float64)
    token_to_seq = torch.repeat_interleave(torch.arange(2, dtype=torch.int32),
                                           torch.tensor([20, 7]))
    ops.gather_and_maybe_dequant_cache(
        fp8.view(torch.uint8), dst, table, cu_seq_lens, token_to_seq, 27, "fp8",
        torch.tensor([FP8_SCALE]), starts)
    fp8_expected = torch.cat([
        torch.cat([fp8[3], fp8[1], fp8[7]])[5:25],
        torch.cat([fp8[2], fp8[8], fp8[5]])[30:37]]).double() * FP8_SCALE
    assert torch.equal(dst, fp8_expected)
    with pytest.raises(ValueError, match="fp8_ds_mla"):
        ops.gather_and_maybe_dequant_cache(
            fp8.view(torch.uint8), dst, table, cu_seq_lens, token_to_seq, 27,
            "fp8_ds_mla", torch.tensor([FP8_SCALE]), starts)


def test_cpu_mla_declares_only_model_dtype_kv_cache():
    """vLLM's CPU MLA backend declares only the model dtype's KV cache (its
    CPU selector does not check it: an fp8 cache is not refused at start)."""
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend

    assert CPUMLABackend.supported_kv_cache_dtypes == ["auto"]
    assert not CPUMLABackend.supports_kv_cache_dtype("fp8")


@pytest.fixture(scope="module")
def tiny_mla(tmp_path_factory):
    from tests.support.tiny_mla import build_tiny_mla_checkpoint

    return build_tiny_mla_checkpoint(tmp_path_factory.mktemp("tiny-mla"))


def cpu_config(model, **overrides):
    """vLLM's config for the tiny MLA model on CPU, built as ``vllm serve``
    builds it (the plugin loaded, the CPU platform's hook run)."""
    from vllm.engine.arg_utils import EngineArgs

    args = dict(model=str(model), dtype="float32", attention_backend="CPU_MLA",
                max_model_len=512, max_num_batched_tokens=32)
    return EngineArgs(**{**args, **overrides}).create_engine_config()


@pytest.mark.parametrize("dcp", [1, 2])
def test_cpu_mla_keeps_prefix_caching_and_chunked_prefill(tiny_mla, dcp):
    config = cpu_config(tiny_mla, tensor_parallel_size=dcp,
                        decode_context_parallel_size=dcp)
    assert config.cache_config.enable_prefix_caching
    assert config.scheduler_config.enable_chunked_prefill
    assert config.scheduler_config.max_num_batched_tokens == 32


def test_flags_still_turn_them_off(tiny_mla):
    config = cpu_config(tiny_mla, enable_prefix_caching=False)
    assert not config.cache_config.enable_prefix_caching
    assert config.scheduler_config.enable_chunked_prefill
    config = cpu_config(tiny_mla, enable_chunked_prefill=False,
                        max_num_batched_tokens=None)
    assert config.cache_config.enable_prefix_caching
    assert not config.scheduler_config.enable_chunked_prefill


def assert_vllms_choice(config):
    """The CPU platform's own choice for an MLA model: both features off and
    the token budget raised to at least the model length."""
    assert not config.cache_config.enable_prefix_caching
    assert not config.scheduler_config.enable_chunked_prefill
    assert config.scheduler_config.max_num_batched_tokens >= 512


def test_fp8_cache_keeps_vllms_choice(tiny_mla):
    """CPU_MLA declares only ``auto`` (vLLM's CPU context gather asserts on a
    quantized cache at the first prefill with a context): with
    ``--kv-cache-dtype fp8`` the features stay as the CPU platform sets
    them."""
    assert_vllms_choice(cpu_config(tiny_mla, kv_cache_dtype="fp8",
                                   max_num_batched_tokens=None))
    why = cpu_mla_prefill_context.left_off_because(cpu_config(
        tiny_mla, kv_cache_dtype="fp8"))
    # vLLM 0.32's selector gives CPU_MLA, which declares auto only; 0.34's
    # refuses an fp8 MLA cache on CPU itself.
    assert why.startswith("CPU_MLA serves --kv-cache-dtype auto, not fp8") or (
        "--kv-cache-dtype fp8 is not supported by MLA attention on CPU" in why), why


@pytest.mark.parametrize("switch", ["0", "false", "off", "no"])
@pytest.mark.parametrize("dcp", [1, 2])
def test_switch_off_keeps_vllms_choice(tiny_mla, monkeypatch, switch, dcp):
    """``VLLM_DCP_CPU_PREFILL_FEATURES=0``: stock vLLM's config at any -dcp
    (under DCP the start-up checks accept it: decode reads the sharded cache
    through the DCP backend, prefills then have no context)."""
    monkeypatch.setenv(cpu_mla_prefill_context.ENV_SWITCH, switch)
    assert_vllms_choice(cpu_config(
        tiny_mla, tensor_parallel_size=dcp, decode_context_parallel_size=dcp,
        max_num_batched_tokens=None, enable_prefix_caching=True,
        enable_chunked_prefill=True))


@pytest.mark.parametrize("switch", ["1", "true", "on", ""])
def test_switch_on_keeps_them_on(tiny_mla, monkeypatch, switch):
    monkeypatch.setenv(cpu_mla_prefill_context.ENV_SWITCH, switch)
    config = cpu_config(tiny_mla)
    assert config.cache_config.enable_prefix_caching
    assert config.scheduler_config.enable_chunked_prefill


@pytest.mark.parametrize("prefix,chunked", [(True, True), (False, True),
                                            (True, False)])
def test_log_line_names_what_was_kept_on(tiny_mla, monkeypatch, prefix, chunked):
    """The line after vLLM's "forcing chunked prefill and prefix caching to
    be disabled" says which features the plugin kept on and that it
    overrides that line; a feature the flags turned off is named as off."""
    lines = []
    monkeypatch.setattr(cpu_mla_prefill_context.logger, "info_once",
                        lambda msg, *args, **kwargs: lines.append(msg % args))
    cpu_config(tiny_mla, enable_prefix_caching=prefix,
               enable_chunked_prefill=chunked,
               **({} if chunked else dict(max_num_batched_tokens=None)))
    (line,) = lines
    kept = " and ".join(name for name, on in (("chunked prefill", chunked),
                                             ("prefix caching", prefix)) if on)
    assert line.startswith(f"vllm-dcp-dspark: {kept} kept on for MLA on CPU "
                           "(this overrides vLLM's line above forcing both off")
    off = [name for name, on in (("prefix caching", prefix),
                                 ("chunked prefill", chunked)) if not on]
    for name in off:
        assert f"{name} stays off, as the engine arguments set it" in line
    assert ("token budget 32" in line) == chunked
    assert line.endswith("VLLM_DCP_CPU_PREFILL_FEATURES=0 leaves vLLM's choice.")


def test_without_the_gathers_vllm_turns_them_off(tiny_mla, monkeypatch):
    """Where the context gathers are missing, the CPU platform's own
    choice stands."""
    monkeypatch.setattr(cpu_mla_prefill_context, "context_gathers_present",
                        lambda: False)
    config = cpu_config(tiny_mla, max_num_batched_tokens=None)
    assert not config.cache_config.enable_prefix_caching
    assert not config.scheduler_config.enable_chunked_prefill
    assert config.scheduler_config.max_num_batched_tokens >= 512


@pytest.fixture(scope="module")
def tiny_sparse_mla(tmp_path_factory):
    """The tiny model with a DeepSeek-V3.2-style indexer (``index_topk``):
    vLLM builds its MLA layers sparse, which CPU_MLA does not run."""
    import json

    from tests.support.tiny_mla import build_tiny_mla_checkpoint

    path = build_tiny_mla_checkpoint(tmp_path_factory.mktemp("tiny-sparse-mla"))
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    config.update(index_topk=64, index_n_heads=4, index_head_dim=64)
    config_file.write_text(json.dumps(config))
    return path


def test_sparse_mla_keeps_vllms_choice(tiny_sparse_mla):
    config = cpu_config(tiny_sparse_mla)
    assert config.model_config.use_mla
    assert not config.cache_config.enable_prefix_caching
    assert not config.scheduler_config.enable_chunked_prefill


def test_mla_without_kv_lora_rank_keeps_vllms_choice(tiny_mla, monkeypatch):
    """A ``use_mla`` model without ``kv_lora_rank`` (DeepSeek-V4-style
    configs: ``head_dim`` and ``compress_ratios``): the hook raises nothing
    and the CPU platform's choice stands."""
    monkeypatch.setattr(cpu_mla_prefill_context, "context_gathers_present",
                        lambda: False)
    config = cpu_config(tiny_mla, max_num_batched_tokens=None)
    monkeypatch.undo()
    assert cpu_mla_prefill_context.context_gathers_present()

    class WithoutKvLoraRank:
        def __init__(self, hf):
            self._hf = hf

        def __getattr__(self, name):
            if name == "kv_lora_rank":
                raise AttributeError(name)
            return getattr(self._hf, name)

    monkeypatch.setattr(config.model_config, "hf_text_config",
                        WithoutKvLoraRank(config.model_config.hf_text_config))
    assert config.model_config.use_mla
    cpu_mla_prefill_context.keep_features_on(config, (True, True, 32))
    assert not config.cache_config.enable_prefix_caching
    assert not config.scheduler_config.enable_chunked_prefill
    assert config.scheduler_config.max_num_batched_tokens >= 512
