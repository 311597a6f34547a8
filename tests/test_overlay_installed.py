# SPDX-License-Identifier: Apache-2.0
"""The installed overlay must be this source tree: tests never run old code."""

from __future__ import annotations

from importlib.metadata import distribution, entry_points
from pathlib import Path

import vllm

REPO = Path(__file__).resolve().parents[1]
OVERLAY = sorted(p.relative_to(REPO / "vllm") for p in (REPO / "vllm").rglob("*.py"))


def test_overlay_is_fresh():
    installed_root = Path(vllm.__file__).parent
    stale = [str(rel) for rel in OVERLAY
             if not (installed_root / rel).is_file()
             or (installed_root / rel).read_bytes() != (REPO / "vllm" / rel).read_bytes()]
    assert not stale, (
        f"installed overlay at {installed_root} is stale for {stale}: reinstall "
        "with `pip install --no-deps --no-build-isolation .` (the README's test "
        "command does this)")


def test_overlay_ships_no_init_and_only_its_modules():
    assert not list((REPO / "vllm").rglob("__init__.py")), (
        "an __init__.py in the overlay would overwrite vLLM's own")
    files = [f for f in distribution("vllm-dcp-dspark").files or []
             if str(f).startswith("vllm/") and str(f).endswith(".py")]
    assert sorted(Path(str(f)).relative_to("vllm") for f in files) == OVERLAY


def test_plugin_entry_point_loads():
    (plugin,) = [ep for ep in entry_points(group="vllm.general_plugins")
                 if ep.name == "dcp_dspark"]
    plugin.load()()
