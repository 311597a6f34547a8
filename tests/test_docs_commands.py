# SPDX-License-Identifier: Apache-2.0
"""Every command in README.md and docs/*.md runs as written.

Each fenced ``bash`` line (and each inline code span that starts with a
command: ``pip``, ``bash``, ``python``, ``lm_eval``) is checked by what
would run it, without running anything long:

* ``vllm serve``: vLLM's own ``vllm serve`` parser, its serve-argument
  validation and ``AsyncEngineArgs.from_cli_args`` (the JSON configs);
* ``python -m tools.serve_dcp_dspark``: the launcher's parser, then the
  ``vllm serve`` command it generates (on sm90 and sm100, or ``--cpu``)
  through vLLM's parser as above, and its ``--then`` command as a command;
* ``python -m MODULE`` / ``python SCRIPT.py``: the module's or script's own
  argparse parser on the arguments given (the run stops once they parse);
* ``vllm-dcp-simulate``: its parser (the console script must be installed);
* ``lm_eval``: lm-eval's own CLI parser;
* ``pip install`` / ``pip uninstall``: pip's own parser, and every extra of
  this project named exists in ``pyproject.toml``;
* ``bash SCRIPT``: the script exists; ``gpu/device_run.sh``'s steps are its
  own; ``.ci/test``'s test paths exist.

A command of any other kind fails the test until it gets a check here.
Also: the errors the README's "Known limits" quotes are still the code's,
every ``VLLM_DCP_*`` switch the code reads is in the README's switches
table, and every relative link of the docs resolves.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import re
import runpy
import shlex
import sys
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
BASE_URL = "http://127.0.0.1:8000/v1"
INLINE_COMMANDS = re.compile(r"^(pip|bash|python3?|lm_eval|lm-eval) ")


# ---------------------------------------------------------------------------
# Extraction

def _strip_fences(text: str) -> str:
    return re.sub(r"```.*?```", "", text, flags=re.S)


def doc_commands() -> list[tuple[str, str]]:
    """(where, command line) for every fenced bash line and every inline
    code span that starts with a command (a span holding a ``<placeholder>``
    is a template, not a command)."""
    found = []
    for path in DOCS:
        text = path.read_text()
        name = path.relative_to(REPO).as_posix()
        for block in re.finditer(r"```bash\n(.*?)```", text, flags=re.S):
            first = text.count("\n", 0, block.start()) + 2
            lines = block.group(1).replace("\\\n", " ").splitlines()
            for offset, line in enumerate(lines):
                if line.strip() and not line.lstrip().startswith("#"):
                    found.append((f"{name}:{first + offset}", line.strip()))
        for span in re.findall(r"(?<!`)`([^`]+)`(?!`)", _strip_fences(text)):
            span = " ".join(span.split())
            if INLINE_COMMANDS.match(span) and not re.search(r"<[^>]+>", span):
                found.append((f"{name}: `{span}`", span))
    return found


COMMANDS = doc_commands()


# ---------------------------------------------------------------------------
# Parse only: run a module's main until its argparse parser returns

class _Parsed(Exception):
    pass


_depth = threading.local()


def _stop_after(original):
    def parse(self, *args, **kwargs):
        if getattr(_depth, "n", 0):  # a subparser, or parse_args' own call
            return original(self, *args, **kwargs)
        _depth.n = 1
        try:
            result = original(self, *args, **kwargs)
        finally:
            _depth.n = 0
        raise _Parsed(result)
    return parse


@contextlib.contextmanager
def _argv(argv: list[str]):
    saved = sys.argv
    sys.argv = list(argv)
    try:
        yield
    finally:
        sys.argv = saved


def parse_only(run, argv: list[str], what: str) -> None:
    """Run ``run()`` (a ``runpy`` call) with ``sys.argv = argv`` until the
    first argparse parser returns; an argument error fails, naming it."""
    err = io.StringIO()
    with (pytest.MonkeyPatch.context() as mp, _argv(argv),
          contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO())):
        for method in ("parse_args", "parse_known_args"):
            mp.setattr(argparse.ArgumentParser, method,
                       _stop_after(getattr(argparse.ArgumentParser, method)))
        try:
            run()
        except _Parsed:
            return
        except SystemExit as exit:
            if exit.code in (0, None):  # --help
                return
            pytest.fail(f"{what}: its arguments do not parse:\n{err.getvalue()}")
    pytest.fail(f"{what} ran without parsing arguments: give it a check here")


# ---------------------------------------------------------------------------
# The checks, per command

def check_vllm_serve(args: list[str]) -> None:
    """``vllm serve ARGS`` as vLLM's CLI reads them."""
    from tools.vllm_serve_check import engine_args

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            engine_args(args)
    except SystemExit:
        pytest.fail(f"vllm serve {shlex.join(args)}:\n{err.getvalue()}")


