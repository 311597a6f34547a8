# SPDX-License-Identifier: Apache-2.0
"""FA3 for a lone bf16 request on the FLASHMLA rows, planned on the device.

With one request per rank (batch 1, the DSpark latency regime) a FlashMLA
call does not shrink with its keys below about 50 us on an H100: its split
combine walks 16-22 splits. FlashInfer's FA3 MLA over the same shared local
prefix, with its plan made on the device (``flashinfer_sm90_device_plan``:
one Triton launch per forward, no host sync, CUDA-graph replayable) and the
same finishing launch (``mla_tail_merge.tail_merge``: the verify tails, the
LSE in natural log, empty rows masked), took 0.72-0.99 of the FLASHMLA rows'
time at batch 1 x 16-64K local keys, 96 and 128 heads, verify and DSpark
blocks (benchmarks/RESULTS.md, run 23). At batch 2 it wins only at 16K
local keys, at batch 4 it is up to 1.37x slower (run 24), at batch 8 1.5x
(run 22), and FlashInfer's fp8 MLA 3-7x slower than FlashMLA's: those keep
FlashMLA.

``FA3RowPlans`` owns, for one KV-cache group, one ``FlashInferSm90DevicePlan``
per batch shape it is asked for (R requests x s tokens, verify or DSpark
block): each makes FlashInfer's one host plan (the template) when first
needed, which the metadata builder reaches outside any CUDA graph (vLLM
builds the capture batch's metadata before capturing the layers). One
float workspace serves them all (the layers run one at a time).

Imports no vllm module at the top. Shapes: R requests, s query tokens per
request, T = R x s rows, H heads, B block-table columns.
"""

from __future__ import annotations

import torch

from vllm.v1.attention.ops.dcp_decode import FlatDecode

__all__ = ["FA3_MAX_REQS", "FA3RowPlans", "fa3_rows_preferred"]

# Requests per forward (CUDA-graph padding included) that FA3 takes: batch 1
# measured faster at every point; batch 2 faster only at 16K local keys and
# up to 1.05x slower at 64K, batch 4 up to 1.37x slower, batch 8 1.5x
# (benchmarks/RESULTS.md, runs 22 and 24).
FA3_MAX_REQS = 1
# FlashInfer's float workspace: its partial outputs and LSEs, at most two
# per cluster of 128 rows x 512 float32 columns (17 MB on 132 SMs).
WORKSPACE_BYTES = 64 << 20


def fa3_rows_preferred(*, num_reqs: int, query_len: int, fp8: bool) -> bool:
    """Whether a uniform batch of R requests x s tokens runs FA3.

    By shape only, so one CUDA-graph size always runs one kernel: a lone
    request's multi-token block (a verify block of 1 + k tokens, a DSpark
    block of k) in bf16 / fp16.
    """
    return not fp8 and num_reqs <= FA3_MAX_REQS and query_len >= 2


class FA3RowPlans:
    """One KV-cache group's FA3 device plans, by batch shape.

    Args:
        num_heads: H, query heads a rank attends (after DCP's query gather).
        page_size: tokens per KV page (FlashMLA's 64).
        dtype: q and cache dtype (bf16 / fp16).
        max_cols: B, block-table columns of a request at most.
        num_sms: the GPU's SM count (FlashInfer's clusters follow it).
        kv_lora_rank: Dv, the latent (value) width; rope_dim: the rest.
        device: the group's CUDA device.
    """

    def __init__(self, *, num_heads: int, page_size: int, dtype: torch.dtype,
                 max_cols: int, num_sms: int, kv_lora_rank: int, rope_dim: int,
                 device: torch.device) -> None:
        self.num_heads, self.page_size, self.dtype = num_heads, page_size, dtype
        self.max_cols, self.num_sms = max_cols, num_sms
        self.kv_lora_rank, self.rope_dim = kv_lora_rank, rope_dim
        self.device = device
        self._workspace: torch.Tensor | None = None
        self._plans: dict[tuple[int, int, bool], object] = {}

    def plan(self, rows: FlatDecode, block_table: torch.Tensor, *, num_reqs: int,
             query_len: int, causal: bool, sm_scale: float):
        """Plan this forward's FA3 run (one launch, no host sync).

        Args:
            rows: the forward's rows (``seq_lens`` [>= T] each row's local
                bound, 0 on padding rows; ``block_table`` [>= T, B]).
            block_table: int32 [R, <= B] local block table of the requests.
            num_reqs, query_len: R and s of a uniform batch (T = R x s).
            causal: a verify block (tails); False: a DSpark block.
            sm_scale: the group's softmax scale (one for every layer).

        Returns:
            The shape's ``FlashInferSm90DevicePlan``, planned; its ``run``
            gives ``(out [T, H, Dv], lse [T, H] float32 natural log)``.
        """
        from vllm.v1.attention.ops.flashinfer_sm90_device_plan import (
            FlashInferSm90DevicePlan)

        key = (num_reqs, query_len, causal)
        mla = self._plans.get(key)
        if mla is None:
            if self._workspace is None:
                self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8,
                                              device=self.device)
            mla = self._plans[key] = FlashInferSm90DevicePlan(
                self._workspace, num_reqs=num_reqs, q_len=query_len,
                num_heads=self.num_heads, page_size=self.page_size, sm_scale=sm_scale,
                dtype=self.dtype, max_cols=self.max_cols, num_sms=self.num_sms,
                kv_lora_rank=self.kv_lora_rank, rope_dim=self.rope_dim,
                has_tails=causal)
        elif mla.sm_scale != sm_scale:
            raise ValueError(f"FLASHMLA under DCP planned FA3 with softmax scale "
                             f"{mla.sm_scale}; this forward's is {sm_scale}")
        mla.plan(rows.seq_lens, block_table, rows.block_table)
        return mla
