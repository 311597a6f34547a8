# SPDX-License-Identifier: Apache-2.0
"""Console entry of ``vllm-dcp-simulate``: answer ``--help`` and bad input at once.

Importing anything under ``vllm.`` runs vLLM's package ``__init__`` (torch
and its compiler stack: seconds to tens of seconds). This shim loads the
simulator's file on its own, lets it parse and check the arguments, and only
then imports it the ordinary way to run.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

_SIMULATE = Path(__file__).resolve().parent / "vllm/v1/attention/ops/dcp_simulate.py"


def main(argv: list[str] | None = None) -> int:
    spec = importlib.util.spec_from_file_location("_dcp_simulate_args", _SIMULATE)
    standalone = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(standalone)  # stdlib imports only at its top
    args = standalone.parse_args(argv)

    from vllm.v1.attention.ops.dcp_simulate import run

    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
