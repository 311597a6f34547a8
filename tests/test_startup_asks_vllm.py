# SPDX-License-Identifier: Apache-2.0
"""The start-up check's decision against what vLLM's own code does with the
same config: its selector, its block-size code and its engine core.

Each case below was a disagreement while the check predicted vLLM (its own
copy of vLLM's backend order, block-size rule and hybrid alignment): the
check now asks vLLM (``dcp_vllm_answer``), so it refuses exactly what vLLM
would fail on after the weights load, and accepts what vLLM starts.
"""

from __future__ import annotations

import json
import shlex

import pytest

from tests.support import recipe_start as rs
from tests.support.cuda_selection import check_as_gpu, gpu_engine_config

SPEC = json.dumps({"method": "dspark", "num_speculative_tokens": 4})


@pytest.fixture(scope="module")
def dense_pair(tmp_path_factory):
    """A DeepSeek-V3-shaped (dense MLA, not hybrid) target and its DSpark draft."""
    from tests.support.tiny_dspark import build_config_only_pair

    return build_config_only_pair(tmp_path_factory.mktemp("dense"))


def _flashmla_absent_config(dense_pair):
    target, draft = dense_pair
    return gpu_engine_config(
        target, tp=8, dcp=8, max_model_len=2048, cp_kv_cache_interleave_size=64,
        speculative_config=dict(method="dspark", model=str(draft),
                                num_speculative_tokens=4))


def test_vllm_without_flashmla_refused_before_load(dense_pair):
    """vLLM built without FlashMLA's extension, sm90, bf16, interleave 64, no
    --block-size, no backend named: vLLM's selector gives both models a
    backend that pages by 16 at block 16, which the engine core's
    ``validate_block_size`` refuses for interleave 64. Refused before load,
    naming --block-size with a value at which vLLM starts both models."""
    from tests.support.gpu_config import on_cuda_host
    from tests.support.cuda_selection import backends_overridden
    from vllm.v1.attention.backends.mla import dcp_vllm_answer

    from vllm.config.cache import CacheConfig

    config = _flashmla_absent_config(dense_pair)
    rs.import_on_cpu(config)
    with on_cuda_host(9, flashmla=False), backends_overridden():
        answer = dcp_vllm_answer.ask_vllm(config)
    assert "FLASHMLA" not in answer.backends
    if CacheConfig.DEFAULT_BLOCK_SIZE % 64 == 0:
        # vLLM 0.34's default block 64: FLASHINFER_MLA pages by it and starts.
        assert answer.block_refusal is None and answer.block_size == 64
        check_as_gpu(config, 9, flashmla=False)
        return
    assert answer.block_refusal is not None
    assert "divisible by cp_kv_cache_interleave_size (64)" in answer.block_refusal
    with pytest.raises(ValueError) as refusal:
        check_as_gpu(config, 9, flashmla=False)
    message = str(refusal.value)
    assert "--cp-kv-cache-interleave-size 64" in message
    assert "Pass --block-size 64: vLLM then runs them on" in message
    # With FlashMLA present the same flags start (vLLM pages FLASHMLA by 64).
    check_as_gpu(_flashmla_absent_config(dense_pair), 9)


# Kimi-Linear's KDA state (32 heads x 128) at -tp 8: vLLM's hybrid alignment
# gives the attention page 256 tokens, not the 128 a rule of thumb says.
KIMI_LINEAR_KDA = rs.PairShape(kda_heads=32, kda_head_dim=128)


def test_kimi_linear_sized_kda_at_interleave_256_starts_on_flashmla(tmp_path):
    argv = shlex.split(f"-tp 8 -dcp 8 --cp-kv-cache-interleave-size 256 "
                       f"--speculative-config '{SPEC}'")
    config = rs.recipe_config(argv, tmp_path, major=9, shape=KIMI_LINEAR_KDA)
    rs.check_on_cuda(config, 9)
    start = rs.start_config(config, 9)
    assert start.block_size == 256
    assert start.role(False)[0] == start.role(True)[0] == "FLASHMLA"


@pytest.mark.parametrize("dcp", [8, 1])
def test_fp32_model_under_dcp_refused_naming_dtype(tmp_path, dcp):
    """vLLM's selector has no MLA backend for an fp32 model on sm90: under
    DCP refused before load, naming --dtype (vLLM's reasons quoted); at
    -dcp 1 the check leaves it to vLLM, as upstream."""
    argv = shlex.split(f"-tp 8 -dcp {dcp} --dtype float32 --speculative-config "
                       f"'{SPEC}'")
    config = rs.recipe_config(argv, tmp_path, major=9)
    if dcp == 1:
        rs.check_on_cuda(config, 9)
        with pytest.raises(ValueError, match="No valid attention backend"):
            rs.start_config(config, 9)
        return
    with pytest.raises(ValueError) as refusal:
        rs.check_on_cuda(config, 9)
    message = str(refusal.value)
    assert "dtype not supported" in message
    assert "To serve them: pass --dtype bfloat16" in message


def test_child_process_gives_the_same_verdict(tmp_path):
    """On a GPU the check asks vLLM in a spawned child that loads vLLM's
    plugins: the config travels pickled and the verdict comes back. Here on
    the CPU platform (interleave 48 against CPU_MLA's fixed 16)."""
    from tests.support.builder_harness import TINY_MLA_CONFIG
    from tests.support.cuda_selection import engine_config
    from unittest import mock

    from vllm.v1.attention.backends.mla import dcp_startup_checks

    (tmp_path / "config.json").write_text(json.dumps(TINY_MLA_CONFIG))
    with mock.patch.object(dcp_startup_checks, "check_vllm_config"):
        config = engine_config(tmp_path, cp_kv_cache_interleave_size=48)
    here = dcp_startup_checks.judge(config, None)
    assert here.error and "interleave_size (48)" in here.error
    assert dcp_startup_checks._judge_in_child(config, None) == here


def test_child_that_fails_leaves_the_start_to_vllm(tmp_path, monkeypatch):
    """A child that hangs (here: answers later than allowed) or dies stops
    no start: one warning, and the workers' own checks stand."""
    from tests.support.builder_harness import TINY_MLA_CONFIG
    from tests.support.cuda_selection import engine_config
    from unittest import mock

    from vllm.v1.attention.backends.mla import dcp_startup_checks

    (tmp_path / "config.json").write_text(json.dumps(TINY_MLA_CONFIG))
    with mock.patch.object(dcp_startup_checks, "check_vllm_config"):
        config = engine_config(tmp_path, cp_kv_cache_interleave_size=48)
    monkeypatch.setattr(dcp_startup_checks, "CHILD_TIMEOUT_S", 0.01)
    verdict = dcp_startup_checks._judge_in_child(config, None)
    assert verdict.error is None
    assert "could not ask vLLM" in verdict.warning
