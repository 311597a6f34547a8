# SPDX-License-Identifier: Apache-2.0
"""Hopper per-layer decode on one rank's DCP rows: FA3 vs TRITON_MLA bf16 / fp8.

The deployed shape: after DCP's query gather a rank attends heads_model x
DCP / TP heads (96 for Kimi-K3 at ``-tp 8 -dcp 8``) over its local KV. For
each batch B, local keys per request L and query kind (causal verify of
q_len tokens, or the non-causal draft block of q_len tokens), one layer of:

- ``fa3``: FLASHINFER_MLA's sm90 path, ``FlashInferSm90MLA.plan_rows`` (the
  builder's plan) then ``run`` (FA3 prefix + Triton tails), bf16 cache;
- ``triton-bf16`` / ``triton-fp8``: the plugin's TRITON_MLA rows,
  ``TritonDCPMLAImpl.forward_mqa`` (vLLM's ``decode_attention_fwd`` over the
  rows), bf16 cache or fp8 cache with its scale.

Each time (CUDA-graph replay median, ``benchmarks._common.time_ms``) is set
against the roofline max(KV bytes / 4.25 TB/s, FLOPs / 790 TFLOP/s), KV
bytes = B x L x 576 x bytes per element (read once per request), FLOPs =
2 x B x q_len x heads x L x (576 + 512).

Needs an sm90 GPU, FlashInfer and vLLM's Python (gpu/README.md); the fake DCP
group the impl is built in comes from ``tests.support.builder_harness``::

    python3 -m benchmarks.hopper_rows --out-dir DIR
"""

from __future__ import annotations

import argparse
import math
from types import SimpleNamespace

import torch

from benchmarks._common import time_ms, write_csv
from tests.support.fa3_native import FlashInferSm90MLAGraphed
from vllm.v1.attention.ops.dcp_decode import DCPLayout
from vllm.v1.attention.ops.triton_dcp_metadata import build_flat_decode_triton

DV, DR, PAGE = 512, 64, 64
HBM_TBS, BF16_TFLOPS = 4.25, 790.0


def make_triton_impl(heads: int, scale: float, kv_cache_dtype: str):
    from tests.support.builder_harness import fake_dcp_group, make_mla_impl

    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.v1.attention.backends.mla.triton_dcp_mla import TritonDCPMLAImpl

    with fake_dcp_group(8, 0), set_current_vllm_config(VllmConfig()):
        return make_mla_impl(TritonDCPMLAImpl, num_heads=heads, scale=scale,
                             kv_cache_dtype=kv_cache_dtype)


def point(batch: int, local: int, q_len: int, causal: bool, heads: int, paths, gen):
    from vllm.v1.attention.backends.mla.dcp_metadata import DCPDecodeMetadata

    dev = "cuda"
    scale = 1.0 / math.sqrt(192)
    pages = -(-local // PAGE)
    cache = torch.randn(batch * pages + 1, PAGE, DV + DR, device=dev,
                        dtype=torch.bfloat16, generator=gen)
    table = (torch.randperm(batch * pages, device=dev, generator=gen) + 1).view(
        batch, pages).int()
    seq = torch.full((batch,), local, dtype=torch.int32)
    qsl = torch.arange(batch + 1, dtype=torch.int32) * q_len
    rows = batch * q_len
    layout = DCPLayout(1)
    flat = build_flat_decode_triton(seq.to(dev), qsl.to(dev), table, layout=layout,
                                    causal=causal, num_rows=rows)
    q = torch.randn(rows, heads, DV + DR, device=dev, dtype=torch.bfloat16,
                    generator=gen)
    flops = 2.0 * rows * heads * local * (DV + DR + DV)
    results = []
    for path in paths:
        if path != "fa3" and cache.numel() >= 2**31:
            # vLLM's decode_attention_fwd addresses the cache with 32-bit
            # offsets: one layer's cache of 2^31 elements faults in its kernel.
            results.append(dict(path=path, batch=batch, local=local, q_len=q_len,
                                kind="verify" if causal else "draft", heads=heads,
                                us=float("nan"), roofline_us=float("nan"),
                                of_roofline=float("nan")))
            continue
        if path == "fa3":
            ws = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
            kernel = FlashInferSm90MLAGraphed(ws, num_heads=heads, page_size=PAGE,
                                              sm_scale=scale, max_rows=rows,
                                              max_cols=table.shape[1])
            kernel.plan_rows(qsl, seq, table, flat, num_rows=rows, causal=causal,
                             slack=q_len - 1, layout=layout)
            fn = lambda kernel=kernel: kernel.run(q, cache)  # noqa: E731
            elem = 2
        else:
            fp8 = path == "triton-fp8"
            impl = make_triton_impl(heads, scale, "fp8" if fp8 else "auto")
            kv = cache.to(torch.float8_e4m3fn) if fp8 else cache
            decode = DCPDecodeMetadata(
                block_table=table, seq_lens=seq.to(dev), dcp_tot_seq_lens=seq.to(dev),
                flat=flat, causal=causal,
                max_query_len=q_len, layout=layout)
            metadata = SimpleNamespace(decode=decode, max_seq_len=local)
            layer = SimpleNamespace(_k_scale=torch.tensor(1.0, device=dev),
                                    _k_scale_float=1.0, _q_scale_float=1.0)
            fn = (lambda impl=impl, kv=kv, metadata=metadata, layer=layer:  # noqa: E731
                  impl.forward_mqa(q, kv, metadata, layer))
            elem = 1 if fp8 else 2
        ms = time_ms(fn)
        roof_ms = max(batch * local * (DV + DR) * elem / (HBM_TBS * 1e12),
                      flops / (BF16_TFLOPS * 1e12)) * 1e3
        results.append(dict(path=path, batch=batch, local=local, q_len=q_len,
                            kind="verify" if causal else "draft", heads=heads,
                            us=round(ms * 1e3, 1), roofline_us=round(roof_ms * 1e3, 1),
                            of_roofline=round(roof_ms / ms, 3)))
        del fn
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--heads", type=int, default=96)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--local", type=int, nargs="+", default=[32768, 262144])
    ap.add_argument("--q-len", type=int, default=4)
    ap.add_argument("--paths", nargs="+", default=["fa3", "triton-bf16", "triton-fp8"])
    ap.add_argument("--max-gib", type=float, default=40.0,
                    help="skip points whose bf16 cache exceeds this")
    ap.add_argument("--out-dir", default=".")
    args = ap.parse_args()
    gen = torch.Generator("cuda").manual_seed(0)
    rows = []
    print(f"{'kind':>7}{'B':>4}{'local':>8}" + "".join(f"{p:>13}" for p in args.paths)
          + "   (us per layer; fraction of roofline)")
    for causal in (True, False):
        for batch in args.batch:
            for local in args.local:
                if batch * local * (DV + DR) * 2 > args.max_gib * 2**30:
                    continue
                res = point(batch, local, args.q_len, causal, args.heads, args.paths, gen)
                rows += res
                print(f"{'verify' if causal else 'draft':>7}{batch:4}{local // 1024:7}K"
                      + "".join(f"{r['us']:8.0f}/{r['of_roofline']:.2f}" for r in res),
                      flush=True)
                torch.cuda.empty_cache()
    write_csv(f"{args.out_dir}/hopper_rows.csv", rows)


if __name__ == "__main__":
    main()
