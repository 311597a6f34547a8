# SPDX-License-Identifier: Apache-2.0
"""``vllm.general_plugins`` entry point of vllm-dcp-dspark.

vLLM calls ``register()`` in every process (engine core and workers) before
models are built. It overrides vLLM's MLA attention backends with this
project's DCP-aware subclasses through ``register_backend``, so a stock
``vllm serve ... -dcp N`` picks them up with no change on the user's side,
then installs the CPU pieces and the start-up checks: every touch of
``dcp_vllm_touches`` installed by this entry point, each logged.

The plugin loads in every vLLM process of every user who installed it, so it
must never make vLLM worse: on a vLLM whose hooks it does not find it logs one
warning and registers nothing, and no error of its own reaches
``load_general_plugins()``.
"""

from __future__ import annotations

import importlib
import importlib.util

from vllm.logger import init_logger
from vllm.v1.attention.backends.mla.dcp_vllm_touches import (
    BACKEND_OVERRIDES,
    PLUGIN,
    install_touches,
)

logger = init_logger(__name__)

# vLLM modules the overrides subclass or read, by the vLLM attribute they need.
# Checked by name only: importing them here would pull in FlashInfer (which
# queries the GPU) in every process.
UPSTREAM_MODULES: tuple[str, ...] = (
    "vllm.v1.attention.backends.mla.flashinfer_mla",
    "vllm.v1.attention.backends.mla.tokenspeed_mla",
    "vllm.v1.attention.backends.mla.cpu_mla",
    "vllm.v1.attention.backends.mla.triton_mla",
    "vllm.v1.attention.backends.mla.flashmla",
    "vllm.v1.attention.ops.flashmla",
    "vllm.v1.attention.ops.triton_decode_attention",
    "vllm.model_executor.layers.attention.mla_attention",
    "vllm.v1.attention.ops.dcp",
)
REGISTRY_MODULE = "vllm.v1.attention.backends.registry"


def missing_hooks() -> list[str]:
    """What this plugin needs from vLLM and does not find (empty: all there)."""
    missing = []
    try:
        registry = importlib.import_module(REGISTRY_MODULE)
    except ImportError:
        return [f"module {REGISTRY_MODULE}"]
    if not callable(getattr(registry, "register_backend", None)):
        missing.append(f"{REGISTRY_MODULE}.register_backend")
    backends = getattr(registry, "AttentionBackendEnum", None)
    if backends is None:
        missing.append(f"{REGISTRY_MODULE}.AttentionBackendEnum")
    else:
        missing += [f"AttentionBackendEnum.{name}" for name, _ in BACKEND_OVERRIDES
                    if name not in backends.__members__]
    for module in UPSTREAM_MODULES:
        try:
            found = importlib.util.find_spec(module) is not None
        except ImportError:
            found = False
        if not found:
            missing.append(f"module {module}")
    return missing


def _vllm_version() -> str:
    try:
        from vllm import __version__
    except ImportError:
        return "unknown"
    return __version__


def register() -> None:
    """Install the backend overrides and the plugin's other touches on vLLM
    (``dcp_vllm_touches``); safe to call more than once.

    Registers either every override or none: on a vLLM that lacks a hook the
    overrides need, or if registering fails, vLLM keeps its own backends and
    one warning says why.
    """
    left_alone = ", ".join(name for name, _ in BACKEND_OVERRIDES)
    missing = missing_hooks()
    if missing:
        logger.warning(
            "vllm-dcp-dspark does not support vLLM %s (missing: %s); it leaves "
            "vLLM's %s backends and the CPU DCP pieces alone: DCP x DSpark runs "
            "as upstream vLLM does.", _vllm_version(), "; ".join(missing),
            left_alone)
        return
    try:
        install_touches(PLUGIN)
    except Exception as error:  # never fail vLLM's plugin loading
        _unregister()
        logger.warning(
            "vllm-dcp-dspark could not register on vLLM %s (%s: %s); it leaves "
            "vLLM's %s backends alone.", _vllm_version(), type(error).__name__,
            error, left_alone)


def _unregister() -> None:
    """Undo any override a failed ``_register`` left behind."""
    try:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        for name, class_path in BACKEND_OVERRIDES:
            member = AttentionBackendEnum.__members__.get(name)
            if member is not None and member.get_path() == class_path:
                member.clear_override()
    except Exception:  # the registry itself is what failed
        pass
