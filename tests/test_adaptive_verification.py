# SPDX-License-Identifier: Apache-2.0
"""Model Runner V2's adaptive verification: host and device query lengths
disagree (same total).

MRV2 spreads the draft budget evenly over the verify requests on the host
(``query_start_loc_cpu``) and reallocates it unevenly on the device
(``query_start_loc``), passing the pre-trim host upper bound as
``max_query_len`` (``v1/worker/gpu/model_runner.py``, adaptive verify). Every
DCP backend either equals full attention over the DEVICE layout on such a
batch or declares the mismatch unsupported, so that vLLM never sends it.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from tests.support.builder_harness import make_vllm_config
from tests.test_backend_contracts import Backend, assert_matches_full_attention, run_steps

# The repro of issue 11: device lengths [5, 1, 3, 3], host [3, 3, 3, 3],
# vLLM's promised bound 5 (1 + 4 drafts scheduled before the trim).
SEQ_LENS = [40, 30, 50, 60]
DEVICE_QUERY_LENS = [5, 1, 3, 3]
MISMATCH = dict(host_query_lens=[3, 3, 3, 3], max_query_len=5)


@pytest.mark.parametrize("interleave", [1, 16])
@pytest.mark.parametrize("name", ["FLASHINFER_MLA", "TOKENSPEED_MLA"])
def test_sm100_backends_follow_the_device_layout(tmp_path, name, interleave):
    backend = Backend(name)
    (batches, merged, rows_built), = run_steps(
        tmp_path, backend, [(SEQ_LENS, DEVICE_QUERY_LENS, MISMATCH)],
        world_size=2, interleave=interleave, causal=True, seed=11,
        num_speculative_tokens=4)
    assert rows_built == [1, 1]
    for batch, (out, lse) in zip(batches, merged):
        assert_matches_full_attention(batch, out, lse, causal=True, atol=2e-2,
                                      lse_atol=1e-4)


@pytest.mark.parametrize("interleave", [1, 16])
def test_cpu_backend_follows_the_device_layout(tmp_path, interleave):
    from tests.test_cpu_dcp_mla import dcp_context, make_impl

    from tests.support.builder_harness import common_metadata, make_builder
    from tests.support.dense_reference import full_attention, random_decode_batch
    from vllm.v1.attention.backends.mla.cpu_dcp_mla import CPUDCPMLAMetadataBuilder
    from vllm.v1.attention.ops.dcp_decode import DCPLayout
    from tools.dcp_simulated_ranks import decode_on_simulated_ranks

    batch = random_decode_batch(SEQ_LENS, DEVICE_QUERY_LENS, block_size=16,
                                num_heads=4, seed=5)
    ref_out, ref_lse = full_attention(batch, causal=True)

    def decode_rank(layout, cache, table):
        with dcp_context(tmp_path, 2, layout.rank, interleave, num_spec=4) as config:
            impl = make_impl(batch.scale)
            builder = make_builder(CPUDCPMLAMetadataBuilder, config)
        common = common_metadata(SEQ_LENS, DEVICE_QUERY_LENS, table, world_size=2,
                                 rank=layout.rank, interleave=interleave, **MISMATCH)
        metadata = builder.build(0, common)
        return impl.forward_mqa(batch.q, cache, metadata, None)

    out, lse = decode_on_simulated_ranks(batch.kv_cache, batch.block_table,
                                         batch.seq_lens, decode_rank,
                                         layout=DCPLayout(2, interleave=interleave))
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dcp", [2, 4])
def test_flashinfer_sm90_declares_the_mismatch_unsupported(tmp_path, dcp):
    """sm90 plans FA3's per-request segments from the host query offsets in
    the builder (CUDA-graph planning), so it must tell vLLM that it cannot
    take a device layout that differs from the host's; sm100 reads the
    device offsets and keeps upstream's yes."""
    from types import SimpleNamespace

    from vllm.config import set_current_vllm_config
    from vllm.v1.worker.gpu.attn_utils import get_query_lens_mismatch_unsupported_backend

    backend = Backend("FLASHINFER_MLA")
    flashinfer = backend.backend
    config = make_vllm_config(tmp_path / "model", dcp=dcp, block_size=64,
                              num_speculative_tokens=4)
    groups = [[SimpleNamespace(backend=flashinfer, layer_names=["l0"])]]
    with set_current_vllm_config(config):
        with mock.patch.object(backend.module.checks, "current_gpu_major",
                               return_value=9):
            assert not flashinfer.supports_device_cpu_query_lens_mismatch()
            assert get_query_lens_mismatch_unsupported_backend(groups) == \
                flashinfer.__name__
        with mock.patch.object(backend.module.checks, "current_gpu_major",
                               return_value=10):
            assert flashinfer.supports_device_cpu_query_lens_mismatch()
            assert get_query_lens_mismatch_unsupported_backend(groups) is None


def _validate(backend_cls, *, use_dcp):
    from vllm.platforms.interface import DeviceCapability

    return backend_cls.validate_configuration(
        head_size=576, dtype=torch.bfloat16, kv_cache_dtype="fp8", block_size=64,
        use_mla=True, has_sink=False, use_sparse=False, use_mm_prefix=False,
        use_per_head_quant_scales=False, device_capability=DeviceCapability(10, 0),
        attn_type="decoder", use_adaptive_verification=True, use_dcp=use_dcp)


MISMATCH_REASON = ("device-cpu query lens mismatch not supported, this is needed for "
                   "adaptive verification")


@pytest.mark.parametrize("dcp", [1, 2, 4])
def test_tokenspeed_declares_the_mismatch_unsupported_under_dcp(tmp_path, dcp):
    """vLLM's selector check and Model Runner V2's start-up check both read
    ``supports_device_cpu_query_lens_mismatch``; with DCP 1 it is upstream's."""
    from types import SimpleNamespace

    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.mla.tokenspeed_mla import TokenspeedMLABackend
    from vllm.v1.worker.gpu.attn_utils import get_query_lens_mismatch_unsupported_backend

    tokenspeed = Backend("TOKENSPEED_MLA").backend
    flashinfer = Backend("FLASHINFER_MLA").backend
    config = make_vllm_config(tmp_path / "model", dcp=dcp, block_size=64,
                              num_speculative_tokens=4)
    with set_current_vllm_config(config):
        reasons = _validate(tokenspeed, use_dcp=dcp > 1)
        groups = [[SimpleNamespace(backend=tokenspeed, layer_names=["l0"])]]
        refused = get_query_lens_mismatch_unsupported_backend(groups)
        upstream = TokenspeedMLABackend.supports_device_cpu_query_lens_mismatch()
        ours = tokenspeed.supports_device_cpu_query_lens_mismatch()
        # FlashInfer's rows follow the device offsets: it keeps upstream's yes.
        assert flashinfer.supports_device_cpu_query_lens_mismatch()
    if dcp == 1:
        assert ours == upstream
        assert (MISMATCH_REASON in reasons) == (not upstream)
    else:
        assert not ours
        assert MISMATCH_REASON in reasons
        assert refused == tokenspeed.__name__
