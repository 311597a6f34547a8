# SPDX-License-Identifier: Apache-2.0
"""Unsupported DCP settings fail while vLLM builds its config, naming the flag.

Every config here is built by vLLM's own ``EngineArgs.create_engine_config``
(what ``vllm serve`` does before it starts an engine), with the plugin loaded
by vLLM's own plugin loader; no worker starts and no model is loaded. The
CUDA cases re-run the checks on such a config with the platform answering
as a Hopper / Blackwell GPU would.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.support.builder_harness import TINY_MLA_CONFIG, cpu_with_amx, cpu_without_amx
from tests.support.cuda_selection import (check_as_gpu, engine_config, gpu_engine_config,
                                          plugin_registered)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-mla-config")
    (path / "config.json").write_text(json.dumps(TINY_MLA_CONFIG))
    return path


@pytest.fixture(params=["no-amx", "amx-cpu-mla"])
def cpu_host(request):
    """The two CPUs CI may run on, each as its operator runs ``-dcp``: without
    AMX tiles vLLM picks CPU_MLA by itself (no flag); with them it would pick
    AMX_MLA, so the operator passes ``--attention-backend CPU_MLA`` (what the
    start-up check asks for). Yields (extra engine flags, who chose CPU_MLA
    in the error message)."""
    if request.param == "no-amx":
        with cpu_without_amx():
            yield {}, "vLLM on this CPU"
    else:
        with cpu_with_amx():
            yield dict(attention_backend="CPU_MLA"), "--attention-backend"


# (engine flags, texts the error must contain)
CPU_UNSUPPORTED = [
    (dict(cp_kv_cache_interleave_size=48), ["--cp-kv-cache-interleave-size 48",
                                            "fixes to 16", "(1, 2, 4, 8, 16)"]),
    # a multiple of the block size is no divisor of it
    (dict(cp_kv_cache_interleave_size=32), ["--cp-kv-cache-interleave-size 32"]),
    # CPU_MLA keeps block 16 whatever --block-size asks for
    (dict(cp_kv_cache_interleave_size=64, block_size=64),
     ["--cp-kv-cache-interleave-size 64", "fixes to 16"]),
    (dict(kv_cache_dtype="fp8"), ["--kv-cache-dtype auto"]),
]


@pytest.mark.parametrize("flags,texts", CPU_UNSUPPORTED,
                         ids=[",".join(f"{k}={v}" for k, v in f.items())
                              for f, _ in CPU_UNSUPPORTED])
def test_cpu_rejects_at_config_time(model_dir, cpu_host, flags, texts):
    host_flags, chosen_by = cpu_host
    with pytest.raises(ValueError) as error:
        engine_config(model_dir, **host_flags, **flags)
    message = str(error.value)
    if "kv_cache_dtype" in flags and \
            "is not supported by MLA attention on CPU" in message:
        # vLLM >= 0.33 refuses an fp8 MLA cache on CPU itself, first, and
        # names the flag.
        assert "--kv-cache-dtype fp8" in message
        return
    assert f"CPU_MLA (chosen by {chosen_by}) cannot serve" in message
    for text in texts:
        assert text in message


@pytest.mark.parametrize("interleave", [1, 2, 16])
def test_cpu_accepts_supported_interleaves(model_dir, cpu_host, interleave):
    host_flags, _ = cpu_host
    config = engine_config(model_dir, cp_kv_cache_interleave_size=interleave,
                           **host_flags)
    assert config.parallel_config.cp_kv_cache_interleave_size == interleave
    assert config.cache_config.block_size == 16


def test_dcp_1_is_left_to_vllm(model_dir):
    """Without DCP nothing of this patch may reject a config vLLM accepts."""
    config = engine_config(model_dir, tp=1, dcp=1, cp_kv_cache_interleave_size=48,
                           kv_cache_dtype="fp8")
    assert config.parallel_config.cp_kv_cache_interleave_size == 48


def test_cpu_with_amx_asks_for_cpu_mla(model_dir):
    """On an AMX CPU vLLM selects AMX_MLA, which has no DCP."""
    from vllm.v1.attention import selector

    with cpu_with_amx():
        with pytest.raises(ValueError, match="--attention-backend CPU_MLA"):
            engine_config(model_dir)
        selector._cached_get_attn_backend.cache_clear()
        config = engine_config(model_dir, attention_backend="CPU_MLA")
        assert config.attention_config.backend.name == "CPU_MLA"



def flashinfer_block_size() -> int:
    """vLLM's block size for FLASHINFER_MLA alone without --block-size: its
    default where FlashInfer's kernels (32 or 64 tokens) page by it."""
    import math

    from vllm.config.cache import CacheConfig

    return math.lcm(CacheConfig.DEFAULT_BLOCK_SIZE, 32)


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}

