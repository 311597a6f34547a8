# SPDX-License-Identifier: Apache-2.0
"""The start-up check against vLLM's own start, row by row, over a generated
matrix of ``vllm serve -tp 8 -dcp 8`` variants with a DSpark draft.

The matrix (``VARIANTS``): sm90 and sm100; a bf16 or fp8 KV cache; the
interleave 1 to 256; ``--block-size`` given (64, 256) or not; the draft's
backend named (FLASHMLA or TOKENSPEED_MLA, FLASHINFER_MLA) or not; 4 or 8
speculative tokens; a tiny Kimi-K3 pair whose KDA state is Kimi-K3's or
Kimi-Linear's size (which changes vLLM's hybrid alignment). Each row is
judged twice: by the plugin's start-up check (``rs.check_on_cuda``), and by
vLLM's own start with that check left out (``rs.start_config``: vLLM's model
classes, its selector per layer, its block-size code, the engine core's KV
set-up and ``validate_block_size``, every metadata builder). They agree when

* accepted: vLLM starts, and no model on TRITON_MLA;
* warned: vLLM starts, a model on TRITON_MLA (a ``--block-size`` was given);
* refused: the error names a flag, and vLLM alone fails, or starts a model
  on TRITON_MLA where the refusal's ``--block-size N`` starts every model on
  a fast DCP backend; a ``--block-size N`` the refusal names is checked to
  pass the check and start.

CI runs ``SAMPLED`` rows, a different sample per ``VLLM_DCP_MATRIX_SEED``;
``VLLM_DCP_MATRIX_ROWS=all`` runs every row (docs/testing.md).
"""

from __future__ import annotations

import itertools
import json
import os
import random
import re
import shlex
from unittest import mock

import pytest

from tests.support import recipe_start as rs
from tools import serve_dcp_dspark as serve

FALLBACK = "TRITON_MLA"
SM100_PREFILL = serve.SM100_FP8_PREFILL_ATTENTION_CONFIG
KIMI_LINEAR_KDA = rs.PairShape(kda_heads=32, kda_head_dim=128)
SHAPES = {"k3-kda": rs.TINY, "kimi-linear-kda": KIMI_LINEAR_KDA}
NAMED_DRAFT = {9: ("FLASHMLA", "FLASHINFER_MLA"), 10: ("TOKENSPEED_MLA", "FLASHINFER_MLA")}
# A flag (or --speculative-config field) a refusal names for the user to change.
FLAG = re.compile(r"--[a-z][a-z-]+|attention_backend in --speculative-config|"
                  r'"kv_cache_dtype"')


def _variants():
    for major, kv, interleave, block, named, k, shape in itertools.product(
            (9, 10), ("auto", "fp8"), (1, 16, 64, 128, 256), (None, 64, 256),
            (None, 0, 1), (4, 8), sorted(SHAPES)):
        draft_backend = None if named is None else NAMED_DRAFT[major][named]
        row_id = (f"sm{major}0-{kv}-i{interleave}-bs{block or 'auto'}-"
                  f"{draft_backend or 'vllm'}-k{k}-{shape}")
        yield row_id, major, kv, interleave, block, draft_backend, k, shape


VARIANTS = list(_variants())
SAMPLED = 10


def _rows():
    if os.environ.get("VLLM_DCP_MATRIX_ROWS") == "all":
        return VARIANTS
    seed = int(os.environ.get("VLLM_DCP_MATRIX_SEED", "0"))
    return random.Random(seed).sample(VARIANTS, SAMPLED)


def _argv(major, kv, interleave, block, draft_backend, k) -> list[str]:
    spec = {"method": "dspark", "model": "draft", "num_speculative_tokens": k}
    if draft_backend:
        spec["attention_backend"] = draft_backend
    flags = f"-tp 8 -dcp 8 --cp-kv-cache-interleave-size {interleave}"
    if kv == "fp8":
        flags += " --kv-cache-dtype fp8"
    if kv == "fp8" and major == 10:  # Kimi-K3's prefill over an fp8 cache there
        flags += f" --attention-config '{SM100_PREFILL}'"
    if block:
        flags += f" --block-size {block}"
    return shlex.split(flags) + ["--speculative-config", json.dumps(spec)]


def _check(argv, major, shape, root):
    """The plugin's verdict: ("accept" | "warn" | "refuse", message)."""
    from vllm.v1.attention.backends.mla import dcp_startup_checks

    config = rs.recipe_config(argv, root, major=major, shape=shape)
    warnings: list[str] = []
    with mock.patch.object(dcp_startup_checks.logger, "warning_once",
                           lambda message, *args, **kwargs: warnings.append(message)):
        try:
            rs.check_on_cuda(config, major)
        except ValueError as refusal:
            return "refuse", str(refusal)
    return ("warn", warnings[0]) if warnings else ("accept", None)


def _vllm_alone(argv, major, shape, root):
    """vLLM's own start, the plugin's start-up check left out: the backends
    of (target, draft), or the error it fails with."""
    from vllm.v1.attention.backends.mla import dcp_startup_checks

    config = rs.recipe_config(argv, root, major=major, shape=shape)
    with mock.patch.object(dcp_startup_checks, "check_vllm_config",
                           lambda config: None):
        try:
            start = rs.start_config(config, major)
        except (ValueError, AssertionError, RuntimeError, NotImplementedError) as error:
            return None, error
    return (start.role(False)[0], start.role(True)[0]), None


def _with_block_size(argv, block_size):
    argv = list(argv)
    if "--block-size" in argv:
        argv[argv.index("--block-size") + 1] = str(block_size)
        return argv
    return argv + ["--block-size", str(block_size)]


@pytest.mark.parametrize("row", _rows(), ids=lambda row: row[0])
def test_check_agrees_with_vllms_own_start(tmp_path, row):
    row_id, major, kv, interleave, block, draft_backend, k, shape_name = row
    shape = SHAPES[shape_name]
    argv = _argv(major, kv, interleave, block, draft_backend, k)
    decision, message = _check(argv, major, shape, tmp_path / "check")
    backends, error = _vllm_alone(argv, major, shape, tmp_path / "alone")
    seen = f"check: {decision} {message}\nvLLM alone: {backends} {error!r}"
    if decision == "accept":
        assert backends is not None and FALLBACK not in backends, seen
        return
    if decision == "warn":
        assert block is not None and backends is not None and FALLBACK in backends, seen
        return
    assert FLAG.search(message), seen
    fix = re.search(r"Pass --block-size (\d+)", message)
    assert backends is None or (FALLBACK in backends and fix), seen
    if fix:
        fixed = _with_block_size(argv, int(fix.group(1)))
        assert _check(fixed, major, shape, tmp_path / "fixed")[0] == "accept", seen
        fixed_backends, fixed_error = _vllm_alone(fixed, major, shape,
                                                  tmp_path / "fixed-alone")
        assert fixed_backends is not None and FALLBACK not in fixed_backends, (
            f"{seen}\nwith --block-size {fix.group(1)}: {fixed_backends} "
            f"{fixed_error!r}")


def test_the_matrix_spans_every_dimension():
    """Every value of every dimension is in the matrix, and the sample is
    drawn from it."""
    assert len(VARIANTS) == 2 * 2 * 5 * 3 * 3 * 2 * 2
    for column, values in ((1, {9, 10}), (2, {"auto", "fp8"}),
                           (3, {1, 16, 64, 128, 256}), (4, {None, 64, 256}),
                           (7, set(SHAPES))):
        assert {row[column] for row in VARIANTS} == values
    assert set(_rows()) <= set(VARIANTS)
