# SPDX-License-Identifier: Apache-2.0
"""Each backend's DCP limits, as its class declares them: vLLM's hooks on
the class (GPU generations, KV dtypes, kernel block sizes, non-causal DCP)
and its ``dcp_*`` attributes (what vLLM has no hook for).

Generated from each class, on sm90 and sm100: a setting inside every limit
starts and one past each limit is refused, by the start-up check (naming a
flag) and by vLLM's selection of the plugin's class alike. The README's
backend table is the classes' rendering.
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
MODULES = {"FLASHINFER_MLA": "flashinfer_dcp_mla", "TOKENSPEED_MLA": "tokenspeed_dcp_mla",
           "FLASHMLA": "flashmla_dcp_mla", "FLASH_ATTN_MLA": "flashattn_dcp_mla",
           "TRITON_MLA": "triton_dcp_mla", "CPU_MLA": "cpu_dcp_mla"}
OVERRIDDEN = list(MODULES)


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


def test_one_list_of_overridden_backends():
    from vllm.v1.attention.backends.mla.dcp_vllm_touches import BACKEND_OVERRIDES

    from tests.support.cuda_selection import OVERRIDDEN as SELECTION_OVERRIDDEN  # noqa

    assert {name for name, _ in BACKEND_OVERRIDES} == set(OVERRIDDEN)
    assert set(SELECTION_OVERRIDDEN) == set(OVERRIDDEN)
    for name in OVERRIDDEN:
        assert issubclass(_backend_class(name), checks.DCPLimits)
        assert _backend_class(name).__module__.endswith(MODULES[name])


class Limits:
    """A class's limits read off its hooks under DCP, as ``dcp_problems``
    reads them (the generated cases and the README's table)."""

    def __init__(self, name: str, tmp_path):
        from vllm.config import set_current_vllm_config

        from tests.support.builder_harness import make_vllm_config

        self.cls = cls = _backend_class(name)
        with set_current_vllm_config(make_vllm_config(tmp_path / name, dcp=8,
                                                      block_size=64)), as_cuda_gpu(10):
            self.gpu_majors = checks.gpu_majors(cls)
            self.non_causal = cls.supports_non_causal_dcp()
        self.fixed_block_size = checks.fixed_block_size(cls)
        self.kernel_block_sizes = checks.kernel_block_sizes(cls)
        self.kv_cache_dtypes = tuple(cls.supported_kv_cache_dtypes)
        for attr in ("latent", "qk_nope_head_dims", "v_head_dims", "max_query_len",
                     "unquantized_on"):
            setattr(self, attr, getattr(cls, f"dcp_{attr}"))
        self.any_interleave = checks.spec_decodes_at_any_interleave(cls)

    def reads(self, kv: str, major: int) -> bool:
        return self.cls.dcp_reads(kv, major)


@pytest.fixture(scope="module")
def limits(tmp_path_factory):
    root = tmp_path_factory.mktemp("limits-of")
    return {name: Limits(name, root) for name in OVERRIDDEN}


# ---------------------------------------------------------------------------
# Generated from each class's limits: (backend, GPU major, the knob moved)

BASE = dict(role="target", interleave=1, k=3, qk_nope=128)
KNOBS = ("inside", "kv-auto", "kv-fp8", "block", "interleave", "draft-block",
         "verify-over", "head-dims")


def knobs_of(limits: Limits, major: int, knob: str) -> tuple[dict, bool]:
    """The setting with ``knob`` moved past ``limits`` where it has one
    (else inside them), and whether the class refuses it on sm``major``0."""
    kv = "auto" if limits.reads("auto", major) else "fp8"
    base = dict(BASE, kv=kv, block=max(limits.kernel_block_sizes))
    knobs, refused = {
        "inside": (base, False),
        "kv-auto": (dict(base, kv="auto"), not limits.reads("auto", major)),
        "kv-fp8": (dict(base, kv="fp8"), not limits.reads("fp8", major)),
        "block": (dict(base, block=min(limits.kernel_block_sizes) // 2), True),
        "interleave": (dict(base, interleave=16), not limits.any_interleave),
        "draft-block": (dict(base, role="draft"), not limits.non_causal),
        "verify-over": (dict(base, k=limits.max_query_len or 7),
                        limits.max_query_len is not None),
        "head-dims": (dict(base, qk_nope=96), limits.qk_nope_head_dims is not None),
    }[knob]
    return knobs, refused or major not in limits.gpu_majors


CASES = [(name, major, knob) for name in OVERRIDDEN if name != "CPU_MLA"
         for major in (9, 10) for knob in KNOBS]


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


@pytest.mark.parametrize("name,major,knob", CASES,
                         ids=[f"{c[0]}-sm{c[1]}0-{c[2]}" for c in CASES])
def test_each_limit_refused_at_start_up_and_by_selection(models, limits, name, major,
                                                         knob):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    knobs, refused = knobs_of(limits[name], major, knob)

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
                "draft block | query tokens per request | interleave with speculation | "
                "latent, head dims |\n|---|---|---|---|---|---|---|---|")


def render_table(limits: dict[str, Limits]) -> str:
    rows = [TABLE_HEADER]
    for name, each in limits.items():
        gpus = ("CPU" if each.fixed_block_size else
                ", ".join(f"sm{m}0" for m in each.gpu_majors)
                if set(each.gpu_majors) != set(checks.GPU_MAJORS) else "any")
        kv = ", ".join(dict.fromkeys(
            "unquantized" if dtype in checks.UNQUANTIZED else "fp8"
            for dtype in each.kv_cache_dtypes))
        if each.unquantized_on:
            kv += " (" + ", ".join(f"sm{m}0" for m in each.unquantized_on) + ": unquantized)"
        pages = ("fixed " if each.fixed_block_size else "multiples of ") + " or ".join(
            map(str, each.kernel_block_sizes))
        dims = "any" if each.latent is None else " + ".join(map(str, each.latent))
        for what, allowed in (("qk_nope", each.qk_nope_head_dims),
                              ("v", each.v_head_dims)):
            if allowed:
                dims += f"; {what} " + "/".join(map(str, allowed))
        rows.append(" | ".join([
            f"| `{name}`", gpus, kv, pages, "yes" if each.non_causal else "no",
            "any" if each.max_query_len is None else f"<= {each.max_query_len}",
            "any" if each.any_interleave else "1",
            dims]) + " |")
    return "\n".join(rows)


def test_readme_table_is_the_classes(limits):
    readme = (REPO / "README.md").read_text()
    table = render_table(limits)
    assert table in readme, "README's backend table:\n" + table