# (engine flags, GPU major, texts the error must contain); None: accepted
# The block size vLLM gives FLASHINFER_MLA without --block-size: 32 on vLLM
# 0.32 (default 16, not a kernel size), 64 on 0.34 (default 64).
FI_BLOCK = flashinfer_block_size()

# Each backend's own limits on sm90 and sm100: tests/test_dcp_backend_limits.py.
GPU_CASES = [
    (dict(attention_backend="FLASHINFER_MLA"), 8, ["--attention-backend"]),
    # n-gram has no draft model: vLLM builds no layer the draft's backend names.
    (dict(speculative_config=dict(NGRAM, attention_backend="TOKENSPEED_MLA"),
          kv_cache_dtype="fp8"), 9, None),
    # FlashInfer pages by FI_BLOCK unless told: twice that cannot divide it ...
    (dict(attention_backend="FLASHINFER_MLA", cp_kv_cache_interleave_size=2 * FI_BLOCK),
     10, [f"--cp-kv-cache-interleave-size {2 * FI_BLOCK} does not divide",
          f"Block_size({FI_BLOCK})", f"Pass --block-size {2 * FI_BLOCK}: vLLM "
          "then runs them on FLASHINFER_MLA"]),
    # ... FI_BLOCK does, whatever the config's block size says before that
    (dict(attention_backend="FLASHINFER_MLA", cp_kv_cache_interleave_size=FI_BLOCK), 10,
     None),
    (dict(attention_backend="FLASHINFER_MLA", cp_kv_cache_interleave_size=2 * FI_BLOCK),
     9, [f"Block_size({FI_BLOCK})", f"Pass --block-size {2 * FI_BLOCK}"]),
    # --block-size given: the interleave is checked whatever vLLM picks.
    (dict(cp_kv_cache_interleave_size=48, block_size=64), 10,
     ["--cp-kv-cache-interleave-size 48 does not divide", "Block_size(64)",
      "Pass --block-size 96"]),
    (dict(cp_kv_cache_interleave_size=32, block_size=64), 10, None),
]


@pytest.mark.parametrize("flags,major,texts", GPU_CASES,
                         ids=[f"sm{m}0-" + ",".join(f"{k}={v}" for k, v in f.items()
                                                     if k != "speculative_config")
                              + ("-draft" if "speculative_config" in f else "")
                              for f, m, _ in GPU_CASES])
def test_gpu_backends_checked_at_config_time(model_dir, flags, major, texts):
    config = gpu_engine_config(model_dir, **flags)
    if texts is None:
        check_as_gpu(config, major)
        return
    with pytest.raises(ValueError) as error:
        check_as_gpu(config, major)
    for text in texts:
        assert text in str(error.value)


@pytest.fixture(scope="module")
def dspark_pair(tmp_path_factory):
    """(target, draft): a tiny Kimi-K3 DSpark draft (sample_from_anchor left at
    vLLM's default, as in the K3 drafts) and its target's config."""
    from tests.support.tiny_dspark import build_config_only_pair

    return build_config_only_pair(tmp_path_factory.mktemp("dspark"))


def dspark(draft_dir, num_spec, **fields):
    return dict(method="dspark", model=str(draft_dir),
                num_speculative_tokens=num_spec, **fields)


# (who runs TOKENSPEED_MLA, num_speculative_tokens, the limit named; None: accepted)
TOKENSPEED_QUERY_LENS = [("draft", 8, None), ("draft", 9, 8), ("target", 7, None),
                         ("target", 8, 7)]


