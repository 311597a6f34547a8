# SPDX-License-Identifier: Apache-2.0
"""FlashInfer's sm90 MLA plan arrays, executed in torch (the tests' reading of
what ``mla_hopper.cuh`` does with them), and a uniform template of that plan.

- ``run_plan``: every cluster's works (``work_indptr``) attend their rows
  over their keys into the final output or a partial, then every merge CTA
  merges its rows' partials by LSE: what the kernel computes for a plan, in
  float64, as the contract the device planner
  (``flashinfer_sm90_device_plan``) must keep.
- ``uniform_template``: a plan with FlashInfer's layout for R uniform
  requests (cluster tiles of packed rows, every tile cut into the most
  chunks, partial rows per tile in chunk order, each tile's rows shared
  among merge CTAs), for CPU tests without FlashInfer; the real FlashInfer
  plans, recorded on an H100, are in ``tests/data/fa3_plans_h100.json``.

Shapes: T rows, H heads, D = Dv + Dr, P pages, page tokens per page.
"""

from __future__ import annotations

import contextlib
import math
import types

import torch

from vllm.v1.attention.ops.flashinfer_sm90_device_plan import (
    CTA_TILE_Q, MERGE_FIELDS, MLA_PLAN_FIELDS, WORK_FIELDS, fa3_chunk_keys,
    fa3_cluster_size, fa3_layout, template_kv_len)

__all__ = ["PlannedFA3Wrapper", "flashinfer_planned_fa3", "run_plan", "uniform_template"]


