# SPDX-License-Identifier: Apache-2.0
"""Kimi-K3's Hopper prefill over a plain fp8 KV cache against the bf16 one.

``vllm/v1/attention/backends/mla/k3_fp8_prefill.py`` prefills a plain fp8
cache on sm90 with a bf16 query: the new tokens attend in bf16 to their own
keys and values, their latent goes into the cache as fp8 with the layer's
scale, and the chunked context is gathered back dequantized to bf16. Next to
the bf16 prefill it differs only in the cache write (a scaled fp8 cast) and
the context gather (an fp8 read and a scale); the attention kernels and the
``kv_b_proj`` GEMMs are the same. This times one layer of both at Kimi-K3's
shape (512 + 64 latent, qk_nope 128, v 128; 96 and 128 heads: the whole
model's heads on one GPU), for a prompt of 8K and 32K tokens run as one
prefill and as a chunked one (its first half cached as context), and checks
each output against float32 attention on the values it attends to (for the
fp8 path: the context latent as stored, fp8 times the scale).

The device carries vLLM's Python but not its compiled ops (gpu/README.md),
so the pieces are their torch equivalents: FlashAttention through torch's
``_scaled_dot_product_flash_attention`` (v padded to the qk head dim, as
vLLM's FlashAttention prefill pads it; it returns the LSE the context merge
needs), the paged cache write and gather as indexing, the merge as vLLM's
LSE formula. The times compare the two cache dtypes with equal kernels,
not vLLM's fused kernels.

    python -m benchmarks.k3_fp8_prefill [--heads 96 128] [--tokens 8192 32768]
"""

from __future__ import annotations

import argparse

import torch

from benchmarks._common import cuda_event_median_ms

KV_LORA_RANK, ROPE, NOPE, V = 512, 64, 128, 128
BLOCK = 64
FP8 = torch.float8_e4m3fn
CHECK_ROWS = 256  # query rows checked against float32


def flash(q, k, v, causal, scale):
    """[T, H, D] -> out [T, H, V], lse [H, T] (natural log), bf16 flash."""
    pad = torch.nn.functional.pad(v, (0, q.shape[-1] - v.shape[-1]))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], pad.transpose(0, 1)[None],
        0.0, causal, False, scale=scale)[:2]
    return out[0].transpose(0, 1)[..., :v.shape[-1]], lse[0]


def merge(out_a, lse_a, out_b, lse_b):
    top = torch.maximum(lse_a, lse_b)
    wa, wb = torch.exp(lse_a - top).T[..., None], torch.exp(lse_b - top).T[..., None]
    return ((out_a.float() * wa + out_b.float() * wb) / (wa + wb)).to(out_a.dtype)


class Layer:
    """One MLA layer's prefill pieces at ``heads`` (random weights)."""

    def __init__(self, heads, context, new, fp8, gen):
        self.heads, self.context, self.new, self.fp8 = heads, context, new, fp8
        self.scale = (NOPE + ROPE) ** -0.5
        dev = "cuda"
        self.w_kv_b = (torch.randn(heads * (NOPE + V), KV_LORA_RANK, generator=gen,
                                   device=dev) * KV_LORA_RANK ** -0.5).bfloat16()
        self.q = torch.randn(new, heads, NOPE + ROPE, generator=gen,
                             device=dev).bfloat16()
        self.latent = torch.randn(new, KV_LORA_RANK + ROPE, generator=gen,
                                  device=dev).bfloat16()
        self.k_scale = torch.tensor(0.05, device=dev)
        total = context + new
        blocks = (total + BLOCK - 1) // BLOCK
        self.block_table = torch.randperm(blocks, generator=gen, device=dev)
        self.cache = torch.zeros(blocks, BLOCK, KV_LORA_RANK + ROPE, device=dev,
                                 dtype=FP8 if fp8 else torch.bfloat16)
        positions = torch.arange(total, device=dev)
        self.slots = self.block_table[positions // BLOCK] * BLOCK + positions % BLOCK
        context_latent = torch.randn(context, KV_LORA_RANK + ROPE, generator=gen,
                                     device=dev).bfloat16()
        self._write(context_latent, self.slots[:context])

    def _write(self, latent, slots):
        flat = self.cache.view(-1, KV_LORA_RANK + ROPE)
        flat[slots] = (latent.float() / self.k_scale).to(FP8) if self.fp8 else latent

    def _read_context(self):
        flat = self.cache.view(-1, KV_LORA_RANK + ROPE)[self.slots[:self.context]]
        return (flat.float() * self.k_scale).bfloat16() if self.fp8 else flat

    def _kv(self, latent):
        kv = (latent[:, :KV_LORA_RANK] @ self.w_kv_b.T).view(-1, self.heads, NOPE + V)
        k_nope, v = kv.split([NOPE, V], dim=-1)
        k_pe = latent[:, None, KV_LORA_RANK:].expand(-1, self.heads, -1)
        return torch.cat([k_nope, k_pe], dim=-1), v

    def forward(self):
        """The prefill of the new tokens: [new, H, V] bf16."""
        k, v = self._kv(self.latent)
        self._write(self.latent, self.slots[self.context:])
        out, lse = flash(self.q, k, v, True, self.scale)
        if not self.context:
            return out
        ck, cv = self._kv(self._read_context())
        c_out, c_lse = flash(self.q, ck, cv, False, self.scale)
        return merge(c_out, c_lse, out, lse)

    def reference(self, rows):
        """float32 attention of the last ``rows`` queries on the values the
        prefill attends to (the context as ``_read_context`` reads it)."""
        latent = self.latent
        if self.context:
            latent = torch.cat([self._read_context(), latent])
        k, v = self._kv(latent)
        q = self.q[-rows:].float()
        scores = torch.einsum("qhd,khd->hqk", q, k.float()) * self.scale
        total = latent.shape[0]
        visible = torch.arange(total, device="cuda")[None, :] <= (
            torch.arange(total - rows, total, device="cuda"))[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        return torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v.float())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", type=int, nargs="+", default=[96, 128])
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}")
    print("heads tokens context | bf16 ms  fp8 ms  fp8/bf16 | err bf16  err fp8 "
          "(max |out - f32 ref| / max |ref|, last 256 rows)")
    for heads in args.heads:
        for tokens in args.tokens:
            for context in (0, tokens // 2):
                row = []
                for fp8 in (False, True):
                    layer = Layer(heads, context, tokens - context, fp8, gen)
                    ms = cuda_event_median_ms(layer.forward, reps=10)
                    out = layer.forward()[-CHECK_ROWS:].float()
                    ref = layer.reference(CHECK_ROWS)
                    err = ((out - ref).abs().max() / ref.abs().max()).item()
                    row.append((ms, err))
                    del layer
                    torch.cuda.empty_cache()
                (bf_ms, bf_err), (f8_ms, f8_err) = row
                print(f"{heads:5d} {tokens:6d} {context:7d} | {bf_ms:7.2f} {f8_ms:7.2f}"
                      f"  {f8_ms / bf_ms:7.3f} | {bf_err:.2e}  {f8_err:.2e}", flush=True)


if __name__ == "__main__":
    main()
