# SPDX-License-Identifier: Apache-2.0
"""Smoke check of vLLM 0.32.0's Python + this overlay on the H200 (the bundle).

    bash gpu/vllm_on_device.sh python3 gpu/vllm_smoke.py [--no-e2e]

Steps (each reports OK or the error, and the run goes on):
  platform  vllm.__version__, current_platform's class, capability
  plugin    vllm.plugins.load_general_plugins() found the entry point and
            FLASHINFER_MLA's path is FlashInferDCPMLABackend
  selector  vllm.v1.attention.selector.get_attn_backend under a tiny MLA
            VllmConfig (config.json in a temp dir) at decode_context_parallel_size 2,
            set with set_current_vllm_config: the DSpark draft (non-causal) and
            the target (causal)
  fa3       flashinfer.mla.BatchMLAPagedAttentionWrapper(backend="fa3") plans and
            runs a tiny batch (JIT on first use) against float64 attention
  builder   FlashInferDCPMLAMetadataBuilder constructed on cuda with a fake DCP group
  e2e       the backend on 2 simulated DCP ranks through vLLM's classes: builder.build
            + FlashInferDCPMLAImpl.forward_mqa per rank (FA3 on the device),
            merged, against attention without DCP
Exit code: the number of failed steps.
"""

from __future__ import annotations

import math
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run by path: tests.support.*, tools.* from the checkout

import torch  # noqa: E402

TMP = Path(tempfile.mkdtemp(prefix="vllm_smoke_"))
RESULTS: dict[str, bool] = {}
HEADS = 16
PAGE = 64


def step(fn):
    name = fn.__name__
    t0 = time.time()
    print(f"=== {name}", flush=True)
    try:
        fn()
        RESULTS[name] = True
        print(f"=== {name}: OK ({time.time() - t0:.1f}s)", flush=True)
    except BaseException:  # noqa: BLE001 - report and go on
        RESULTS[name] = False
        traceback.print_exc()
        print(f"=== {name}: FAIL ({time.time() - t0:.1f}s)", flush=True)
    return fn


def config(dcp: int):
    from tests.support.builder_harness import make_vllm_config

    cfg = make_vllm_config(TMP / f"m{dcp}", dcp=dcp, block_size=PAGE, executor="mp",
                           num_speculative_tokens=3)
    cfg.model_config.dtype = torch.bfloat16
    return cfg


@step
def platform():
    import triton
    import vllm
    from vllm.platforms import current_platform

    print("vllm", vllm.__version__, vllm.__file__)
    print("torch", torch.__version__, "triton", triton.__version__,
          "cuda", torch.version.cuda, torch.cuda.get_device_name(0))
    print("current_platform", type(current_platform).__name__,
          "capability", current_platform.get_device_capability(),
          "is_cuda", current_platform.is_cuda())
    from vllm.platforms.cuda import CudaPlatformBase

    print("CudaPlatformBase subclass", isinstance(current_platform, CudaPlatformBase))
    assert current_platform.is_cuda() and isinstance(current_platform, CudaPlatformBase)


@step
def plugin():
    from importlib.metadata import entry_points

    from vllm.plugins import load_general_plugins
    from vllm.v1.attention.backends.mla.dcp_plugin import missing_hooks
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    print("entry points", [f"{e.name} = {e.value}" for e in
                           entry_points(group="vllm.general_plugins")])
    print("missing_hooks()", missing_hooks())
    load_general_plugins()
    path = AttentionBackendEnum.FLASHINFER_MLA.get_path()
    print("FLASHINFER_MLA.get_path()", path)
    assert path.endswith("flashinfer_dcp_mla.FlashInferDCPMLABackend"), path


@step
def selector():
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention import selector as sel
    from vllm.v1.attention.selector import get_attn_backend

    cfg = config(2)
    print("decode_context_parallel_size",
          cfg.parallel_config.decode_context_parallel_size)
    chosen = {}
    for role, non_causal in (("draft", True), ("target", False)):
        cfg.attention_config.use_non_causal = non_causal
        sel._cached_get_attn_backend.cache_clear()
        try:
            with set_current_vllm_config(cfg):
                backend = get_attn_backend(576, torch.bfloat16, "auto",
                                           use_mla=True, num_heads=HEADS)
            chosen[role] = f"{backend.get_name()} ({backend.__name__})"
        except Exception as error:  # noqa: BLE001
            chosen[role] = f"{type(error).__name__}: {error}"
        print(f"dcp=2 {role}: {chosen[role]}")
    cfg.attention_config.use_non_causal = False
    assert chosen["draft"] == "FLASHINFER_MLA (FlashInferDCPMLABackend)", chosen


@step
def fa3():
    from tests.support.dense_reference import full_attention, random_decode_batch
    from tests.support.fa3_native import NativeFA3MLA

    batch = random_decode_batch([37, 300, 5, 130], [4, 4, 4, 1], block_size=PAGE,
                                num_heads=HEADS, seed=1)
    batch.q = batch.q.bfloat16().float()
    batch.kv_cache = batch.kv_cache.bfloat16().float()
    ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    mla = NativeFA3MLA(ws, num_heads=HEADS, page_size=PAGE, sm_scale=batch.scale)
    print("wrapper", type(mla._wrapper).__module__, type(mla._wrapper).__name__,
          "backend", getattr(mla._wrapper, "_backend", "?"))
    for causal in (True, False):
        t0 = time.time()
        mla.plan(batch.query_start_loc, batch.seq_lens,
                 batch.block_table.int().cuda(), causal=causal)
        out, lse = mla.run(batch.q.bfloat16().cuda(), batch.kv_cache.bfloat16().cuda())
        torch.cuda.synchronize()
        ref_out, ref_lse = full_attention(batch, causal=causal)
        d_out = (out.float().cpu() - ref_out.float()).abs().max().item()
        d_lse = (lse.cpu() * math.log(2) - ref_lse.float()).abs().max().item()
        print(f"causal={causal}: plan+run {time.time() - t0:.1f}s, "
              f"max |out - ref| {d_out:.2e}, max |lse - ref| {d_lse:.2e}")
        assert d_out < 2e-2 and d_lse < 1e-3, (d_out, d_lse)


