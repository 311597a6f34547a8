# SPDX-License-Identifier: Apache-2.0
"""``dcp_vllm_touches``, the list of every change the plugin makes to vLLM,
against the installed vLLM (0.32 or 0.34):

* every target is there (or absent on the vLLMs its entry says, or skipped
  with a reason), every install function imports, and ``dcp_compat`` binds
  what its entries read;
* the list is complete: in a fresh process, every vLLM attribute that
  loading the plugins rebinds or adds is a listed target, and every listed
  replacement that reports installed did change its target (with
  ``VLLM_DCP_CPU_MRV2`` off and on); a GPU process never imports the CPU
  rotary fix;
* each touch is logged, installed or skipped with its reason.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import subprocess
import sys
import types
from pathlib import Path
from unittest import mock

import pytest

from vllm.v1.attention.backends.mla import dcp_vllm_touches as touches

VLLM_SIDE_EFFECTS = {"vllm.plugins.plugins_loaded"}  # load_general_plugins' own


def _probe(mode: str, stdin: str = "") -> dict:
    """``_load_plugins_and_report`` in a fresh process."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("VLLM_DCP_CPU_MRV2", "TRITON_INTERPRET")}
    if mode.startswith("cpu_mrv2"):
        env["VLLM_DCP_CPU_MRV2"] = "1"
    proc = subprocess.run([sys.executable, __file__, mode], env=env, input=stdin,
                          capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).parent)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(lines[-1])


@pytest.fixture(scope="module")
def plugins_loaded_on_cpu() -> dict:
    """A fresh CPU process's vLLM modules after loading the plugins, and
    its target problems (resolving the K3 targets imports numba, which
    vLLM's kernel dispatcher cannot scan, so not in this process)."""
    return _probe("cpu:modules")


def _vllm_has(specifier: str) -> bool:
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    import vllm

    release = ".".join(map(str, Version(vllm.__version__).release))
    return release in SpecifierSet(specifier)


def _target_problem(touch) -> str | None:
    """What is wrong with ``touch``'s target on this vLLM (None: nothing)."""
    found = touches.present(touch.target, touch.change)
    if touch.vllm_versions is not None and found != _vllm_has(touch.vllm_versions):
        return f"{touch.target} is{'' if found else ' not'} here, unlike the " \
               f"vLLMs {touch.vllm_versions} its entry names"
    if not found and touch.fallback is not None and not touches.present(
            touch.fallback):
        return f"neither {touch.target} nor {touch.fallback} is here"
    if not found and touch.vllm_versions is None and not touch.applies():
        return f"{touch.target} is not here, and nothing says why it is skipped"
    if touch.install is not None:
        try:
            touches.installer(touch)
        except Exception as error:
            return f"install function {touch.install}: {error!r}"
    return None


def test_every_target_is_in_this_vllm_or_skipped_with_a_reason(plugins_loaded_on_cpu):
    problems = plugins_loaded_on_cpu["target_problems"]
    assert problems == {}, "\n".join(f"{k}: {v}" for k, v in problems.items())


def test_touches_are_named_once_and_installed_by_someone():
    names = [t.name for t in touches.TOUCHES]
    assert len(names) == len(set(names))
    assert {t.installed_by for t in touches.TOUCHES} == {
        touches.PLUGIN, touches.CPU_MRV2, touches.INTERPRETER_START,
        touches.METADATA_BUILDERS, touches.NOBODY}
    for touch in touches.TOUCHES:
        assert (touch.install is None) == (touch.installed_by == touches.NOBODY)
        assert (touch.change == touches.READS) == (touch.installed_by == touches.NOBODY)


def test_dcp_compat_binds_what_its_reads_list():
    from vllm.v1.attention.backends.mla import dcp_compat

    reads = [t for t in touches.TOUCHES if t.name in dcp_compat.__all__]
    assert reads
    for touch in reads:
        path = touch.target if touches.present(touch.target) else touch.fallback
        assert getattr(dcp_compat, touch.name) is touches.locate(path), touch.name


# ---------------------------------------------------------------------------
# Logged: each touch, once per install, installed or skipped with a reason.

@pytest.fixture
def vllms_own_backends_after():
    from vllm.v1.attention.backends.registry import (
        AttentionBackendEnum,
        register_backend,
    )

    members = [AttentionBackendEnum[name] for name, _ in touches.BACKEND_OVERRIDES]
    before = {m: m.get_path() if m.is_overridden() else None for m in members}
    yield
    for member, path in before.items():
        member.clear_override()
        if path is not None:
            register_backend(member, path)


def _touch_log(caplog, touch) -> list[logging.LogRecord]:
    prefix = f"vllm-dcp-dspark: {touch.name} "
    return [r for r in caplog.records if r.name == touches.__name__
            and r.getMessage().startswith(prefix)]


PLUGIN_LOGGERS = ("vllm.v1.attention.backends.mla.", "vllm.v1.worker.cpu.",
                  "vllm.model_executor.layers.rotary_embedding.cpu_multihead_rope_fix")


