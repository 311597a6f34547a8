# SPDX-License-Identifier: Apache-2.0
"""Run what ``vllm serve`` runs on its flags before it starts an engine, and
start nothing.

vLLM's CLI parser and serve-argument checks, then
``AsyncEngineArgs.create_engine_config``: vLLM's config classes and the
platform's ``check_and_update_config``, where the plugin's start-up check
asks vLLM's own selector and block-size code whether DCP can serve the
setting. A command vLLM refuses prints vLLM's error and exits 2::

    python tools/vllm_serve_check.py MODEL -tp 8 -dcp 8 --speculative-config '{...}'

The flags are those after ``vllm serve``. ``tools/serve_dcp_dspark.py``
runs this in the server's environment on the command it is about to start,
so that vLLM, not the launcher, judges its flags.
"""

from __future__ import annotations

import sys

REFUSED = 2  # exit status of a command vLLM refuses
REFUSED_MARK = "vllm serve refuses these flags:"  # vLLM's error follows


def engine_args(argv: list[str]):
    """``vllm serve ARGV`` as vLLM's CLI reads it: its ``AsyncEngineArgs``.

    Raises ``SystemExit`` (vLLM's parser has printed why) on flags that do
    not parse, ``ValueError`` on serve arguments vLLM refuses.
    """
    try:
        from vllm.entrypoints.launchers.cli_args import (
            make_arg_parser, validate_parsed_serve_args)
    except ImportError:  # vLLM 0.34
        from vllm.entrypoints.common.cli_args import (
            make_arg_parser, validate_parsed_serve_args)
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parsed = make_arg_parser(FlexibleArgumentParser(prog="vllm serve")).parse_args(argv)
    if parsed.model_tag is not None:
        parsed.model = parsed.model_tag
    validate_parsed_serve_args(parsed)
    return AsyncEngineArgs.from_cli_args(parsed)


def refusal(argv: list[str]) -> str | None:
    """vLLM's error for ``vllm serve ARGV`` before any engine starts, or
    None where vLLM (and the plugin's start-up check) accepts it."""
    from vllm.usage.usage_lib import UsageContext

    try:
        engine_args(argv).create_engine_config(UsageContext.OPENAI_API_SERVER)
    except (ValueError, TypeError, NotImplementedError, OSError) as error:
        return f"{type(error).__name__}: {error}"
    return None


def main(argv: list[str] | None = None) -> int:
    found = refusal(list(sys.argv[1:] if argv is None else argv))
    if found is None:
        return 0
    print(f"{REFUSED_MARK}\n{found}", file=sys.stderr)
    return REFUSED


if __name__ == "__main__":
    sys.exit(main())
