# SPDX-License-Identifier: Apache-2.0
"""FLASHMLA under DCP on Hopper: per layer, per decode step, per forward's host work.

The deployed shape: after DCP's query gather a rank attends heads_model x
DCP / TP heads (96 for Kimi-K3 at ``-tp 8 -dcp 8``, 128 for DeepSeek-V3)
over its local KV, q_len 4 (a verify block of 1 + 3, or a DSpark block of 4).
Every request holds ``local`` keys on rank 0 of W = 8, interleave 1 (global
length 8 x local), so the verify tails are the deployed ones.

``layer`` (one layer, CUDA-graph replay median, ``benchmarks._common.time_ms``):
- ``dcp``: ``FlashMLADCPImpl.forward_mqa`` on the builder's plan
  (``FlashMLARowPlanner``, with ``FA3RowPlans`` as the builder gives it on
  Hopper: a lone bf16 request runs FA3): FlashMLA over each request's shared
  prefix, the verify tails, the empty-row mask; bf16 or fp8 cache;
  ``--no-fa3`` plans FlashMLA for every batch (the rows before FA3);
- ``alone``: vLLM's FlashMLA as upstream's FLASHMLA calls it without DCP
  over the same ``local`` keys (``causal=True`` for verify, ``False`` for the
  draft block): the cost of DCP is dcp / alone;
- ``fa3`` (bf16): FLASHINFER_MLA's sm90 path (FA3 prefix + tails);
- ``fi-fp8``: FlashInfer's FA3 MLA wrapper with an fp8 e4m3 cache (bf16 q),
  one non-causal segment per request, where this FlashInfer takes it (its
  error against float32 attention is printed first: ``fi-fp8 check``).
Each against the bf16 roofline max(B x L x 576 x 2 B / 4.25 TB/s,
2 x B x q_len x H x L x (576 + 512) / 790 TFLOP/s).

``step``: 61 layers as one CUDA graph (layers cycle over distinct caches to
keep each layer's KV out of L2), W 1 (``alone`` over the whole context, what
vLLM runs at -dcp 1) against W 8 (``dcp`` over the rank's eighth).

``host``: wall time of the real metadata builder's ``build`` per forward
(vLLM's MLA build, the DCP rows, the plan), FLASHMLA against FLASHINFER_MLA
(whose FA3 plan is made on the host; a changed schedule replans).

Needs an sm90 GPU, vLLM's Python with its FlashMLA extensions and
FlashInfer (gpu/README.md)::

    python3 -m benchmarks.flashmla_rows --out-dir DIR [--parts layer step host]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from benchmarks._common import run_parts, time_ms
from vllm.v1.attention.ops.dcp_decode import DCPLayout
from vllm.v1.attention.ops.triton_dcp_metadata import build_flat_decode_triton

DV, DR, PAGE = 512, 64, 64
HBM_TBS, BF16_TFLOPS = 4.25, 790.0
WORLD = 8
FP8 = torch.float8_e4m3fn
K_SCALE, Q_SCALE = 0.1, 0.05


def hbm_tbs() -> float:
    """The card's KV read ceiling: the H200's measured copy rate, or an
    H100's (3.35 TB/s, the datasheet's); the matrix rate is the same chip's."""
    return 3.35 if "H100" in torch.cuda.get_device_name(0) else HBM_TBS


def roofline_us(batch, local, q_len, heads):
    flops = 2.0 * batch * q_len * heads * local * (DV + DR + DV)
    return max(batch * local * (DV + DR) * 2 / (hbm_tbs() * 1e12),
               flops / (BF16_TFLOPS * 1e12)) * 1e6


@contextlib.contextmanager
def rank0_of(world):
    from vllm.config import VllmConfig, set_current_vllm_config

    from tests.support.builder_harness import fake_dcp_group

    with fake_dcp_group(world, 0), set_current_vllm_config(VllmConfig()):
        yield


