# SPDX-License-Identifier: Apache-2.0
"""``vllm-dcp-simulate``: instant ``--help``, vLLM's own input rules, the worst case named."""

from __future__ import annotations

import re
import subprocess
import sys
from unittest import mock

import pytest

from tools import dcp_simulate

SMALL = ["--seq-lens", "70", "17", "3", "--world-sizes", "1", "2", "--interleaves",
         "1", "16", "--heads", "2", "--block-size", "16", "--verify-len", "3",
         "--draft-len", "4"]


def test_help_imports_neither_vllm_nor_torch(tmp_path):
    """The installed console script's entry answers --help before any heavy import."""
    probe = (
        "import sys\n"
        "from importlib.metadata import entry_points\n"
        "(script,) = entry_points(group='console_scripts', name='vllm-dcp-simulate')\n"
        "try:\n"
        "    script.load()(['--help'])\n"
        "except SystemExit as exit:\n"
        "    assert exit.code == 0, exit.code\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'vllm', 'torch'}))\n")
    # cwd outside the checkout: the installed package, not tools/ or a build's egg-info
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True,
                            text=True, timeout=120, check=True, cwd=tmp_path)
    assert "(default: [1, 2, 4, 8])" in result.stdout  # defaults are shown
    assert "(default: 64)" in result.stdout
    assert result.stdout.strip().splitlines()[-1] == "[]"


# (arguments, text the argparse error must contain)
BAD_INPUT = [
    (["--world-sizes", "0"], "argument --world-sizes: 0 is below 1"),
    (["--world-sizes", "2", "-1"], "argument --world-sizes: -1 is below 1"),
    (["--verify-len", "0"], "argument --verify-len: 0 is below 1"),
    (["--draft-len", "0"], "argument --draft-len: 0 is below 1"),
    (["--heads", "0"], "argument --heads: 0 is below 1"),
    (["--seq-lens", "5", "0"], "argument --seq-lens: 0 is below 1"),
    (["--block-size", "0"], "argument --block-size: 0 is below 1"),
    (["--interleaves", "0"], "argument --interleaves: 0 is below 1"),
    (["--seed", "-1"], "argument --seed: -1 is below 0"),
    (["--verify-len", "x"], "argument --verify-len: 'x' is not an integer"),
    # vLLM refuses interleaves that do not divide the block size
    (["--interleaves", "48"], "--interleaves: 48 does not divide --block-size 64"),
    (["--interleaves", "1", "128"], "--interleaves: 128 does not divide"),
    (["--interleaves", "16", "--block-size", "24"], "16 does not divide --block-size 24"),
]


@pytest.mark.parametrize("argv,message", BAD_INPUT,
                         ids=[" ".join(a) for a, _ in BAD_INPUT])
def test_bad_input_is_an_argparse_error(argv, message, capsys):
    with pytest.raises(SystemExit) as exit:
        dcp_simulate.parse_args(argv)
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert "vllm-dcp-simulate: error: " in err and message in err
    assert "Traceback" not in err


@pytest.mark.parametrize("argv", [[], ["--interleaves", "1", "2", "32", "64"],
                                  ["--block-size", "48", "--interleaves", "3", "16"]])
def test_inputs_vllm_accepts_pass(argv):
    args = dcp_simulate.parse_args(argv)
    assert all(args.block_size % i == 0 for i in args.interleaves)


def last_line(capsys) -> str:
    return capsys.readouterr().out.strip().splitlines()[-1]


def test_last_line_names_the_worst_case(capsys):
    assert dcp_simulate.main(SMALL) == 0
    line = last_line(capsys)
    assert re.fullmatch(r"worst error vs full attention without DCP: \S+ at "
                        r"(verify q_len=3|draft q_len=4) W=[12] I=(1|16) "
                        r"\(OK, fp32 tolerance 1e-4\)", line), line


@pytest.mark.parametrize("poison", [1e-3, float("nan")])
def test_a_wrong_case_is_named_and_fails(capsys, poison):
    """Break one case's merged output: the run fails and names exactly it."""
    real_step = dcp_simulate.dcp_step

    def step(*args, layout, causal, **kwargs):
        out, lse = real_step(*args, layout=layout, causal=causal, **kwargs)
        if (layout.world_size, layout.interleave, causal) == (2, 16, False):
            out = out.clone()
            out[-1, 0, 0] += poison
        return out, lse

    with mock.patch.object(dcp_simulate, "dcp_step", step):
        assert dcp_simulate.main(SMALL) == 1
    line = last_line(capsys)
    assert line.endswith("at draft q_len=4 W=2 I=16 (FAIL, fp32 tolerance 1e-4)"), line