def test_register_logs_each_touch_installed_or_skipped(caplog,
                                                       vllms_own_backends_after):
    from vllm.v1.attention.backends.mla import dcp_plugin

    with caplog.at_level(logging.DEBUG, logger=touches.__name__):
        dcp_plugin.register()
        dcp_plugin.register()  # idempotent: the same outcome again
    # The plugin's own modules warn of nothing (vLLM's may, e.g. the 0.34
    # CUDA wheel's CPU platform on a missing vllm._C).
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING
                and r.name.startswith(PLUGIN_LOGGERS)]
    for touch in touches.TOUCHES:
        if touch.installed_by != touches.PLUGIN:
            assert _touch_log(caplog, touch) == []
            continue
        first, second = _touch_log(caplog, touch)
        assert first.getMessage() == second.getMessage()
        outcome = first.getMessage().split(" ", 2)[2]
        if outcome.startswith("installed"):
            assert first.levelno == logging.DEBUG
        else:
            reason = outcome.removeprefix("skipped: ")
            assert reason != outcome and reason, outcome
            # Info where this vLLM lacks the target or does not need it;
            # debug where the touch is not for this platform or setting.
            applies = touch.applies() is None
            assert first.levelno == (logging.INFO if applies else logging.DEBUG)
    assert "installed" in _touch_log(caplog, touches.TOUCHES[0])[0].getMessage()


def test_cpu_mrv2_entry_point_switched_off_logs_each_touch_skipped(caplog,
                                                                   monkeypatch):
    from vllm.v1.worker.cpu import dcp_mrv2_overrides

    monkeypatch.delenv("VLLM_DCP_CPU_MRV2", raising=False)
    with caplog.at_level(logging.DEBUG, logger=touches.__name__):
        dcp_mrv2_overrides.register()
    for touch in touches.TOUCHES:
        if touch.installed_by == touches.CPU_MRV2:
            (record,) = _touch_log(caplog, touch)
            assert record.getMessage().endswith("skipped: VLLM_DCP_CPU_MRV2 is off")
            assert record.levelno == logging.DEBUG


# ---------------------------------------------------------------------------
# Complete: what loading the plugins changes in vLLM, in a fresh process.

@pytest.mark.parametrize("mode", ["cpu", "cpu_mrv2"])
def test_every_change_to_vllm_is_listed(mode, plugins_loaded_on_cpu):
    """The plugins loaded in a fresh process, every vLLM module they import
    already imported (found by a first run)."""
    first = plugins_loaded_on_cpu if mode == "cpu" else _probe(f"{mode}:modules")
    facts = _probe(f"{mode}:diff", json.dumps(first["modules"]))
    assert facts["warnings"] == []
    assert facts["unlisted"] == [], (
        "loading the plugins changed vLLM where dcp_vllm_touches lists nothing")
    assert facts["installed_unchanged"] == [], (
        "listed as installed, yet its target kept vLLM's object")
    # The run saw the plugin's own changes.
    assert facts["installed"]["dcp_startup_checks"]
    assert facts["installed"]["cpu_mrv2_workspace"] == (mode == "cpu_mrv2")


def test_gpu_process_never_imports_the_cpu_rotary_fix():
    facts = _probe("gpu:")
    assert facts["rope_fix_imported"] is False
    assert not any(v for k, v in facts["installed"].items() if k.startswith("cpu_"))


def _where(path: str):
    """(holder, attribute) where ``path``'s last attribute lives now."""
    owner_path, attr = path.rsplit(".", 1)
    owner = touches.locate(owner_path)
    if isinstance(owner, types.ModuleType) or attr in getattr(owner, "__dict__", {}):
        return owner, attr
    cls = owner if isinstance(owner, type) else type(owner)
    holder = next((c for c in cls.__mro__ if attr in vars(c)), cls)
    return holder, attr


_ABSENT = object()


def _raw(path: str):
    try:
        holder, attr = _where(path)
    except Exception:
        return _ABSENT
    return vars(holder).get(attr, _ABSENT) if hasattr(holder, "__dict__") else _ABSENT


def _state(touch):
    """What ``touch`` changes: whether its target is there (``ADDS``), else
    the object its target's holder binds."""
    if touch.change == touches.ADDS:
        return touches.present(touch.target)
    return _raw(touch.target)


def _snapshot() -> dict:
    """(id(holder), attribute) -> (name, holder, value) for every attribute
    of a loaded vllm module, of the classes it defines and of its other
    vLLM objects."""
    seen = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("vllm") or module is None:
            continue
        for attr, value in list(vars(module).items()):
            seen[(id(module), attr)] = (f"{name}.{attr}", module, value)
            defined_here = isinstance(value, type) and value.__module__ == name
            vllm_object = (not isinstance(value, (type, types.ModuleType,
                                                  types.FunctionType))
                           and type(value).__module__.startswith("vllm"))
            if not (defined_here or vllm_object):
                continue
            try:
                members = dict(vars(value))
            except TypeError:
                continue
            for member, member_value in members.items():
                seen[(id(value), member)] = (f"{name}.{attr}.{member}", value,
                                             member_value)
    return seen