def _builder(cfg, layer_names, non_causal):
    from tests.support.builder_harness import register_fake_mla_layers
    from tests.support.dense_reference import KV_LORA_RANK, ROPE_DIM
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.mla.flashinfer_dcp_mla import (
        FlashInferDCPMLAMetadataBuilder)
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    register_fake_mla_layers(cfg, layer_names, non_causal=non_causal)
    spec = MLAAttentionSpec(block_size=PAGE, num_kv_heads=1,
                            head_size=KV_LORA_RANK + ROPE_DIM, dtype=torch.bfloat16)
    with set_current_vllm_config(cfg):
        return FlashInferDCPMLAMetadataBuilder(spec, list(layer_names), cfg,
                                               torch.device("cuda"))


@step
def builder():
    from tests.support.builder_harness import fake_dcp_group
    from vllm.config import set_current_vllm_config

    cfg = config(2)
    with fake_dcp_group(2, 0), set_current_vllm_config(cfg):
        b = _builder(cfg, ["model.layers.2.self_attn.attn"], non_causal=True)
        print(type(b).__name__, "dcp_world_size", b.dcp_world_size,
              "rows_without_dcp (sm90)", b.rows_without_dcp,
              "cudagraph support", type(b).get_cudagraph_support(cfg, b.kv_cache_spec))


def _e2e(causal: bool):
    from tests.support.builder_harness import common_metadata, fake_dcp_group
    from tests.support.dense_reference import (KV_LORA_RANK, ROPE_DIM, full_attention,
                                               random_decode_batch)
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.mla import flashinfer_dcp_mla as fdm
    from vllm.v1.attention.ops.dcp_decode import DCPLayout
    from tools.dcp_simulated_ranks import decode_on_simulated_ranks

    world, spec_tokens = 2, 3
    seq_lens, query_lens = [37, 4, 300, 18, 130], [4, 4, 4, 4, 4]
    batch = random_decode_batch(seq_lens, query_lens, block_size=PAGE,
                                num_heads=HEADS, seed=2)
    batch.q = batch.q.bfloat16().float()
    null = batch.kv_cache[0].clone()
    batch.kv_cache = batch.kv_cache.bfloat16().float()
    batch.kv_cache[0] = null
    ref_out, ref_lse = full_attention(batch, causal=causal)
    cfg = config(world)
    first = 0 if causal else 2
    names = [f"model.layers.{first + i}.self_attn.attn" for i in range(2)]

    def decode_rank(layout, cache, table):
        with fake_dcp_group(world, layout.rank), set_current_vllm_config(cfg):
            b = _builder(cfg, names, non_causal=not causal)
            impl = fdm.FlashInferDCPMLAImpl(
                num_heads=HEADS, head_size=KV_LORA_RANK + ROPE_DIM,
                scale=batch.scale, num_kv_heads=1, alibi_slopes=None,
                sliding_window=None, kv_cache_dtype="auto", logits_soft_cap=None,
                attn_type="decoder", kv_sharing_target_layer_name=None,
                q_lora_rank=None, kv_lora_rank=KV_LORA_RANK, qk_nope_head_dim=128,
                qk_rope_head_dim=ROPE_DIM, qk_head_dim=128 + ROPE_DIM,
                v_head_dim=128, kv_b_proj=None)
            for name in names:
                cfg.compilation_config.static_forward_context[name].impl = impl
            common = common_metadata(seq_lens, query_lens, table, world_size=world,
                                     rank=layout.rank, interleave=1, causal=causal)
            common.seq_lens_cpu_upper_bound = (common.seq_lens + spec_tokens).int()
            for field in ("query_start_loc", "seq_lens", "block_table_tensor",
                          "slot_mapping", "dcp_local_seq_lens"):
                setattr(common, field, getattr(common, field).cuda())
            metadata = b.build(0, common)
            layer = SimpleNamespace(_q_scale_float=1.0, _k_scale_float=1.0,
                                    dcp_manager=SimpleNamespace(combine=mock.Mock()))
            out, lse = impl.forward_mqa(batch.q.bfloat16().cuda(),
                                        cache.bfloat16().cuda(), metadata, layer)
            print(f"  rank {layout.rank}: planned",
                  type(metadata.decode.plan).__name__)
            return out.float().cpu(), lse.float().cpu()

    out, lse = decode_on_simulated_ranks(batch.kv_cache, batch.block_table,
                                         batch.seq_lens, decode_rank,
                                         layout=DCPLayout(world, interleave=1))
    real = int(batch.query_start_loc[-1])
    d_out = (out[:real] - ref_out.float()).abs().max().item()
    d_lse = (lse[:real] - ref_lse.float()).abs().max().item()
    print(f"causal={causal} W={world}: max |out - ref| {d_out:.2e}, "
          f"max |lse - ref| {d_lse:.2e}")
    assert d_out < 2e-2 and d_lse < 1e-3, (d_out, d_lse)


if "--no-e2e" not in sys.argv:
    @step
    def e2e():
        _e2e(causal=True)
        _e2e(causal=False)


failed = [name for name, ok in RESULTS.items() if not ok]
print("SMOKE", "OK" if not failed else f"FAILED: {' '.join(failed)}",
      {name: ok for name, ok in RESULTS.items()})
sys.exit(len(failed))
