# SPDX-License-Identifier: Apache-2.0
"""Each backend's DCP limits, as its class declares them (``dcp_limits``).

The record agrees with vLLM's own hooks on the class (kernel block sizes, KV
dtypes, GPU generations, non-causal DCP) and with the launcher's copy of
Tokenspeed's query limit; vLLM's MLA order is the one the start-up checks
walk. Then, generated from each record, on sm90 and sm100: a setting inside
every limit starts and one past each limit is refused, by the start-up
checks (naming a flag) and by vLLM's selection of the plugin's class alike.
The README's backend table is the records' rendering.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.support.cuda_selection import (as_cuda_gpu, check_as_gpu, gpu_engine_config,
                                          plugin_registered, select_mla_backend,
                                          unloading_llvmlite)
from tests.support.kernel_stubs import import_on_cpu
from vllm.v1.attention.backends.mla import dcp_config_checks as checks

REPO = Path(__file__).resolve().parents[1]
OVERRIDDEN = [name for name, limits in checks.LIMITS.items() if limits.overridden]
MODULES = {"FLASHINFER_MLA": "flashinfer_dcp_mla", "TOKENSPEED_MLA": "tokenspeed_dcp_mla",
           "FLASHMLA": "flashmla_dcp_mla", "FLASH_ATTN_MLA": "flashattn_dcp_mla",
           "TRITON_MLA": "triton_dcp_mla", "CPU_MLA": "cpu_dcp_mla"}


@pytest.fixture(autouse=True, scope="module")
def _unload_llvmlite():
    with unloading_llvmlite():
        yield


def _backend_class(name: str):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    if name in MODULES:
        import_on_cpu(f"vllm.v1.attention.backends.mla.{MODULES[name]}")
    # Registered as on CPU (the plugin's touches import model modules that
    # must not first load under the CUDA platform), imported as on sm100.
    with plugin_registered(True), as_cuda_gpu(10):
        return AttentionBackendEnum[name].get_class()


@pytest.mark.parametrize("name", list(checks.LIMITS))
def test_record_agrees_with_the_class_hooks(tmp_path, name):
    from vllm.config import set_current_vllm_config
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backend import MultipleOf

    from tests.support.builder_harness import make_vllm_config

    limits = checks.LIMITS[name]
    cls = _backend_class(name)
    if limits.overridden:
        assert cls.__module__.endswith(MODULES[name]) and cls.dcp_limits is limits
    sizes = tuple(s.base if isinstance(s, MultipleOf) else s
                  for s in cls.get_supported_kernel_block_sizes())
    assert sizes == limits.kernel_block_sizes
    assert tuple(cls.supported_kv_cache_dtypes) == limits.kv_cache_dtypes
    with set_current_vllm_config(make_vllm_config(tmp_path / "m", dcp=8,
                                                  block_size=64)):
        assert cls.supports_non_causal_dcp() == limits.non_causal
        if limits.gpu_majors is not None:
            # The record never claims a GPU the class refuses under DCP.
            assert all(cls.supports_compute_capability(DeviceCapability(major, 0))
                       for major in limits.gpu_majors)


def test_tokenspeed_query_limit_is_the_launchers():
    from tools import serve_dcp_dspark as serve

    assert checks.LIMITS["TOKENSPEED_MLA"].max_query_len == serve.TOKENSPEED_MAX_QUERY_LEN


# ---------------------------------------------------------------------------
# Generated from the records: (backend, GPU major, limit, knobs, refused)

BASE = dict(role="target", interleave=1, k=3, qk_nope=128)


def _base(limits, major: int) -> dict:
    kv = "auto" if limits.reads("auto", major) else "fp8"
    return dict(BASE, kv=kv, block=max(limits.kernel_block_sizes))


def limit_cases():
    for name in OVERRIDDEN:
        limits = checks.LIMITS[name]
        if limits.fixed_block_size:  # CPU_MLA: tests/test_dcp_startup_checks.py
            continue
        for major in (9, 10):
            base = _base(limits, major)
            if major not in (limits.gpu_majors or (major,)):
                yield name, major, "gpu", base, True
                continue
            yield name, major, "inside", base, False
            for kv in ("auto", "fp8"):
                if not limits.reads(kv, major):
                    yield name, major, "kv-dtype", dict(base, kv=kv), True
            if min(limits.kernel_block_sizes) >= 16:
                yield (name, major, "block", dict(base, block=min(
                    limits.kernel_block_sizes) // 2), True)
            yield (name, major, "interleave", dict(base, interleave=16),
                   limits.dspark_interleave not in (None, 16))
            yield (name, major, "draft-block", dict(base, role="draft"),
                   not limits.non_causal)
            if limits.max_query_len is not None:
                for k in (limits.max_query_len - 1, limits.max_query_len):
                    yield name, major, f"verify-{k + 1}", dict(base, k=k), k == limits.max_query_len
            if limits.qk_nope_head_dims is not None:
                yield name, major, "head-dims", dict(base, qk_nope=96), True


CASES = list(limit_cases())


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(target, draft) folders per qk_nope_head_dim: a tiny DeepSeek-V3-shaped
    target (no hybrid alignment) and its K3 DSpark draft."""
    from tests.support.tiny_dspark import build_config_only_pair

    root = tmp_path_factory.mktemp("limits")
    pairs = {128: build_config_only_pair(root / "128")}
    target = root / "96"
    target.mkdir()
    config = json.loads((pairs[128][0] / "config.json").read_text())
    (target / "config.json").write_text(json.dumps(dict(config, qk_nope_head_dim=96)))
    pairs[96] = (target, pairs[128][1])
    return pairs


