# SPDX-License-Identifier: Apache-2.0
"""Verify blocks as vLLM's scheduler forms them, through every DCP backend's
real metadata builder.

vLLM's scheduler cuts a speculative request's verify block short when the
step's token budget (``--max-num-batched-tokens``, shared with chunked
prefills) runs out, or near ``max_model_len``; under async scheduling the
host knows each sequence length only as an upper bound, up to k (the
target) or 2k (a draft) above the device's. MLA's ``build`` splits the batch
into decodes and prefills on the host offsets, and its prefill path sizes a
request's context from that host bound. So under DCP every speculative
block must be a decode, its rows bounded by the device lengths, and only
real prefills (whose host bound is exact) may reach the prefill path.

Each backend served under DCP is built as on its GPU (FLASHMLA and the
FA3 FLASHINFER_MLA as sm90, FLASHINFER_MLA and TOKENSPEED_MLA as sm100,
TRITON_MLA, CPU_MLA); per batch and rank the test checks the split, every
decode row's local bound against its definition (``expected_local_row_lens``
from the device lengths) and the prefill's context lengths. The merged
outputs of cut blocks are checked against dense attention per backend in
``test_flashmla_dcp_mla.py`` (FLASHMLA's ragged tiles),
``test_backend_contracts.py`` (FLASHINFER_MLA, TOKENSPEED_MLA),
``test_triton_dcp_mla.py``, ``test_flashinfer_dcp_mla.py`` and
``test_cpu_dcp_mla.py``.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from tests.support.builder_harness import (common_metadata, expected_local_row_lens,
                                           fake_dcp_group, make_builder,
                                           make_vllm_config)
from tests.support.kernel_stubs import FlashMLAReference, import_on_cpu
from vllm.v1.attention.backends.mla import dcp_startup_checks

NUM_SPEC = 3
VERIFY = 1 + NUM_SPEC

# (seq_lens, query_lens, prefills): device lengths; the last ``prefills``
# requests are chunked prefills (query longer than a verify block).
BATCHES = {
    "cut_last": ([40, 300, 130], [VERIFY, VERIFY, 2], 0),
    "one_and_full": ([70, 9], [1, VERIFY], 0),
    "cut_first": ([129, 4, 66, 200], [2, VERIFY, 1, 3], 0),
    # A verify block and a cut one beside a chunked prefill of 20 tokens
    # over 100 of context, in one batch (the scheduler orders decodes first).
    "beside_prefill": ([129, 66, 120], [VERIFY, 2, 20], 1),
    # Near max_model_len (4096 here) a request verifies fewer drafts.
    "near_max_model_len": ([4096, 4095, 300], [2, 1, VERIFY], 0),
}
LAYOUTS = [(2, 1), (4, 16), (8, 64), (8, 1)]


def _flashmla():
    from vllm.v1.attention.backends.mla import flashmla as upstream
    from vllm.v1.attention.backends.mla import flashmla_dcp_mla
    from vllm.v1.attention.ops import flashmla as flashmla_ops

    kernel = FlashMLAReference()
    patches = [mock.patch.object(flashmla_dcp_mla.checks, "current_gpu_major",
                                 return_value=9),
               mock.patch.object(upstream, "is_flashmla_dense_supported",
                                 return_value=(True, None))]
    patches += [mock.patch.object(module, name, getattr(kernel, name))
                for module in (flashmla_ops, upstream)  # where each calls them
                for name in ("get_mla_metadata", "get_mla_metadata_dense_fp8")]
    return flashmla_dcp_mla.FlashMLADCPMetadataBuilder, patches, 64, "auto"


def _flashinfer(major):
    module = import_on_cpu("vllm.v1.attention.backends.mla.flashinfer_dcp_mla")
    patches = [mock.patch.object(module.checks, "current_gpu_major", return_value=major),
               mock.patch.object(module, "_get_workspace_buffer",
                                 lambda *a, **k: torch.empty(8, dtype=torch.uint8))]
    if major == 9:
        from tests.support.flashinfer_fa3_fake import flashinfer_mla_faked

        patches.append(flashinfer_mla_faked())
    return module.FlashInferDCPMLAMetadataBuilder, patches, 64 if major == 10 else 16, "auto"


def _tokenspeed():
    module = import_on_cpu("vllm.v1.attention.backends.mla.tokenspeed_dcp_mla")
    patches = [mock.patch.object(module.checks, "current_gpu_major", return_value=10)]
    return module.TokenspeedDCPMLAMetadataBuilder, patches, 64, "fp8"


def _triton():
    from vllm.v1.attention.backends.mla import triton_dcp_mla

    return triton_dcp_mla.TritonDCPMLAMetadataBuilder, [], 16, "auto"


def _cpu():
    from vllm.v1.attention.backends.mla import cpu_dcp_mla

    return cpu_dcp_mla.CPUDCPMLAMetadataBuilder, [], 16, "auto"


BACKENDS = {
    "FLASHMLA": _flashmla,
    "FLASHINFER_MLA-sm90": lambda: _flashinfer(9),
    "FLASHINFER_MLA-sm100": lambda: _flashinfer(10),
    "TOKENSPEED_MLA": _tokenspeed,
    "TRITON_MLA": _triton,
    "CPU_MLA": _cpu,
}


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("world,interleave", LAYOUTS)
def test_speculative_blocks_decode_over_their_device_lengths(tmp_path, backend, world,
                                                             interleave):
    builder_cls, patches, block_size, kv_cache_dtype = BACKENDS[backend]()
    # Tokenspeed pages by 32 or 64; CPU_MLA's block is 16.
    largest = {"TOKENSPEED_MLA": 32, "CPU_MLA": block_size}.get(backend, interleave)
    interleave = min(interleave, largest)
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        # A GPU deployment's config, built here: the CPU platform's DCP check
        # (CPU_MLA's 16-token block), installed once the plugin has loaded in
        # this process, is not its check.
        with mock.patch.object(dcp_startup_checks, "check_vllm_config"):
            config = make_vllm_config(tmp_path / "model", dcp=world,
                                      interleave=interleave,
                                      block_size=max(block_size, interleave),
                                      num_speculative_tokens=NUM_SPEC)
        config.cache_config.cache_dtype = kv_cache_dtype
        for rank in (0, world - 1):
            _check_batches(builder_cls, config, f"{backend} W{world} I{interleave} r{rank}",
                           world=world, interleave=interleave, rank=rank)


def _check_batches(builder_cls, config, what, *, world, interleave, rank):
    """Every batch of ``BATCHES`` through one rank's builder, host bounds k
    and 2k above the device lengths."""
    from vllm.config import set_current_vllm_config

    block_size = config.cache_config.block_size
    with fake_dcp_group(world, rank), set_current_vllm_config(config):
        builder = make_builder(builder_cls, config)
        for layer in config.compilation_config.static_forward_context.values():
            layer.impl = SimpleNamespace(scale=0.1)  # what the sm90 plan reads
        assert builder.reorder_batch_threshold == VERIFY
        for name, (seq_lens, query_lens, prefills) in BATCHES.items():
            num_decodes = len(seq_lens) - prefills
            blocks = -(-max(seq_lens) // (block_size * world))
            table = torch.arange(1, 1 + len(seq_lens) * blocks,
                                 dtype=torch.int32).view(len(seq_lens), blocks)
            for slack in (NUM_SPEC, 2 * NUM_SPEC):
                common = common_metadata(
                    seq_lens, query_lens, table, world_size=world, rank=rank,
                    interleave=interleave,
                    host_slack=[slack] * num_decodes + [0] * prefills)
                metadata = builder.build(0, common)
                case = f"{what} {name} host +{slack}"
                assert (metadata.num_decodes, metadata.num_prefills) == (
                    num_decodes, prefills), f"{case}: a speculative block went to prefill"
                want = expected_local_row_lens(
                    seq_lens[:num_decodes], query_lens[:num_decodes],
                    world_size=world, rank=rank, interleave=interleave, causal=True)
                got = metadata.decode.flat.seq_lens[:sum(query_lens[:num_decodes])]
                assert torch.equal(got, want), (case, got, want)
                if prefills:
                    context = [s - q for s, q in zip(seq_lens[num_decodes:],
                                                     query_lens[num_decodes:])]
                    assert metadata.prefill.chunked_context.context_lens_list == context, case


def test_dcp1_flashmla_routes_a_cut_block_as_upstream(tmp_path):
    """The reproduction docs/design.md cites: at ``-dcp 1`` FLASHMLA is
    upstream's (``QueryLenSupport.UNIFORM``), which hands a cut verify block
    to the prefill path; that path sizes the block's context from the host
    upper bound, k keys past the device's under async scheduling. The plugin
    leaves DCP 1 as it is: the same split and context as vLLM's own
    builder."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.mla.flashmla import FlashMLAMetadataBuilder

    builder_cls, patches, block_size, _ = _flashmla()
    config = make_vllm_config(tmp_path / "model", dcp=1, block_size=block_size,
                              num_speculative_tokens=NUM_SPEC)
    seq_lens, query_lens, _ = BATCHES["cut_last"]
    table = torch.arange(1, 1 + 3 * 5, dtype=torch.int32).view(3, 5)
    results = []
    with fake_dcp_group(1, 0), set_current_vllm_config(config), \
            contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        for cls in (builder_cls, FlashMLAMetadataBuilder):
            common = common_metadata(seq_lens, query_lens, table, world_size=1, rank=0,
                                     interleave=1, host_slack=NUM_SPEC)
            metadata = make_builder(cls, config).build(0, common)
            results.append((metadata.num_decodes, metadata.num_prefills,
                            metadata.prefill.chunked_context.context_lens_list))
    ours, upstream = results
    assert ours == upstream == (2, 1, [seq_lens[2] + NUM_SPEC - query_lens[2]])
