# SPDX-License-Identifier: Apache-2.0
"""``vllm.general_plugins`` entry point of vllm-dcp-dspark.

vLLM calls ``register()`` in every process (engine core and workers) before
models are built. It overrides vLLM's MLA attention backends with this
project's DCP-aware subclasses through ``register_backend``, so a stock
``vllm serve ... -dcp N`` picks them up with no change on the user's side.
"""

from __future__ import annotations

from vllm.logger import init_logger

logger = init_logger(__name__)

# (backend enum name, class path) pairs this plugin overrides.
BACKEND_OVERRIDES: list[tuple[str, str]] = [
    ("FLASHINFER_MLA",
     "vllm.v1.attention.backends.mla.flashinfer_dcp_mla.FlashInferDCPMLABackend"),
    ("TOKENSPEED_MLA",
     "vllm.v1.attention.backends.mla.tokenspeed_dcp_mla.TokenspeedDCPMLABackend"),
    ("CPU_MLA", "vllm.v1.attention.backends.mla.cpu_dcp_mla.CPUDCPMLABackend"),
]


def register() -> None:
    """Install the backend overrides; safe to call more than once."""
    from vllm.v1.attention.backends.registry import (
        AttentionBackendEnum,
        register_backend,
    )

    from vllm.v1.attention.backends.mla import dcp_startup_checks
    from vllm.v1.attention.backends.mla.cpu_dcp_patches import (
        install_cpu_dcp_patches,
    )

    for name, class_path in BACKEND_OVERRIDES:
        register_backend(AttentionBackendEnum[name], class_path)
    install_cpu_dcp_patches()
    dcp_startup_checks.install()
    logger.debug("vllm-dcp-dspark: registered %d MLA backend overrides",
                 len(BACKEND_OVERRIDES))