class Point:
    """One batch x local-keys point: caches (``copies`` distinct ones), the
    requests' table, the rows and queries, as rank 0 of W sees them."""

    def __init__(self, batch, local, q_len, heads, causal, fp8, world, gen, copies=1):
        dev = "cuda"
        self.batch, self.local, self.q_len, self.heads = batch, local, q_len, heads
        self.causal, self.fp8, self.world = causal, fp8, world
        self.scale = 1.0 / math.sqrt(192)
        pages = -(-local // PAGE)
        self.caches = []
        for _ in range(copies):
            cache = torch.randn(batch * pages + 1, PAGE, DV + DR, device=dev,
                                dtype=torch.bfloat16, generator=gen)
            self.caches.append((cache / K_SCALE).to(FP8) if fp8 else cache)
            del cache
        self.table = (torch.randperm(batch * pages, device=dev, generator=gen)
                      + 1).view(batch, pages).int()
        self.local_lens = torch.full((batch,), local, dtype=torch.int32, device=dev)
        global_lens = self.local_lens * world
        self.layout = DCPLayout(world, 0, 1)
        self.num_rows = batch * q_len
        self.qsl = (torch.arange(batch + 1, dtype=torch.int32) * q_len).to(dev)
        self.flat = build_flat_decode_triton(
            global_lens, self.qsl, self.table, layout=self.layout, causal=causal,
            num_rows=self.num_rows)
        q = torch.randn(self.num_rows, heads, DV + DR, device=dev,
                        dtype=torch.bfloat16, generator=gen)
        self.q = (q / Q_SCALE).to(FP8) if fp8 else q
        self.layer = SimpleNamespace(
            _q_scale=torch.tensor([Q_SCALE if fp8 else 1.0], device=dev),
            _k_scale=torch.tensor([K_SCALE if fp8 else 1.0], device=dev),
            _q_scale_float=Q_SCALE if fp8 else 1.0, _k_scale_float=K_SCALE if fp8 else 1.0)

    def dcp_fn(self, cache_index=0, fa3=True, token_rows=None, block_heads=True):
        """The FLASHMLA impl's ``forward_mqa`` on this point's plan (with the
        builder's FA3 for a lone bf16 request unless ``fa3`` is False;
        ``token_rows`` forces FlashMLA's one-token requests on or off, None
        as the builder chooses; ``block_heads`` False gives a DSpark block
        to FlashMLA as tokens with the finishing launch, the rows before)."""
        from tests.support.builder_harness import make_mla_impl
        from vllm.v1.attention.backends.mla.dcp_metadata import DCPDecodeMetadata
        from vllm.v1.attention.backends.mla.flashmla_dcp_mla import FlashMLADCPImpl
        from vllm.v1.attention.ops.flashmla_dcp_rows import FlashMLARowPlanner
        from vllm.v1.attention.ops.flashmla_fa3_rows import FA3RowPlans
        from vllm.utils.platform_utils import num_compute_units

        with rank0_of(self.world):
            impl = make_mla_impl(FlashMLADCPImpl, num_heads=self.heads, scale=self.scale,
                                 kv_cache_dtype="fp8" if self.fp8 else "auto")
        fa3_plans = None if self.fp8 or not fa3 else FA3RowPlans(
            num_heads=self.heads, page_size=PAGE, dtype=self.q.dtype,
            max_cols=self.table.shape[1], num_sms=num_compute_units(0),
            kv_lora_rank=DV, rope_dim=DR, device=self.q.device)
        planner = FlashMLARowPlanner(
            max_reqs=self.batch, max_rows=self.num_rows, num_heads=self.heads,
            kv_lora_rank=DV, fp8=self.fp8, num_sms=num_compute_units(0),
            device=self.q.device, fa3=fa3_plans, token_rows=token_rows,
            block_heads=block_heads)
        decode = DCPDecodeMetadata(
            block_table=self.table, seq_lens=self.local_lens,
            dcp_tot_seq_lens=self.local_lens * self.world, flat=self.flat,
            causal=self.causal, max_query_len=self.q_len, layout=self.layout,
            forward_id=1)
        decode.plan = planner.plan(self.flat, self.table, query_start_loc=self.qsl,
                                   query_start_loc_cpu=self.qsl.cpu(),
                                   num_rows=self.num_rows, causal=self.causal,
                                   forward_id=1, sm_scale=lambda: self.scale)
        metadata = SimpleNamespace(decode=decode, max_seq_len=self.local)
        return lambda i=cache_index: impl.forward_mqa(self.q, self.caches[i],
                                                      metadata, self.layer)

    def alone_fn(self, cache_index=0):
        """vLLM's FlashMLA without DCP, as upstream's FLASHMLA impl calls it."""
        from vllm.v1.attention.ops import flashmla

        q = self.q.view(self.batch, self.q_len, self.heads, DV + DR)
        if self.fp8:
            tile, splits = flashmla.get_mla_metadata_dense_fp8(
                self.local_lens, self.q_len * self.heads, 1)
            return lambda i=cache_index: flashmla.flash_mla_with_kvcache_fp8(
                q=q, k_cache=self.caches[i].unsqueeze(-2), block_table=self.table,
                cache_seqlens=self.local_lens, head_dim_v=DV,
                tile_scheduler_metadata=tile, num_splits=splits,
                softmax_scale=self.scale, causal=self.causal,
                descale_q=self.layer._q_scale, descale_k=self.layer._k_scale)
        sched = flashmla.get_mla_metadata()[0]
        return lambda i=cache_index: flashmla.flash_mla_with_kvcache(
            q=q, k_cache=self.caches[i].unsqueeze(-2), block_table=self.table,
            cache_seqlens=self.local_lens, head_dim_v=DV,
            tile_scheduler_metadata=sched, softmax_scale=self.scale,
            causal=self.causal)

    def fa3_fn(self):
        from tests.support.fa3_native import FlashInferSm90MLAGraphed

        ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
        kernel = FlashInferSm90MLAGraphed(ws, num_heads=self.heads, page_size=PAGE,
                                          sm_scale=self.scale, max_rows=self.num_rows,
                                          max_cols=self.table.shape[1])
        kernel.plan_rows(self.qsl.cpu(), (self.local_lens * self.world).cpu(),
                         self.table, self.flat, num_rows=self.num_rows,
                         causal=self.causal, slack=0, layout=self.layout)
        return lambda: kernel.run(self.q, self.caches[0])

    def flashinfer_fp8_fn(self):
        """FlashInfer's FA3 MLA over an fp8 cache (bf16 q), or the error."""
        from flashinfer.mla import BatchMLAPagedAttentionWrapper

        from tests.support.fa3_native import paged_kv_csr
        from vllm.v1.attention.ops.flashinfer_sm90_mla import plan_fa3_csr

        ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
        wrapper = BatchMLAPagedAttentionWrapper(ws, backend="fa3")
        indptr, indices = paged_kv_csr(self.local_lens, self.table, PAGE)
        shape = SimpleNamespace(num_heads=self.heads, kv_lora_rank=DV, rope_dim=DR,
                                page_size=PAGE, sm_scale=self.scale,
                                dtype=torch.bfloat16)
        wrapper.plan(**_fi_fp8_plan_args(self.heads, self.scale, self.qsl.cpu(),
                                         indptr, indices, self.local_lens.cpu()))
        q = (self.q.float() * Q_SCALE).bfloat16()
        cache = self.caches[0]
        return lambda: wrapper.run(query=q, kv_cache=cache, return_lse=True,
                                   ckv_scale=K_SCALE, kpe_scale=K_SCALE)


def _fi_fp8_plan_args(heads, scale, qo_indptr, kv_indptr, kv_indices, kv_lens):
    """FlashInfer's FA3 MLA plan for bf16 q over an fp8 e4m3 cache (per-tensor
    scale 1: the cache holds the values the check attends)."""
    from flashinfer.mla import MLAPlanMetadata

    return dict(
        metadata=MLAPlanMetadata.csr(qo_indptr=qo_indptr.int(), kv_indptr=kv_indptr.int(),
                                     kv_indices=kv_indices, kv_len_arr=kv_lens.int()),
        num_heads=heads, head_dim_ckv=DV, head_dim_kpe=DR,
        page_size=PAGE, causal=False, sm_scale=scale,
        q_data_type=torch.bfloat16, kv_data_type=FP8, lse_mode="base2")


def flashinfer_fp8_check(heads=96, batch=2, local=1024, q_len=4):
    """FlashInfer's FA3 MLA with an fp8 cache against float32 attention on
    the same fp8 values: (max |out error|, max |lse error| in natural log)."""
    from flashinfer.mla import BatchMLAPagedAttentionWrapper

    from tests.support.fa3_native import paged_kv_csr

    gen = torch.Generator("cuda").manual_seed(1)
    pages = local // PAGE
    cache = (torch.randn(batch * pages + 1, PAGE, DV + DR, device="cuda",
                         generator=gen) * 0.5).to(FP8)
    table = (torch.arange(batch * pages, device="cuda") + 1).view(batch, pages).int()
    lens = torch.full((batch,), local, dtype=torch.int32)
    qsl = torch.arange(batch + 1, dtype=torch.int32) * q_len
    q = torch.randn(batch * q_len, heads, DV + DR, device="cuda", generator=gen).bfloat16()
    scale = 1.0 / math.sqrt(192)
    ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    wrapper = BatchMLAPagedAttentionWrapper(ws, backend="fa3")
    indptr, indices = paged_kv_csr(lens, table, PAGE)
    wrapper.plan(**_fi_fp8_plan_args(heads, scale, qsl, indptr, indices, lens))
    out, lse = wrapper.run(query=q, kv_cache=cache, return_lse=True, ckv_scale=1.0,
                           kpe_scale=1.0)
    keys = cache[table.long()].float().view(batch, local, DV + DR)
    scores = torch.einsum("bthd,bkd->bthk", q.float().view(batch, q_len, heads, -1),
                          keys) * scale
    ref_lse = torch.logsumexp(scores, -1)
    ref_out = torch.einsum("bthk,bkd->bthd", scores.softmax(-1), keys[..., :DV])
    out_err = (out.float().view_as(ref_out) - ref_out).abs().max().item()
    lse_err = (lse.view_as(ref_lse) * math.log(2.0) - ref_lse).abs().max().item()
    return out_err, lse_err


def layer_part(args, gen):
    rows = []
    try:
        if not args.baselines:
            raise StopIteration
        out_err, lse_err = flashinfer_fp8_check()
        print(f"fi-fp8 check (96 heads, bf16 q, fp8 cache, vs float32): max out error "
              f"{out_err:.2e}, max lse error {lse_err:.2e}", flush=True)
    except StopIteration:
        pass
    except Exception as error:  # noqa: BLE001 - the finding is that it fails
        print(f"fi-fp8 check: FlashInfer's FA3 MLA takes no fp8 cache here: "
              f"{type(error).__name__}: {str(error)[:300]}", flush=True)
    print(f"{'H':>4}{'kind':>7}{'kv':>5}{'B':>4}{'local':>7}  "
          + "  ".join(f"{p:>13}" for p in ("dcp", "alone", "fa3|fi-fp8"))
          + "   us / fraction of the bf16 roofline; dcp/alone")
    for heads in args.heads:
        for causal in (True, False):
            for fp8 in (False, True):
                for batch in args.batch:
                    for local in args.local:
                        if batch * local * (DV + DR) * 2 > args.max_gib * 2**30:
                            continue
                        point = Point(batch, local, args.q_len, heads, causal, fp8,
                                      WORLD, gen)
                        roof = roofline_us(batch, local, args.q_len, heads)
                        paths = {"dcp": functools.partial(point.dcp_fn, fa3=args.fa3,
                                                          token_rows=args.token_rows),
                                 "alone": point.alone_fn}
                        if args.compare_rows:  # the rows before (tiles, finishing
                            # launch), as the builder now plans them, FlashMLA alone
                            paths = {"before": functools.partial(
                                point.dcp_fn, fa3=args.fa3, token_rows=False,
                                block_heads=False), **paths}
                        if args.baselines:
                            paths["fi-fp8" if fp8 else "fa3"] = (
                                point.flashinfer_fp8_fn if fp8 else point.fa3_fn)
                        fns, samples = {}, {path: [] for path in paths}
                        for path, make in paths.items():
                            try:
                                fns[path] = make()
                            except Exception as error:  # noqa: BLE001 - report it
                                print(f"  {path}: {type(error).__name__}: "
                                      f"{str(error)[:200]}")
                        for _ in range(args.repeats):  # the paths interleaved
                            for path, fn in fns.items():
                                samples[path].append(time_ms(fn) * 1e3)
                        times = {path: statistics.median(samples[path])
                                 if samples[path] else float("nan") for path in paths}
                        del fns
                        for path, us in times.items():
                            rows.append(dict(part="layer", path=path, heads=heads,
                                             kind="verify" if causal else "draft",
                                             kv="fp8" if fp8 else "bf16", batch=batch,
                                             local=local, q_len=args.q_len,
                                             us=round(us, 1), roofline_us=round(roof, 1),
                                             of_roofline=round(roof / us, 3)))
                        ratios = "".join(f" {p}/alone {times[p] / times['alone']:.3f}"
                                         for p in ("before", "dcp") if p in times)
                        print(f"{heads:4}{'verify' if causal else 'draft':>7}"
                              f"{'fp8' if fp8 else 'bf16':>5}{batch:4}{local // 1024:6}K  "
                              + "  ".join(f"{p} {us:.1f}/{roof / us:.2f}"
                                          for p, us in times.items())
                              + f"  {ratios}", flush=True)
                        del point
                        torch.cuda.empty_cache()
    return rows


def check_part(args, gen):
    """The rows as the builder plans them (``dcp``) against the rows before
    (tiles and the finishing launch) and float32 attention over each row's
    exact local keys, at the deployed head counts (the GPU tests run 16)."""
    rows = []
    for heads in args.heads:
        for causal in (True, False):
            for fp8 in (False, True):
                for batch in args.batch:
                    local = args.local[0] + 3  # a partial last page
                    point = Point(batch, local, args.q_len, heads, causal, fp8, WORLD, gen)
                    out, lse = point.dcp_fn(fa3=args.fa3, token_rows=args.token_rows)()
                    old_out, old_lse = point.dcp_fn(fa3=args.fa3, token_rows=False,
                                                    block_heads=False)()
                    ref_out, ref_lse = _dense_rows(point)
                    row = dict(part="check", heads=heads, kv="fp8" if fp8 else "bf16",
                               kind="verify" if causal else "draft", batch=batch,
                               local=local, bitwise_before=bool(torch.equal(out, old_out)),
                               out_err=(out.float() - ref_out).abs().max().item(),
                               lse_err=(lse - ref_lse).abs().max().item(),
                               before_out_err=(old_out.float() - ref_out).abs().max().item())
                    print("check", row, flush=True)
                    rows.append(row)
                    del point
    return rows


def _dense_rows(point):
    """float32 attention of every row over its own local keys (the rows'
    ``seq_lens``: rank 0's exact causal bounds), values as the cache holds
    them."""
    scale_q = Q_SCALE if point.fp8 else 1.0
    scale_k = K_SCALE if point.fp8 else 1.0
    q = point.q.float() * scale_q
    outs, lses = [], []
    for t in range(point.num_rows):
        bound = int(point.flat.seq_lens[t])
        pages = point.flat.block_table[t].long()
        keys = point.caches[0][pages].float().reshape(-1, DV + DR)[:bound] * scale_k
        scores = q[t] @ keys.T * point.scale  # [H, bound]
        lses.append(torch.logsumexp(scores, -1))
        outs.append(torch.softmax(scores, -1) @ keys[:, :DV])
    return torch.stack(outs), torch.stack(lses)


def step_part(args, gen):
    """61 layers as one graph: W 1 (alone over ctx) vs W 8 (dcp over ctx/8)."""
    rows = []
    for heads in args.heads[:1]:
        for fp8 in (False, True):
            for batch, ctx in [(b, c) for b, c in ((1, 262144), (64, 131072))
                               if b in args.step_batch]:
                # (world, FA3 for a lone bf16 request): W 1 alone, W 8 as
                # deployed, and for bf16 W 8 on FlashMLA only (the rows before FA3).
                runs = [(1, False), (WORLD, args.fa3)] + (
                    [(WORLD, False)] if args.fa3 and not fp8 else [])
                result = {}
                for world, fa3 in runs:
                    local = ctx // world
                    per_cache = batch * local * (DV + DR) * (1 if fp8 else 2)
                    copies = max(1, min(args.layers, int(args.pool_gib * 2**30 // per_cache)))
                    point = Point(batch, local, args.q_len, heads, True, fp8, WORLD, gen,
                                  copies=copies)
                    fns = [point.alone_fn(i) if world == 1
                           else point.dcp_fn(i, fa3=fa3, token_rows=args.token_rows)
                           for i in range(copies)]

                    def step(fns=fns):
                        for layer in range(args.layers):
                            fns[layer % len(fns)]()

                    result[world, fa3] = time_ms(step, rep=20) * 1e3
                    del point, fns
                    torch.cuda.empty_cache()
                w1, w8 = result[1, False], result[WORLD, args.fa3]
                without = result.get((WORLD, False))
                print(f"step H={heads} {'fp8' if fp8 else 'bf16'} B={batch} "
                      f"ctx={ctx // 1024}K: W1 {w1:.0f} us, W{WORLD} {w8:.0f} us, "
                      f"W{WORLD}/W1 {w8 / w1:.4f}"
                      + (f" (FlashMLA rows only: {without:.0f} us, {without / w1:.4f})"
                         if without is not None else ""), flush=True)
                rows.append(dict(part="step", heads=heads, kv="fp8" if fp8 else "bf16",
                                 batch=batch, ctx=ctx, layers=args.layers,
                                 w1_us=round(w1, 1), w8_us=round(w8, 1),
                                 ratio=round(w8 / w1, 4),
                                 w8_flashmla_only_us=(round(without, 1)
                                                      if without is not None else "")))
    return rows


def host_part(args):
    """The real builders' ``build`` per forward, wall time (host work)."""
    from vllm.config import set_current_vllm_config

    from tests.support.builder_harness import (common_metadata, fake_dcp_group,
                                               make_builder, make_mla_impl,
                                               make_vllm_config)

    import os

    # Long sequences on the tiny test model's config (4096 positions).
    os.environ["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
    rows = []
    batch, q_len, heads = 64, args.q_len, args.heads[0]
    for backend, module, builder_name, impl_name in (
            ("FLASHMLA", "flashmla_dcp_mla", "FlashMLADCPMetadataBuilder",
             "FlashMLADCPImpl"),
            ("FLASHINFER_MLA", "flashinfer_dcp_mla", "FlashInferDCPMLAMetadataBuilder",
             "FlashInferDCPMLAImpl")):
        import importlib

        mod = importlib.import_module(f"vllm.v1.attention.backends.mla.{module}")
        with tempfile.TemporaryDirectory() as tmp:
            config = make_vllm_config(Path(tmp) / "m", dcp=WORLD, block_size=PAGE,
                                      num_speculative_tokens=q_len - 1,
                                      max_num_seqs=batch, num_heads=heads,
                                      max_model_len=131072, executor="mp")
            config.model_config.dtype = torch.bfloat16
            with fake_dcp_group(WORLD, 0), set_current_vllm_config(config):
                builder = make_builder(getattr(mod, builder_name), config,
                                       device="cuda")
                impl = make_mla_impl(getattr(mod, impl_name), num_heads=heads,
                                     scale=0.07)
                context = config.compilation_config.static_forward_context
                context["model.layers.0.attn"].impl = impl
                width = builder._dcp_rows.block_table.shape[1]
                table = torch.arange(1, batch * width + 1, dtype=torch.int32,
                                     device="cuda").view(batch, width)
                for label, grow in (("same lengths", 0), ("a page more each forward", PAGE * WORLD)):
                    times = []
                    for i in range(30):
                        seq = [60000 + 997 * r + grow * i for r in range(batch)]
                        common = common_metadata(seq, [q_len] * batch, table,
                                                 world_size=WORLD, rank=0,
                                                 interleave=1, causal=True)
                        common.query_start_loc = common.query_start_loc.cuda()
                        common.seq_lens = common.seq_lens.cuda()
                        common.dcp_local_seq_lens = common.dcp_local_seq_lens.cuda()
                        common.slot_mapping = common.slot_mapping.cuda()
                        torch.cuda.synchronize()
                        start = time.perf_counter()
                        builder.build(0, common)
                        times.append((time.perf_counter() - start) * 1e3)
                    torch.cuda.synchronize()
                    ms = statistics.median(times[5:])
                    print(f"host {backend:>15} B={batch} {label}: build {ms:.3f} ms "
                          f"per forward", flush=True)
                    rows.append(dict(part="host", path=backend, batch=batch,
                                     lengths=label, build_ms=round(ms, 4)))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", nargs="+", default=["layer", "step", "host"])
    ap.add_argument("--heads", type=int, nargs="+", default=[96, 128])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--local", type=int, nargs="+", default=[32768, 262144])
    ap.add_argument("--q-len", type=int, default=4)
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--pool-gib", type=float, default=24.0,
                    help="distinct caches a step cycles over, in GiB")
    ap.add_argument("--max-gib", type=float, default=40.0,
                    help="skip layer points whose bf16 cache exceeds this")
    ap.add_argument("--no-baselines", dest="baselines", action="store_false",
                    help="time only dcp and alone (no FA3 / FlashInfer fp8)")
    ap.add_argument("--step-batch", type=int, nargs="+", default=[1, 64],
                    help="the step part's batches (1: 1 x 256K, 64: 64 x 128K)")
    ap.add_argument("--no-fa3", dest="fa3", action="store_false",
                    help="plan the DCP rows on FlashMLA at every batch (no FA3 for "
                         "a lone bf16 request)")
    ap.add_argument("--token-rows", choices=("auto", "on", "off"), default="auto",
                    help="FlashMLA's one-token requests for the dcp path: as the "
                         "builder chooses (flashmla_token_rows), always, never")
    ap.add_argument("--compare-rows", action="store_true",
                    help="time the rows before token rows / block heads (tiles and "
                         "the finishing launch) beside dcp and alone, in the same call")
    ap.add_argument("--repeats", type=int, default=1,
                    help="layer: times each path is timed, interleaved (median kept)")
    ap.add_argument("--out-dir", default=".")
    args = ap.parse_args()
    args.token_rows = {"auto": None, "on": True, "off": False}[args.token_rows]
    print(f"{torch.cuda.get_device_name(0)}: roofline at {hbm_tbs()} TB/s, "
          f"{BF16_TFLOPS} TFLOP/s bf16", flush=True)
    gen = torch.Generator("cuda").manual_seed(0)
    run_parts({"layer": lambda: layer_part(args, gen),
               "check": lambda: check_part(args, gen),
               "step": lambda: step_part(args, gen),
               "host": lambda: host_part(args)},
              args.parts, f"{args.out_dir}/flashmla_rows.csv")


if __name__ == "__main__":
    main()