@pytest.mark.parametrize("name,major,limit,knobs,refused", CASES,
                         ids=[f"{c[0]}-sm{c[1]}0-{c[2]}" for c in CASES])
def test_each_limit_refused_at_start_up_and_by_selection(models, name, major, limit,
                                                         knobs, refused):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    target, draft = models[knobs["qk_nope"]]
    named = dict(attention_backend=name)
    spec = dict(method="dspark", model=str(draft),
                num_speculative_tokens=knobs["k"],
                **(named if knobs["role"] == "draft" else {}))
    if knobs["qk_nope"] != 128:
        spec = None  # the draft keeps Kimi-K3's dims
    config = gpu_engine_config(
        target, tp=8, dcp=8, max_model_len=2048, kv_cache_dtype=knobs["kv"],
        block_size=knobs["block"], cp_kv_cache_interleave_size=knobs["interleave"],
        speculative_config=spec, **(named if knobs["role"] == "target" else {}))
    if refused:
        with pytest.raises(ValueError, match=f"{name}[ ,]") as refusal:
            check_as_gpu(config, major)
        assert re.search(r"--[a-z-]+|in --speculative-config", str(refusal.value))
    else:
        check_as_gpu(config, major)
    # vLLM's selector on the plugin's class (the draft's rebuilt config
    # carries its attention_backend as the backend).
    config.attention_config.backend = AttentionBackendEnum[name]
    with plugin_registered(True):
        selected = select_mla_backend(config, major,
                                      non_causal=knobs["role"] == "draft",
                                      kv_cache_dtype=knobs["kv"])
    assert isinstance(selected, ValueError) == refused, selected


# ---------------------------------------------------------------------------
# The README's table

TABLE_HEADER = ("| backend under DCP | GPUs | KV cache | pages by (tokens) | DSpark "
                "draft block | query tokens per request | interleave with DSpark | "
                "latent, head dims |\n|---|---|---|---|---|---|---|---|")


def render_table() -> str:
    rows = [TABLE_HEADER]
    for name, limits in checks.LIMITS.items():
        if not limits.overridden:
            continue
        gpus = ("CPU" if limits.fixed_block_size else "any" if limits.gpu_majors is None
                else ", ".join(f"sm{m}0" for m in limits.gpu_majors))
        kv = ", ".join(dict.fromkeys(
            "unquantized" if dtype in checks.UNQUANTIZED else "fp8"
            for dtype in limits.kv_cache_dtypes))
        if limits.unquantized_on:
            kv += " (" + ", ".join(f"sm{m}0" for m in limits.unquantized_on) + ": unquantized)"
        pages = ("fixed " if limits.fixed_block_size else "multiples of ") + " or ".join(
            map(str, limits.kernel_block_sizes))
        dims = "any" if limits.latent is None else " + ".join(map(str, limits.latent))
        for what, allowed in (("qk_nope", limits.qk_nope_head_dims),
                              ("v", limits.v_head_dims)):
            if allowed:
                dims += f"; {what} " + "/".join(map(str, allowed))
        rows.append(" | ".join([
            f"| `{name}`", gpus, kv, pages, "yes" if limits.non_causal else "no",
            "any" if limits.max_query_len is None else f"<= {limits.max_query_len}",
            "any" if limits.dspark_interleave is None else str(limits.dspark_interleave),
            dims]) + " |")
    return "\n".join(rows)


def test_readme_table_is_the_records():
    readme = (REPO / "README.md").read_text()
    assert render_table() in readme, "README's backend table:\n" + render_table()