@pytest.mark.parametrize("role,num_spec,limit", TOKENSPEED_QUERY_LENS)
def test_tokenspeed_checked_with_each_models_query_len(dspark_pair, role, num_spec,
                                                       limit):
    """Tokenspeed decodes at most 8 query tokens: the DSpark draft block has
    num_speculative_tokens of them (vLLM's drafter samples from the anchor),
    the target's verification one more."""
    backend = dict(attention_backend="TOKENSPEED_MLA")
    model_dir, draft_dir = dspark_pair
    config = gpu_engine_config(
        model_dir, tp=8, dcp=8, kv_cache_dtype="fp8", max_model_len=2048,
        speculative_config=dspark(draft_dir, num_spec,
                                  **(backend if role == "draft" else {})),
        **(backend if role == "target" else {}))
    if limit is None:
        check_as_gpu(config, 10)
        return
    with pytest.raises(ValueError) as error:
        check_as_gpu(config, 10)
    needs = num_spec + (role == "target")
    assert (f"this setting needs {needs}: set num_speculative_tokens <= "
            f"{limit}") in str(error.value)


@pytest.mark.parametrize("switch", [None, "0", "false", "off", "no"])
@pytest.mark.parametrize("dcp", [1, 2])
def test_cpu_dspark_without_the_route_names_its_switch(dspark_pair, monkeypatch,
                                                       switch, dcp):
    """vLLM refuses DSpark on CPU without naming VLLM_DCP_CPU_MRV2; the
    start-up checks name it, at any -dcp."""
    monkeypatch.delenv("VLLM_DCP_CPU_MRV2", raising=False)
    if switch is not None:
        monkeypatch.setenv("VLLM_DCP_CPU_MRV2", switch)
    model_dir, draft_dir = dspark_pair
    with pytest.raises(ValueError) as error:
        engine_config(model_dir, tp=dcp, dcp=dcp, max_model_len=2048,
                      speculative_config=dspark(draft_dir, 4))
    assert "set VLLM_DCP_CPU_MRV2=1" in str(error.value)


@pytest.mark.parametrize("name", ["VLLM_DCP_CPU_MRV2", "VLLM_DCP_CPU_ROPE_FIX",
                                  "VLLM_DCP_CPU_PREFILL_FEATURES"])
def test_cpu_switch_misspelt_is_refused(model_dir, monkeypatch, name):
    monkeypatch.setenv(name, "enable")
    with pytest.raises(ValueError, match=f"{name}='enable' is not a boolean"):
        engine_config(model_dir)


@pytest.mark.parametrize("draft_backend", [None, "CPU_MLA"])
@pytest.mark.parametrize("amx", [False, True])
def test_cpu_dspark_draft_backend_checked(dspark_pair, monkeypatch, amx,
                                          draft_backend):
    """vLLM gives a DSpark draft's layers the speculative config's
    attention_backend, not the target's: on a CPU with AMX tiles the draft
    needs CPU_MLA named there too, and the error says where."""
    from vllm.v1.attention.backends.mla import dcp_startup_checks

    monkeypatch.setenv("VLLM_DCP_CPU_MRV2", "1")
    model_dir, draft_dir = dspark_pair
    backend = {} if draft_backend is None else dict(attention_backend=draft_backend)
    # CPU_MLA's block, which vLLM's CPU platform fixes (a GPU host's config
    # would hold vLLM's default until a worker sets it).
    config = gpu_engine_config(model_dir, tp=2, dcp=2, max_model_len=2048,
                               attention_backend="CPU_MLA", block_size=16,
                               speculative_config=dspark(draft_dir, 4, **backend))
    with cpu_with_amx() if amx else cpu_without_amx():
        if amx and draft_backend is None:
            with pytest.raises(ValueError) as error:
                dcp_startup_checks.check_vllm_config(config)
            assert ("vLLM picks AMX_MLA for the DSpark draft's layers"
                    in str(error.value))
            assert ('add "attention_backend": "CPU_MLA" to --speculative-config'
                    in str(error.value))
        else:
            dcp_startup_checks.check_vllm_config(config)


