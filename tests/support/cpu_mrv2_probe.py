# SPDX-License-Identifier: Apache-2.0
"""Facts about one fresh process, for tests/test_cpu_mrv2_route.py.

Run with or without ``VLLM_DCP_CPU_MRV2=1`` (the switch acts at interpreter
start, so each setting needs its own process); prints one JSON object.

With the switch on it also drives vLLM's own code through the route: the
MRV2 slot-mapping Triton kernel under DCP (``gpu/block_table.py``, in the
interpreter) against the project's torch slot mapping, vLLM's DCP output
correction (``correct_attn_out``) against a plain LSE merge, and vLLM's K3
decode epilogue wrapper against ``tests/test_cpu_k3_mla_decode_q_concat.py``'s
reference.
"""

from __future__ import annotations

import json
import os
import sys

ROUTE_MARK = "_vllm_dcp_cpu_mrv2"


def triton_facts() -> dict:
    started_with = {name: name in sys.modules for name in ("triton", "torch", "vllm")}
    facts = {"imported_at_start": started_with}
    from vllm.triton_utils import HAS_TRITON

    facts["HAS_TRITON"] = bool(HAS_TRITON)
    facts["TRITON_INTERPRET"] = os.environ.get("TRITON_INTERPRET")
    from triton.backends import backends

    facts["triton_backends"] = sorted(backends)
    return facts


def plugin_facts() -> dict:
    """Load vLLM's general plugins as an engine process would; which
    overrides are in place."""
    import torch
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    from vllm.models.kimi_k3.nvidia.dspark_mla import K3DSparkModel
    from vllm.models.kimi_k3.nvidia.mla import MultiHeadLatentAttention
    from vllm.v1.attention.ops import dcp
    from vllm.v1.worker.cpu.model_runner import CPUModelRunner

    def marked(obj) -> bool:
        return bool(getattr(obj, ROUTE_MARK, False))

    return {
        "q_concat_op": hasattr(torch.ops._C,
                               "fused_kimi_k3_mla_decode_q_concat_kv_cache_insert"),
        "k3_kv_b_proj": marked(MultiHeadLatentAttention.__init__),
        "workspace": marked(CPUModelRunner.__init__),
        "dspark_layout": marked(K3DSparkModel._has_uniform_block_layout),
        "combine": marked(dcp.CorrectAttnCPOutKernel.kernel),
    }


def mrv2_slot_mapping(world: int, rank: int, interleave: int,
                      block_size: int = 16) -> dict:
    """vLLM's MRV2 slot-mapping kernel vs ``cpu_dcp_slot_mapping``."""
    import torch
    from vllm.v1.attention.ops.cpu_dcp_slot_mapping import dcp_slot_mapping
    from vllm.v1.attention.ops.dcp_decode import DCPLayout
    from vllm.v1.worker.gpu.block_table import _compute_slot_mappings_kernel

    gen = torch.Generator().manual_seed(rank + 10 * interleave)
    query_lens = [7, 1, 5, 40]
    seq_lens = [30, 9, 77, 40]
    max_blocks = 8
    num_reqs = len(query_lens)
    block_table = torch.randint(1, 200, (num_reqs, max_blocks),
                                generator=gen, dtype=torch.int32)
    qsl = torch.tensor([0] + query_lens).cumsum(0).to(torch.int32)
    positions = torch.cat([torch.arange(s - q, s) for q, s in
                           zip(query_lens, seq_lens)]).to(torch.int64)
    num_tokens = int(qsl[-1])
    max_tokens = num_tokens + 8
    got = torch.full((1, max_tokens), 12345, dtype=torch.int64)
    _compute_slot_mappings_kernel[(1, num_reqs + 1)](
        max_tokens,
        torch.arange(num_reqs, dtype=torch.int32),
        qsl,
        positions,
        torch.tensor([block_table.data_ptr()], dtype=torch.uint64),
        torch.tensor([block_table.stride(0)], dtype=torch.int64),
        torch.tensor([block_size], dtype=torch.int32),
        torch.tensor([True]),
        torch.tensor([True]),
        got,
        got.stride(0),
        rank,
        CP_SIZE=world,
        CP_INTERLEAVE=interleave,
        PAD_ID=-1,
        TRITON_BLOCK_SIZE=64,
    )
    want = torch.full((max_tokens,), 12345, dtype=torch.int64)
    dcp_slot_mapping(qsl, positions, block_table, want, num_tokens=num_tokens,
                     max_num_tokens=max_tokens, block_size=block_size,
                     layout=DCPLayout(world, rank, interleave))
    return {"equal": bool(torch.equal(got[0], want)),
            "owned": int((got[0, :num_tokens] >= 0).sum()),
            "num_tokens": num_tokens}


def dcp_correction() -> dict:
    """vLLM's ``correct_attn_out`` (routed to torch) vs a plain LSE merge,
    with an empty shard (-inf) on one row."""
    import torch
    from vllm.v1.attention.ops.dcp import CPTritonContext, correct_attn_out

    gen = torch.Generator().manual_seed(3)
    world, rows, heads, dim = 2, 5, 3, 8
    outs = torch.randn(world, rows, heads, dim, generator=gen)
    lses = torch.randn(world, rows, heads, generator=gen)
    lses[1, 2] = float("-inf")
    merged = torch.logsumexp(lses, dim=0)
    want = (torch.exp(lses - merged)[..., None] * outs).sum(0)
    total = torch.zeros(rows, heads, dim)
    for rank in range(world):
        out, lse = correct_attn_out(outs[rank].clone(), lses, rank,
                                    CPTritonContext())
        total += out
    return {"max_err": float((total - want).abs().max()),
            "lse_err": float((lse - merged).abs().max())}


def main() -> None:
    facts = {"switch": os.environ.get("VLLM_DCP_CPU_MRV2")}
    facts.update(triton_facts())
    facts["plugins"] = plugin_facts()
    if facts["HAS_TRITON"]:
        from triton.runtime.interpreter import InterpretedFunction
        from vllm.v1.attention.ops.dcp import CorrectAttnCPOutKernel
        from vllm.v1.worker.gpu.block_table import _compute_slot_mappings_kernel

        kernel = _compute_slot_mappings_kernel
        facts["interpreted"] = isinstance(kernel, InterpretedFunction)
        facts["slot_kernel_constexprs"] = [kernel.arg_names[i]
                                           for i in kernel.constexprs]
        override = CorrectAttnCPOutKernel.kernel
        facts["combine_constexprs"] = [override.arg_names[i]
                                       for i in override.constexprs]
        facts["slot_mapping"] = {}
        for w, r, i in [(2, 0, 1), (2, 1, 1), (2, 1, 16), (4, 3, 2)]:
            try:
                case = mrv2_slot_mapping(w, r, i)
            except Exception as exc:  # reported, so only its own test fails
                case = {"equal": False, "error": repr(exc)[:500]}
            facts["slot_mapping"][f"w{w}r{r}i{i}"] = case
        facts["correction"] = dcp_correction()
    print(json.dumps(facts), flush=True)


if __name__ == "__main__":
    main()
