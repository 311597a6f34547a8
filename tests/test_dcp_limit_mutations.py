# SPDX-License-Identifier: Apache-2.0
"""Each DCP limit on a backend class, loosened, lets through a setting that
code which does not read the limit refuses: vLLM's own, or the kernel's.

For each limit in ``SHOWN``: with it in place the start-up check refuses a
setting just past it, naming a flag; with it loosened (the class attribute
set to "no limit") the check accepts that setting, and what the workers run
on it fails, raised outside the plugin's check modules:

* ``TOKENSPEED_MLA.dcp_max_query_len``: Tokenspeed's decode kernel (the
  stand-in bound to ``tokenspeed_mla_decode``'s signature,
  ``kernel_stubs``) in a forward through vLLM's builder and ``forward_mqa``.

(What vLLM's own code answers is no limit of the plugin's: FLASH_ATTN_MLA's
interleave for speculative decoding is its impl's own attribute, which the
start-up check asks vLLM's model runner about.)

``NOT_YET_SHOWN`` names every other limit on the classes and why no CPU test
shows its consequence yet; ``test_every_limit_is_listed`` keeps the two
lists covering every limit, so a new limit comes with its mutation.
"""

from __future__ import annotations

import json
import shlex
import traceback
from pathlib import Path
from unittest import mock

import pytest

from tests.support import recipe_start as rs
from tools import serve_dcp_dspark as serve

LIMIT_ATTRS = ("dcp_latent", "dcp_qk_nope_head_dims", "dcp_v_head_dims",
               "dcp_max_query_len", "dcp_unquantized_on")
# The plugin's modules that read the limits: a consequence raised there would
# be the same record speaking again.
CHECK_MODULES = ("dcp_config_checks.py", "dcp_startup_checks.py", "dcp_settings.py",
                 "dcp_vllm_answer.py")


def _spec(k: int, **fields) -> str:
    return json.dumps({"method": "dspark", "model": "draft",
                       "num_speculative_tokens": k} | fields)


def _tokenspeed_forward(tmp_path):
    """A verify block of 9 tokens through Tokenspeed's builder and
    ``forward_mqa`` on two simulated ranks, the kernel stood in."""
    from tests.test_backend_contracts import Backend, run_steps

    run_steps(tmp_path, Backend("TOKENSPEED_MLA"), [([37, 130], [9, 9], {})],
              world_size=2, interleave=1, causal=True, num_speculative_tokens=8)


# (backend, limit) -> (GPU major, flags after the model, the flag the refusal
# names, the consequence, where it is raised)
SHOWN = {
    ("TOKENSPEED_MLA", "dcp_max_query_len"): (
        10, "-tp 8 -dcp 8 --kv-cache-dtype fp8 --attention-config "
            f"'{serve.SM100_FP8_PREFILL_ATTENTION_CONFIG}' --attention-backend "
            f"TOKENSPEED_MLA --speculative-config '{_spec(8)}'",
        "num_speculative_tokens", _tokenspeed_forward, "kernel_stubs.py"),
}

NOT_YET_SHOWN = {
    ("FLASHINFER_MLA", "dcp_unquantized_on"):
        "sm90's FlashInfer MLA (FA3) reads bf16 only; no CPU stand-in binds that kernel",
    ("FLASHINFER_MLA", "dcp_qk_nope_head_dims"):
        "the head dims of FlashInfer's prefill kernels: GPU-only",
    ("TOKENSPEED_MLA", "dcp_qk_nope_head_dims"):
        "the head dims of Tokenspeed's prefill (fmha): GPU-only",
    ("TOKENSPEED_MLA", "dcp_v_head_dims"):
        "the head dims of Tokenspeed's prefill (fmha): GPU-only",
    ("FLASHINFER_MLA", "dcp_latent"):
        "trtllm-gen's 512 + 64 latent: the stand-in takes the latent it is given",
    ("TOKENSPEED_MLA", "dcp_latent"):
        "Tokenspeed's 512 + 64 latent: its Python checks only rank + rope = D",
    ("CPU_MLA", "dcp_latent"):
        "vLLM's CPU MLA decode: not yet run past the latent",
    ("FLASHMLA", "dcp_latent"):
        "FlashMLA's 576 / 512: vLLM's own head-size hook may already refuse others",
}


def _plugin_class(name: str):
    from tests.test_dcp_backend_limits import _backend_class

    return _backend_class(name)


def _limits_on_classes() -> set[tuple[str, str]]:
    from tests.test_dcp_backend_limits import OVERRIDDEN

    found = set()
    for name in OVERRIDDEN:
        cls = _plugin_class(name)
        for attr in LIMIT_ATTRS:
            if getattr(cls, attr, None) not in (None, ()):
                found.add((name, attr))
    return found


def test_every_limit_is_listed():
    limits = _limits_on_classes()
    assert limits == set(SHOWN) | set(NOT_YET_SHOWN), (
        f"unlisted: {limits - set(SHOWN) - set(NOT_YET_SHOWN)}; "
        f"gone: {(set(SHOWN) | set(NOT_YET_SHOWN)) - limits}")
    assert not set(SHOWN) & set(NOT_YET_SHOWN)


def _verdict(argv, major, root):
    from tests.test_startup_variant_matrix import _check

    return _check(argv, major, rs.TINY, root)


def _raised_in(error: BaseException) -> str:
    return Path(traceback.extract_tb(error.__traceback__)[-1].filename).name


@pytest.mark.parametrize("limit", sorted(SHOWN), ids=lambda limit: ".".join(limit))
def test_loosened_limit_lets_through_what_the_workers_refuse(tmp_path, limit):
    name, attr = limit
    major, flags, flag, consequence, raised_in = SHOWN[limit]
    argv = shlex.split(flags)
    decision, message = _verdict(argv, major, tmp_path / "intact")
    assert decision == "refuse" and flag in message, message
    with mock.patch.object(_plugin_class(name), attr, None):
        decision, message = _verdict(argv, major, tmp_path / "loose")
        assert decision == "accept", message
        with pytest.raises((ValueError, AssertionError)) as failure:
            consequence(tmp_path / "run")
    where = _raised_in(failure.value)
    assert where == raised_in and where not in CHECK_MODULES, (where, failure.value)