def run_plan(arrays: dict, q: torch.Tensor, kv_cache: torch.Tensor,
             kv_indices: torch.Tensor, *, num_heads: int, page_size: int,
             sm_scale: float, kv_lora_rank: int = 512
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Execute a FlashInfer sm90 MLA plan (non-causal).

    Args:
        arrays: ``read_plan_arrays``' lists (work and merge fields,
            ``work_indptr`` [clusters + 1]: cluster c's works, ``grid``:
            ``[cluster size, clusters]``); a work no cluster runs, or one
            run twice, fails an assertion.
        q: [T, H, D]; kv_cache: [P, page, D]; kv_indices: int [N] page ids
            (work w's key k is on page ``kv_indices[kv_indptr[w] + k //
            page]``).

    Returns:
        ``(out [T, H, Dv], lse [T, H] base 2)`` in float64; rows no work or
        merge wrote stay NaN.
    """
    q, kv_cache = q.double(), kv_cache.double()
    tile_rows = CTA_TILE_Q * arrays["grid"][0]
    out = torch.full((*q.shape[:2], kv_lora_rank), math.nan, dtype=torch.float64)
    lse = torch.full(q.shape[:2], math.nan, dtype=torch.float64)
    num_partial = max(arrays["partial_indptr"] + [0]) + tile_rows
    partial_o = torch.full((num_partial, kv_lora_rank), math.nan, dtype=torch.float64)
    partial_lse = torch.full((num_partial,), math.nan, dtype=torch.float64)
    # Each cluster runs its works, [work_indptr[c], work_indptr[c + 1]).
    indptr = arrays["work_indptr"]
    assert len(indptr) == arrays["grid"][1] + 1, "work_indptr is not one per cluster"
    runs = [w for c in range(len(indptr) - 1) for w in range(indptr[c], indptr[c + 1])]
    assert sorted(runs) == list(range(len(arrays["q_indptr"]))), (
        "work_indptr does not run every work once")
    for w in runs:
        q_at, kv_at, partial, q_len, kv_len, q_start, start, end = (
            arrays[name][w] for name in WORK_FIELDS)
        packed = torch.arange(q_start, min(q_start + tile_rows, q_len * num_heads))
        rows, heads = q_at + packed // num_heads, packed % num_heads
        keys = torch.arange(start, max(min(end, kv_len), start))
        pages = kv_indices[kv_at + keys // page_size].long()
        k = kv_cache[pages, keys % page_size]  # [K, D]
        scores = q[rows, heads] @ k.T * sm_scale  # [n, K]
        if keys.numel():
            w_lse = torch.logsumexp(scores, -1)
            w_out = torch.softmax(scores, -1) @ k[:, :kv_lora_rank]
        else:
            w_lse = torch.full((packed.numel(),), -math.inf, dtype=torch.float64)
            w_out = torch.zeros(packed.numel(), kv_lora_rank, dtype=torch.float64)
        if partial < 0:
            out[rows, heads] = w_out
            lse[rows, heads] = w_lse / math.log(2.0)
        else:
            partial_o[partial + packed - q_start] = w_out
            partial_lse[partial + packed - q_start] = w_lse
    for start, end, p_start, p_end, stride in zip(
            *(arrays[name] for name in MERGE_FIELDS)):
        if end <= start:
            continue
        local = torch.arange(end - start)
        steps = torch.arange(-(-(p_end - p_start) // stride))
        parts = p_start + local[:, None] + steps[None, :] * stride  # [n, k]
        valid = parts < p_end
        lses = torch.where(valid, partial_lse[parts.clamp(max=num_partial - 1)],
                           -math.inf)
        total = torch.logsumexp(lses, -1)  # [n]
        weights = torch.nan_to_num(torch.exp(lses - total[:, None]))  # empty: 0
        outs = torch.where(valid[..., None], partial_o[parts.clamp(max=num_partial - 1)],
                           0.0)
        row, head = (start + local) // num_heads, (start + local) % num_heads
        out[row, head] = (weights[..., None] * outs).sum(1)
        lse[row, head] = total / math.log(2.0)
    return out, lse


def uniform_template(num_reqs: int, q_len: int, num_heads: int, num_sms: int, *,
                     page_stride: int, kv_len: int | None = None) -> tuple[dict, int]:
    """A plan of R requests of the template length (the shortest, or
    ``kv_len`` keys: one with the most chunks) with FlashInfer's layout.

    Returns:
        ``(arrays, kv_len)``: lists as ``read_plan_arrays`` gives them (works
        dealt to clusters in turn; ``offsets`` as in a real workspace of
        consecutive arrays), and the template length.
    """
    tiles, clusters = fa3_layout(num_reqs, q_len, num_heads, num_sms)
    kv_len = template_kv_len(tiles, clusters) if kv_len is None else kv_len
    chunk = fa3_chunk_keys(kv_len, tiles, clusters)
    chunks = -(-kv_len // chunk)
    cluster = fa3_cluster_size(q_len, num_heads)
    tile_rows, packed = CTA_TILE_Q * cluster, q_len * num_heads
    works = {name: [] for name in WORK_FIELDS}
    merges = {name: [] for name in MERGE_FIELDS}
    partial_rows = 0
    for req in range(num_reqs):
        for q_start in range(0, packed, tile_rows):
            rows = min(tile_rows, packed - q_start)
            for c in range(chunks):
                for name, value in (("q_indptr", req * q_len),
                                    ("kv_indptr", req * page_stride),
                                    ("partial_indptr", partial_rows + c * rows),
                                    ("q_len", q_len), ("kv_len", kv_len),
                                    ("q_start", q_start), ("kv_start", c * chunk),
                                    ("kv_end", min((c + 1) * chunk, kv_len))):
                    works[name].append(value)
            merge_ctas = max(1, min(2 * chunks, num_sms // tiles, rows))
            per_cta = -(-rows // merge_ctas)
            for first in range(0, rows, per_cta):
                base = req * q_len * num_heads + q_start
                for name, value in (
                        ("merge_packed_offset_start", base + first),
                        ("merge_packed_offset_end", base + min(first + per_cta, rows)),
                        ("merge_partial_packed_offset_start", partial_rows + first),
                        ("merge_partial_packed_offset_end", partial_rows + chunks * rows),
                        ("merge_partial_stride", rows)):
                    merges[name].append(value)
            partial_rows += chunks * rows
    num_works = len(works["q_indptr"])
    # Deal the works to clusters in turn (FlashInfer balances them by cost).
    order = sorted(range(num_works), key=lambda w: (w % clusters, w))
    arrays = {name: [values[w] for w in order] for name, values in works.items()}
    unused = num_sms - len(merges["merge_packed_offset_start"])
    arrays.update({name: values + [0] * unused for name, values in merges.items()})
    names = list(works) + list(merges) + ["work_indptr"]
    offsets = dict(zip(names, range(0, 1 << 20, 1 << 14)))
    arrays["offsets"] = offsets
    arrays["grid"] = [cluster, clusters]
    arrays["work_indptr"] = [min(i * -(-num_works // clusters), num_works)
                             for i in range(clusters + 1)]
    return arrays, kv_len


class PlannedFA3Wrapper:
    """Stand-in for ``BatchMLAPagedAttentionWrapper(backend="fa3",
    use_cuda_graph=True)`` as ``FlashInferSm90DevicePlan`` uses it: ``plan``
    stages a uniform template with FlashInfer's layout (``uniform_template``
    at the planned length) in the int workspace and its host copy, with
    ``_plan_info`` offsets in bytes; ``run`` executes whatever work arrays
    the device workspace holds then (``run_plan``), as the kernel reads
    them, and writes the outputs in their dtypes (LSE base 2)."""

    num_sms = 12  # SMs of the fake GPU
    runs = 0

    def __init__(self, workspace, *, use_cuda_graph=False, qo_indptr=None,
                 kv_indptr=None, kv_indices=None, kv_len_arr=None, backend="auto"):
        assert backend == "fa3" and use_cuda_graph and kv_indices is not None
        self.kv_indices = kv_indices
        self._int_workspace_buffer = torch.zeros(1 << 22, dtype=torch.uint8,
                                                 device=workspace.device)
        self._pin_memory_int_workspace_buffer = torch.zeros(1 << 22, dtype=torch.uint8)

    def plan(self, *, metadata, num_heads, head_dim_ckv, head_dim_kpe, page_size,
             causal, sm_scale, q_data_type, kv_data_type, lse_mode):
        assert not causal and lse_mode == "base2"
        qo, kv_at = metadata.qo_indptr.tolist(), metadata.kv_indptr.tolist()
        kv_lens = metadata.kv_len_arr.tolist()
        assert len(set(kv_lens)) == 1, "a uniform template"
        arrays, _ = uniform_template(
            len(kv_lens), qo[1] - qo[0], num_heads, self.num_sms,
            page_stride=kv_at[1] - kv_at[0], kv_len=kv_lens[0])
        words = self._pin_memory_int_workspace_buffer.view(torch.int32)
        for name, at in arrays["offsets"].items():
            words[at:at + len(arrays[name])] = torch.tensor(arrays[name])
        self._int_workspace_buffer.copy_(self._pin_memory_int_workspace_buffer)
        offsets = {name: 4 * at for name, at in arrays["offsets"].items()}
        self._plan_info = [*arrays["grid"], *(offsets.get(name, 0)
                                               for name in MLA_PLAN_FIELDS[2:])]
        self._arrays = arrays
        self.shape = dict(num_heads=num_heads, page_size=page_size, sm_scale=sm_scale,
                          kv_lora_rank=head_dim_ckv)

    def run(self, *, query, kv_cache, out, lse, return_lse):
        words = self._int_workspace_buffer.view(torch.int32).cpu()
        arrays = dict(self._arrays)
        num_works = len(arrays["q_indptr"])
        for name in WORK_FIELDS:  # as the kernel reads them, when it runs
            at = arrays["offsets"][name]
            arrays[name] = words[at:at + num_works].tolist()
        o, l2 = run_plan(arrays, query.cpu(), kv_cache.cpu(), self.kv_indices.cpu(),
                         **self.shape)
        out.copy_(o.to(out.dtype))
        lse.copy_(l2.float())
        PlannedFA3Wrapper.runs += 1
        return out, lse


@contextlib.contextmanager
def flashinfer_planned_fa3():
    """``flashinfer.mla`` is a module with ``PlannedFA3Wrapper`` (and
    ``MLAPlanMetadata``) inside the ``with``; the key is restored after."""
    from tests.support.flashinfer_fa3_fake import FakePlanMetadata, flashinfer_mla_as

    mla = types.ModuleType("flashinfer.mla")
    mla.BatchMLAPagedAttentionWrapper = PlannedFA3Wrapper
    mla.MLAPlanMetadata = FakePlanMetadata
    PlannedFA3Wrapper.runs = 0
    with flashinfer_mla_as(mla):
        yield PlannedFA3Wrapper