@pytest.mark.parametrize("major", [9, 10])
def test_draft_kv_dtype_without_block_size_refused_off_hybrid_models(dspark_pair,
                                                                      major):
    """A draft KV dtype of its own, no --block-size, a model vLLM does not
    align (not hybrid): vLLM's DSpark loader rebuilds the draft's cache
    config with the provisional block size as if given, where its selector
    gives the draft TRITON_MLA although FLASHMLA / FLASHINFER_MLA serve it
    at 64. Refused before load, naming --block-size 64; with it, or at
    -dcp 1 (vLLM's own), accepted."""
    from vllm.config.cache import CacheConfig

    from tests.support.cuda_selection import plugin_registered, select_mla_backend

    target, draft = dspark_pair
    flags = dict(tp=8, kv_cache_dtype="fp8", max_model_len=2048,
                 speculative_config=dspark(draft, 4, kv_cache_dtype="auto"))
    config = gpu_engine_config(target, dcp=8, **flags)
    assert not config.model_config.is_hybrid
    # What a worker selects for the draft's layers in its rebuilt config.
    provisional = CacheConfig.DEFAULT_BLOCK_SIZE
    cache = config.cache_config
    saved = cache.block_size, cache.user_specified_block_size
    cache.block_size, cache.user_specified_block_size = provisional, True
    with plugin_registered(True):
        selected = select_mla_backend(config, major, non_causal=True)
    cache.block_size, cache.user_specified_block_size = saved
    if provisional % 64:  # vLLM 0.32's 16
        assert selected.get_name() == "TRITON_MLA"
        fast = {9: "64: vLLM then runs them on FLASHMLA",
                10: "32: vLLM then runs them on FLASHINFER_MLA"}[major]
        with pytest.raises(ValueError, match=re.escape(
                "the DSpark draft's layers on TRITON_MLA under decode context "
                f"parallelism, where a --block-size starts a fast DCP backend. "
                f"Pass --block-size {fast}")):
            check_as_gpu(config, major)
    else:  # vLLM 0.34's 64: the fast path, accepted
        assert selected.get_name() != "TRITON_MLA"
        check_as_gpu(config, major)
    check_as_gpu(gpu_engine_config(target, dcp=8, block_size=64, **flags), major)
    check_as_gpu(gpu_engine_config(target, dcp=1, **flags), major)



# (GPU major, the draft's named backend, --kv-cache-dtype, the draft's own)
NAMED_DRAFT_OWN_DTYPE_CASES = [
    (9, "FLASHMLA", "auto", "auto"),
    (9, "FLASHINFER_MLA", "auto", "auto"),
    (10, "FLASHINFER_MLA", "fp8", "fp8"),
]


@pytest.mark.parametrize("major,backend,kv_cache_dtype,draft_dtype",
                         NAMED_DRAFT_OWN_DTYPE_CASES)
def test_named_draft_backend_judged_at_the_provisional_block_size(
        dspark_pair, major, backend, kv_cache_dtype, draft_dtype):
    """A draft backend named in --speculative-config, the draft's own KV
    dtype, no --block-size, a model vLLM does not align: the worker selects
    the named backend at the provisional block size the DSpark loader
    passes as given (vLLM 0.32's 16: refused after the target's weights
    load), not at the picks' preferred 64. Refused before load there,
    naming --block-size 64; on 0.34 (provisional 64) accepted, as there."""
    from vllm.config.cache import CacheConfig
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from tests.support.cuda_selection import plugin_registered, select_mla_backend

    target, draft = dspark_pair
    flags = dict(tp=8, kv_cache_dtype=kv_cache_dtype, max_model_len=2048,
                 speculative_config=dspark(draft, 4, kv_cache_dtype=draft_dtype,
                                           attention_backend=backend))
    config = gpu_engine_config(target, dcp=8, **flags)
    assert not config.model_config.is_hybrid
    # What a worker selects for the draft's layers in its rebuilt config.
    provisional = CacheConfig.DEFAULT_BLOCK_SIZE
    cache, attention = config.cache_config, config.attention_config
    saved = cache.block_size, cache.user_specified_block_size, attention.backend
    cache.block_size, cache.user_specified_block_size = provisional, True
    attention.backend = AttentionBackendEnum[backend]
    try:
        with plugin_registered(True):
            selected = select_mla_backend(config, major, non_causal=True,
                                          kv_cache_dtype=draft_dtype)
    finally:
        cache.block_size, cache.user_specified_block_size, attention.backend = saved
    if provisional % 64:  # vLLM 0.32's 16: the worker refuses the named backend
        assert isinstance(selected, ValueError), selected
        with pytest.raises(ValueError) as error:
            check_as_gpu(config, major)
        message = str(error.value)
        assert f"({backend}, named by attention_backend in --speculative-config)" \
            in message
        assert "['block_size not supported']" in message
        assert ("To serve them: leave attention_backend in --speculative-config "
                "out for vLLM's choice") in message
    else:  # vLLM 0.34's 64: the worker selects it, accepted
        assert not isinstance(selected, ValueError), selected
        assert selected.get_name() == backend
        check_as_gpu(config, major)
    check_as_gpu(gpu_engine_config(target, dcp=8, block_size=64, **flags), major)
    check_as_gpu(gpu_engine_config(target, dcp=1, **flags), major)