def check_launcher(args: list[str]) -> None:
    """The launcher's flags, the ``vllm serve`` it writes, its ``--then``."""
    from tools import serve_dcp_dspark as serve

    extra: list[str] = []
    if "--" in args:
        cut = args.index("--")
        args, extra = args[:cut], args[cut + 1:]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parsed = serve.build_parser().parse_args(args)
    except SystemExit:
        pytest.fail(f"tools.serve_dcp_dspark {shlex.join(args)}:\n{err.getvalue()}")
    for major in ((None,) if parsed.cpu else (9, 10)):
        command = serve.launch_command(parsed, extra, major)
        module = command[command.index("-m") + 1]
        served = command[command.index(module) + 1:]
        if served[:1] == ["serve"]:
            served = served[1:]
        check_vllm_serve(served)
    if parsed.then:
        check_command([a.replace("{base_url}", BASE_URL) for a in parsed.then])


def check_python(args: list[str]) -> None:
    if args[:1] == ["-m"]:
        module, rest = args[1], args[2:]
        if module == "tools.serve_dcp_dspark":
            return check_launcher(rest)
        assert (REPO / module.replace(".", "/")).with_suffix(".py").exists() or \
            module.split(".")[0] in ("vllm", "lm_eval", "pytest"), module
        return parse_only(lambda: runpy.run_module(module, run_name="__main__",
                                                   alter_sys=True),
                          [module, *rest], f"python -m {module}")
    script = REPO / args[0]
    assert script.is_file(), f"{args[0]} does not exist"
    parse_only(lambda: runpy.run_path(str(script), run_name="__main__"),
               [str(script), *args[1:]], args[0])


def check_simulator(args: list[str]) -> None:
    assert (Path(sys.executable).parent / "vllm-dcp-simulate").exists(), (
        "the console script vllm-dcp-simulate is not installed")
    from tools import dcp_simulate

    parse_only(lambda: dcp_simulate.parse_args(args), ["vllm-dcp-simulate", *args],
               "vllm-dcp-simulate")


def check_lm_eval(args: list[str]) -> None:
    harness = pytest.importorskip("lm_eval._cli.harness")
    cli = harness.HarnessCLI()
    parse_only(cli.parse_args, ["lm_eval", *args], "lm_eval")


def _project_extras() -> set[str]:
    text = (REPO / "pyproject.toml").read_text()
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    return set(re.findall(r"^([\w-]+)\s*=", section, flags=re.M))


def check_pip(args: list[str]) -> None:
    import setuptools  # noqa: F401  (first: pip imports distutils, vLLM setuptools)
    from pip._internal.commands import create_command

    assert args and args[0] in ("install", "uninstall"), args
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            _, targets = create_command(args[0]).parse_args(args[1:])
    except SystemExit:
        pytest.fail(f"pip {shlex.join(args)}:\n{err.getvalue()}")
    assert targets, f"pip {shlex.join(args)} names nothing"
    from packaging.requirements import Requirement

    for target in targets:
        if target == "." or target.startswith(".["):
            extras = set(re.findall(r"[\w-]+", target[1:]))
            assert extras <= _project_extras(), (
                f"{target}: pyproject.toml has no extra {extras - _project_extras()}")
        else:
            Requirement(target)


