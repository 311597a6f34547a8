# SPDX-License-Identifier: Apache-2.0
"""The DCP setting read from vLLM's config, and the builders checking it.

Each backend's limits, generated from its record on sm90 and sm100:
``tests/test_dcp_backend_limits.py``."""

from __future__ import annotations

import re

from unittest import mock

import pytest

from tests.support.builder_harness import fake_dcp_group, make_builder, make_vllm_config
from vllm.v1.attention.backends.mla import dcp_config_checks as checks
from vllm.v1.attention.backends.mla import dcp_settings as settings


def test_setting_read_from_vllm_config(tmp_path):
    config = make_vllm_config(tmp_path / "m", dcp=2, interleave=16, block_size=64,
                              num_speculative_tokens=7)
    setting = checks.DCPSetting.from_vllm_config(config, gpu_major=9)
    assert setting == checks.DCPSetting(
        gpu_major=9, tensor_parallel_size=2, dcp_size=2, interleave=16, block_size=64,
        kv_cache_dtype="auto", num_speculative_tokens=7, max_decode_query_len=8,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        speculative_method="ngram")


def test_builder_raises_at_start_up(tmp_path):
    """Through the real builder construction (what vLLM does at start-up)."""
    from tests.support.kernel_stubs import import_on_cpu

    module = import_on_cpu("vllm.v1.attention.backends.mla.tokenspeed_dcp_mla")
    config = make_vllm_config(tmp_path / "m", dcp=2, interleave=16, block_size=64,
                              num_speculative_tokens=8)
    with fake_dcp_group(2, 0), \
            mock.patch.object(checks, "current_gpu_major", return_value=9), \
            pytest.raises(ValueError) as error:
        make_builder(module.TokenspeedDCPMLAMetadataBuilder, config)
    message = str(error.value)
    # The plugin's backends that serve sm90 bf16 (those whose modules import
    # here: FlashInfer's and FlashAttention's may not on a CPU).
    for named in re.findall(r"name ([A-Z_ ]+) in --attention-backend", message):
        assert "FLASHMLA" in named.split(" or ")
    assert "--kv-cache-dtype fp8" in message
    assert "num_speculative_tokens <= 7" in message


@pytest.mark.parametrize("method,sample_from_anchor,draft_len", [
    ("dspark", None, 5), ("dspark", True, 5), ("dspark", False, 6),
    ("ngram", None, 6)])
def test_decode_query_len_is_vllms(tmp_path, method, sample_from_anchor, draft_len):
    """The draft's query length is what vLLM's MRV2 drafter runs (DSpark:
    ``DSparkSpeculator.num_query_per_req``, k when the block samples from
    its anchor, vLLM's default), the target's verification 1 + k."""
    from types import SimpleNamespace

    config = make_vllm_config(tmp_path / "m", dcp=2, num_speculative_tokens=5)
    hf = SimpleNamespace() if sample_from_anchor is None else SimpleNamespace(
        sample_from_anchor=sample_from_anchor)
    spec = config.speculative_config
    with mock.patch.object(spec, "method", method), \
            mock.patch.object(spec, "draft_model_config",
                              SimpleNamespace(hf_config=hf)):
        assert settings.decode_query_len(config, draft=True) == draft_len
        assert settings.decode_query_len(config, draft=False) == 6


@pytest.mark.parametrize("draft", [True, False])
def test_tokenspeed_builder_checks_its_models_query_len(tmp_path, draft):
    """The builder of the draft's layers (a non-causal DSpark block of 8)
    accepts 8 speculative tokens; the target's (8 + 1 verified) refuses them."""
    from tests.support.cuda_selection import as_cuda_gpu, gpu_engine_config
    from tests.support.kernel_stubs import import_on_cpu
    from tests.support.tiny_dspark import build_config_only_pair

    target_dir, draft_dir = build_config_only_pair(tmp_path)
    config = gpu_engine_config(
        target_dir, tp=8, dcp=8, kv_cache_dtype="fp8", block_size=64,
        max_model_len=2048,
        speculative_config=dict(method="dspark", model=str(draft_dir),
                                num_speculative_tokens=8,
                                attention_backend="TOKENSPEED_MLA"))
    module = import_on_cpu("vllm.v1.attention.backends.mla.tokenspeed_dcp_mla")
    with fake_dcp_group(8, 0), as_cuda_gpu(10):
        if draft:
            make_builder(module.TokenspeedDCPMLAMetadataBuilder, config,
                         non_causal=True)
            return
        with pytest.raises(ValueError, match="needs 9: set num_speculative_"
                                             "tokens <= 7"):
            make_builder(module.TokenspeedDCPMLAMetadataBuilder, config)


def test_one_draft_detection_for_checks_and_slack(tmp_path):
    """A KV-cache group is the draft's by any of vLLM's three marks: a
    non-causal block, a non-causal drafter's attention config, or layer
    indices past the target's (a causal draft such as MTP has only this
    one); the checks read that group's setting as the draft's."""
    from tests.support.builder_harness import TINY_MLA_CONFIG, register_fake_mla_layers

    config = make_vllm_config(tmp_path / "m", dcp=2, num_speculative_tokens=3)
    first_draft = TINY_MLA_CONFIG["num_hidden_layers"]
    target = ["model.layers.0.self_attn.attn"]
    causal_draft = [f"model.layers.{first_draft}.self_attn.attn"]
    assert not settings.is_draft_group(config, target)
    assert settings.is_draft_group(config, causal_draft)
    register_fake_mla_layers(config, ["model.layers.1.self_attn.attn"],
                             non_causal=True)
    assert settings.is_draft_group(config, ["model.layers.1.self_attn.attn"])
    with mock.patch.object(config.attention_config, "use_non_causal", True,
                           create=True):
        assert settings.is_draft_group(config, target)
    draft_setting = settings.DCPSetting.from_vllm_config(config, 9, draft=True)
    assert draft_setting.host_length_slack == 6
    assert settings.DCPSetting.from_vllm_config(config, 9).host_length_slack == 3