# (GPU major, interleave, --block-size, text of the refusal; None: starts)
# A DeepSeek-V3-shaped target (vLLM does not align its block size) with a
# DSpark draft, no backend named: the block size vLLM will use is derived
# from the backends its order picks.
DERIVED_BLOCK_CASES = [
    # sm100: FLASHINFER_MLA pages by FI_BLOCK unless told, so at twice that
    # interleave vLLM's order moves on to CUTLASS_MLA for the target, which
    # has no DSpark x DCP.
    (10, 2 * FI_BLOCK, None, f"Pass --block-size {max(2 * FI_BLOCK, 64)}: vLLM "
                             "then runs them on FLASHINFER_MLA"),
    (10, 2 * FI_BLOCK, 2 * FI_BLOCK, None),
    (10, 256, None, "Pass --block-size 256"),
    # sm90: FLASHMLA pages by 64, FLASH_ATTN_MLA by 16 but serves DSpark at
    # interleave 1 only: vLLM picks FLASHMLA for both models ...
    (9, 32, None, None),
    # ... but not at interleave 128: TRITON_MLA for both, paged by vLLM's
    # default block size.
    (9, 128, None, "Pass --block-size 128: vLLM then runs them on FLASHMLA"),
]


@pytest.mark.parametrize("major,interleave,block_size,refusal", DERIVED_BLOCK_CASES)
def test_interleave_checked_at_the_block_size_vllm_will_use(dspark_pair, major,
                                                            interleave, block_size,
                                                            refusal):
    target, draft = dspark_pair
    config = gpu_engine_config(
        target, tp=8, dcp=8, max_model_len=2048,
        cp_kv_cache_interleave_size=interleave,
        speculative_config=dspark(draft, 4),
        **({} if block_size is None else dict(block_size=block_size)))
    if refusal is None:
        check_as_gpu(config, major)
        return
    with pytest.raises(ValueError, match=re.escape(refusal)):
        check_as_gpu(config, major)


@pytest.mark.parametrize("major,role", [(9, "draft"), (10, "target")])
def test_fall_to_triton_at_an_explicit_block_size_warned(dspark_pair, major, role):
    """--block-size 16 on a model vLLM does not align: vLLM's selector gives
    the draft (sm90) or both models (sm100) TRITON_MLA, which starts; one
    warning names the block size of the fast path. At -dcp 1 nothing."""
    from unittest import mock

    from tests.support.cuda_selection import plugin_registered, select_mla_backend
    from vllm.v1.attention.backends.mla import dcp_startup_checks

    target, draft = dspark_pair
    flags = dict(tp=8, max_model_len=2048, block_size=16,
                 speculative_config=dspark(draft, 4))
    config = gpu_engine_config(target, dcp=8, **flags)
    with plugin_registered(True):
        selected = select_mla_backend(config, major, non_causal=role == "draft")
    assert selected.get_name() == "TRITON_MLA"
    with mock.patch.object(dcp_startup_checks.logger, "warning_once") as warning:
        check_as_gpu(config, major)
        assert warning.call_count == 1
        message = warning.call_args.args[0] % warning.call_args.args[1:]
        assert "on TRITON_MLA" in message and "Pass --block-size 32" in message
        warning.reset_mock()
        check_as_gpu(gpu_engine_config(target, dcp=8, **dict(flags, block_size=64)),
                     major)
        check_as_gpu(gpu_engine_config(target, dcp=1, **flags), major)
        assert warning.call_count == 0


def test_other_named_backends_as_vllm_selects_them(dspark_pair):
    """A backend without DCP limits here (vLLM's sparse ones) is vLLM's to
    judge: named for a dense model, vLLM's selector refuses it before load,
    with vLLM's reason and the flag."""
    target, draft = dspark_pair
    config = gpu_engine_config(target, tp=8, dcp=8, max_model_len=2048,
                               attention_backend="FLASHMLA_SPARSE",
                               speculative_config=dspark(draft, 4))
    with pytest.raises(ValueError, match=re.escape(
            "(FLASHMLA_SPARSE, named by --attention-backend)")) as error:
        check_as_gpu(config, 10)
    assert "non-sparse not supported" in str(error.value)
    assert "leave --attention-backend out" in str(error.value)