def _changed(before: dict, after: dict) -> list:
    """Keys of ``after`` bound to another object than in ``before``, or new
    on a holder ``before`` has (a newly imported submodule aside)."""
    holders = {id(holder) for _, holder, _ in before.values()}
    changed = []
    for key, (_, holder, value) in after.items():
        if key in before:
            if before[key][2] is not value:
                changed.append(key)
        elif id(holder) in holders and not isinstance(value, types.ModuleType):
            changed.append(key)
    return changed


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


def _load_plugins_and_report(mode: str, step: str) -> dict:
    """What loading vLLM's general plugins does in this process.

    ``modules``: the vLLM modules loaded afterwards, and then each touch's
    target problems (``_target_problem``). ``diff`` (those modules,
    as JSON on stdin, imported first): the vLLM attributes rebound or added
    that no touch lists, the listed replacements that report installed yet
    kept vLLM's object, each touch's outcome and the plugin's warnings.
    ``gpu:`` (the platform answering not-CPU): whether the CPU rotary fix
    was imported.
    """
    from vllm.platforms import current_platform
    from vllm.plugins import load_general_plugins
    from vllm.v1.attention.backends.mla import dcp_plugin

    records = _Records()
    for name in (touches.__name__, dcp_plugin.__name__):
        logging.getLogger(name).addHandler(records)
    logging.getLogger(touches.__name__).setLevel(logging.DEBUG)
    current_platform.is_cpu()
    if step == "modules":
        load_general_plugins()
        modules = sorted(name for name in sys.modules if name.startswith("vllm"))
        return {"modules": modules,
                "target_problems": {t.name: problem for t in touches.TOUCHES
                                    if (problem := _target_problem(t))}}
    if mode == "gpu":
        with mock.patch.object(type(current_platform), "is_cpu", lambda self: False):
            load_general_plugins()
        rope = "vllm.model_executor.layers.rotary_embedding.cpu_multihead_rope_fix"
        return {"rope_fix_imported": rope in sys.modules,
                "installed": _outcomes(records)}
    for name in json.loads(sys.stdin.read()):
        try:
            importlib.import_module(name)
        except Exception:
            pass
    before = _snapshot()
    targets = [t for t in touches.TOUCHES if t.change != touches.READS]
    by_name = {t.name: t for t in targets}
    # Only what applies here: resolving the others imports modules the
    # plugins would not (K3's pull in numba, which vLLM's kernel dispatcher
    # cannot scan).
    state_before = {t.name: _state(t) for t in targets if t.applies() is None}
    load_general_plugins()
    after = _snapshot()
    installed = _outcomes(records)
    listed = set()
    for touch in targets:
        try:
            holder, attr = _where(touch.target)
        except Exception:
            continue
        listed.add((id(holder), attr))
    unlisted = sorted(after[key][0] for key in _changed(before, after)
                      if key not in listed and after[key][0] not in VLLM_SIDE_EFFECTS
                      and not after[key][0].endswith(".__warningregistry__"))
    unchanged = sorted(
        name for name, state in state_before.items() if installed.get(name)
        and by_name[name].change in (touches.REPLACES, touches.ADDS)
        and _state(by_name[name]) is state)
    return {"unlisted": unlisted, "installed_unchanged": unchanged,
            "installed": installed,
            "warnings": [r.getMessage() for r in records.records
                         if r.levelno >= logging.WARNING]}


def _outcomes(records: _Records) -> dict[str, bool]:
    """Touch name -> installed, from the registry's log."""
    outcomes = {}
    for record in records.records:
        words = record.getMessage().split()
        if record.name == touches.__name__ and len(words) > 2:
            outcomes[words[1]] = words[2] == "installed"
    return outcomes


if __name__ == "__main__":
    print(json.dumps(_load_plugins_and_report(*sys.argv[1].split(":"))))


# The two wrappers of the platform's config hook: each once, however often
# and in whichever order the plugin's touches are installed.

@pytest.mark.parametrize("order", ["startup_checks_first", "features_first"])
def test_config_hook_wrappers_install_once(order):
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.mla import (
        cpu_mla_prefill_context,
        dcp_startup_checks,
    )

    calls = []

    def stock(cls, vllm_config) -> None:
        """vLLM's hook, stood in."""
        calls.append("stock")

    installs = [dcp_startup_checks.install,
                cpu_mla_prefill_context.install_features_kept_on]
    if order == "features_first":
        installs.reverse()
    platform_cls = type(current_platform)
    with mock.patch.object(platform_cls, "check_and_update_config",
                           classmethod(stock)), \
            mock.patch.object(dcp_startup_checks, "check_vllm_config",
                              lambda config: calls.append("checks")), \
            mock.patch.object(cpu_mla_prefill_context, "keep_features_on",
                              lambda config, before: calls.append("features")):
        for install in installs + installs:
            install()
        platform_cls.check_and_update_config(mock.MagicMock())
        assert sorted(calls) == ["checks", "features", "stock"]
        assert dcp_startup_checks.hook_installed(
            platform_cls, dcp_startup_checks._MARK)
        assert dcp_startup_checks.hook_installed(
            platform_cls, cpu_mla_prefill_context._MARK)
    assert not dcp_startup_checks.hook_installed(
        platform_cls, "_no_such_mark")