def check_bash(args: list[str]) -> None:
    script = REPO / args[0]
    assert script.is_file(), f"{args[0]} does not exist"
    rest = args[1:]
    if args[0] == "gpu/device_run.sh":
        steps = set(re.findall(r"^\s+(\w+)\) ", script.read_text(), flags=re.M))
        assert rest and set(rest) <= steps, (
            f"device_run.sh steps {set(rest) - steps} are not among {sorted(steps)}")
    elif args[0].startswith(".ci/test"):
        for arg in rest:
            if arg.startswith("tests") and not arg.startswith("-"):
                assert (REPO / arg.split("::")[0]).exists(), f"{arg} does not exist"
    else:
        assert not rest, f"bash {args[0]} takes no arguments here: {rest}"


def check_command(argv: list[str]) -> None:
    """One command (no ``&&``), leading ``VAR=value`` assignments dropped."""
    while argv and re.match(r"^[A-Z_][A-Z0-9_]*=", argv[0]):
        argv = argv[1:]
    head, args = argv[0], argv[1:]
    if head == "vllm" and args[:1] == ["serve"]:
        check_vllm_serve(args[1:])
    elif Path(head).name in ("python", "python3"):
        check_python(args)
    elif Path(head).name == "vllm-dcp-simulate":
        check_simulator(args)
    elif head in ("lm_eval", "lm-eval"):
        check_lm_eval(args)
    elif head == "pip":
        check_pip(args)
    elif head == "bash":
        check_bash(args)
    else:
        pytest.fail(f"no check for {shlex.join(argv)}: add one to this test")


@pytest.mark.parametrize("line", [c for _, c in COMMANDS], ids=[w for w, _ in COMMANDS])
def test_doc_command_runs_as_written(line):
    argv = shlex.split(line)
    while argv:
        cut = argv.index("&&") if "&&" in argv else len(argv)
        check_command(argv[:cut])
        argv = argv[cut + 1:]


def test_the_docs_have_commands():
    kinds = {shlex.split(c)[0] for _, c in COMMANDS}
    assert {"vllm", "bash", "python", "lm_eval", "pip"} <= kinds, kinds


# ---------------------------------------------------------------------------
# Known limits: the errors quoted are the code's

def _code_strings() -> list[str]:
    """Every string literal of the overlay (an f-string's literal parts, as
    Python joins adjacent literals)."""
    strings = []
    for path in (REPO / "vllm").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                strings.append(node.value)
    return strings


def quoted_errors() -> list[str]:
    text = (REPO / "README.md").read_text()
    section = text.split("\n## Known limits\n", 1)[1].split("\n## ", 1)[0]
    quotes = []
    for row in section.splitlines():
        cells = row.split(" | ")
        if row.startswith("| ") and len(cells) == 2 and not set(cells[1]) <= set("-| "):
            quotes += [span for span in re.findall(r"`([^`]+)`", cells[1])
                       if len(span.split()) >= 3]  # not a flag or a value
    return quotes


def test_known_limits_quote_the_code():
    """Each quoted error, cut at its ``<placeholders>``, is the code's: every
    piece of three words or more is in one of the overlay's string literals."""
    quotes = quoted_errors()
    assert len(quotes) >= 8, quotes
    strings = _code_strings()
    for quote in quotes:
        pieces = [p.strip().strip("'") for p in re.split(r"<[^>]+>", quote)
                  if len(p.split()) >= 3]
        assert pieces, f"nothing to check in {quote!r}"
        for piece in pieces:
            assert any(piece in s for s in strings), (
                f"README's known limits quote {quote!r}: {piece!r} is in no "
                "message of the code")


# ---------------------------------------------------------------------------
# Switches and links

def test_every_switch_is_documented():
    text = (REPO / "README.md").read_text()
    table = text.split("\n## Switches\n", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"^\| `(VLLM_DCP_\w+)` \|", table, flags=re.M))
    read = set()
    for folder in ("vllm", "tools"):
        for path in (REPO / folder).rglob("*.py"):
            read |= set(re.findall(r"(?<![\w])VLLM_DCP_[A-Z0-9_]+", path.read_text()))
    assert read and read <= documented, f"undocumented switches: {read - documented}"


def test_doc_links_resolve():
    for path in DOCS:
        for link in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", path.read_text()):
            if "://" in link:
                continue
            target = (path.parent / link).resolve()
            assert target.exists(), (
                f"{path.relative_to(REPO)} links to {link}, which does not exist")
