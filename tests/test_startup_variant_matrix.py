# SPDX-License-Identifier: Apache-2.0
"""The start-up check against vLLM's own start, row by row, over a generated
matrix of ``vllm serve`` variants under DCP.

The matrix (``VARIANTS``): sm90 and sm100; ``-tp 8 -dcp 8`` and ``-tp 2 -dcp
2``; a bf16, fp16 or fp32 model; a bf16 or fp8 KV cache; the interleave 1 to
256; ``--block-size`` given (64, 256) or not; with an fp8 cache,
``--kv-cache-dtype-skip-layers`` naming the draft's layer or every layer, or
none; DSpark (the draft's backend
named: FLASHMLA or TOKENSPEED_MLA, FLASHINFER_MLA; or not) or n-gram
speculation; 4 or 8 speculative tokens; a tiny Kimi-K3 pair whose KDA state
is Kimi-K3's or Kimi-Linear's size (which changes vLLM's hybrid alignment);
on sm90 vLLM's wheel with or without FlashMLA's extension. Each row is
judged twice: by the plugin's start-up check (``rs.check_on_cuda``), and by
vLLM's own start with that check left out (``rs.start_config``: vLLM's model
classes, its selector per layer, its block-size code, the engine core's KV
set-up and ``validate_block_size``, every metadata builder, the model
runner's CP check). They agree when

* accepted: vLLM starts, on TRITON_MLA only where no ``--block-size``
  starts a faster DCP backend (each tried in vLLM alone);
* warned: vLLM starts, a model on TRITON_MLA (a ``--block-size`` was given);
* refused: the error names a flag, and vLLM alone fails, or starts a model
  on TRITON_MLA where the refusal's ``--block-size N`` starts every model on
  a fast DCP backend; a ``--block-size N`` the refusal names is checked to
  pass the check and start.

CI runs ``SAMPLED`` rows (``VLLM_DCP_MATRIX_SEED`` picks them);
``VLLM_DCP_MATRIX_ROWS=N`` runs N, ``all`` every row (docs/testing.md).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
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
# --kv-cache-dtype-skip-layers in Kimi-K3's layer indices (the tiny pair's
# target layers 0 and 1, its draft's 61).
SKIPPED = {"draft": "61", "all": "0 1 61"}
# A flag (or --speculative-config field) a refusal names for the user to change.
FLAG = re.compile(r"--[a-z][a-z-]+|attention_backend in --speculative-config|"
                  r'"kv_cache_dtype"')


@dataclasses.dataclass(frozen=True)
class Row:
    """One ``vllm serve`` variant of the matrix."""

    major: int
    tp: int
    dcp: int
    dtype: str
    kv: str
    interleave: int
    block: int | None
    method: str
    draft_backend: str | None
    k: int
    shape: str
    flashmla: bool
    skip: str | None = None  # --kv-cache-dtype-skip-layers: "draft" or "all" layers

    @property
    def id(self) -> str:
        return (f"sm{self.major}0-tp{self.tp}dcp{self.dcp}-{self.dtype}-{self.kv}-"
                f"i{self.interleave}-bs{self.block or 'auto'}-{self.method}-"
                f"{self.draft_backend or 'vllm'}-k{self.k}-{self.shape}"
                + ("" if self.flashmla else "-no-flashmla")
                + (f"-skip-{self.skip}" if self.skip else ""))

    def argv(self) -> list[str]:
        spec = {"method": self.method, "num_speculative_tokens": self.k}
        if self.method == "ngram":
            spec |= {"prompt_lookup_max": 3, "prompt_lookup_min": 2}
        if self.draft_backend:
            spec["attention_backend"] = self.draft_backend
        flags = (f"-tp {self.tp} -dcp {self.dcp} --dtype {self.dtype} "
                 f"--cp-kv-cache-interleave-size {self.interleave}")
        if self.kv == "fp8":
            flags += " --kv-cache-dtype fp8"
        if self.kv == "fp8" and self.major == 10:  # Kimi-K3's prefill over fp8
            flags += f" --attention-config '{SM100_PREFILL}'"
        if self.block:
            flags += f" --block-size {self.block}"
        if self.skip:  # Kimi-K3's layer indices: the draft's is 61
            flags += " --kv-cache-dtype-skip-layers " + SKIPPED[self.skip]
        return shlex.split(flags) + ["--speculative-config", json.dumps(spec)]


def _variants():
    for (major, (tp, dcp), dtype, kv, interleave, block, method, named, k, shape,
         flashmla) in itertools.product(
            (9, 10), ((8, 8), (2, 2)), ("bfloat16", "float16", "float32"),
            ("auto", "fp8"), (1, 16, 64, 128, 256), (None, 64, 256),
            ("dspark", "ngram"), (None, 0, 1), (4, 8), sorted(SHAPES), (True, False)):
        if (method == "ngram" and named is not None) or (major == 10 and not flashmla):
            continue  # n-gram has no draft; FlashMLA's extension serves sm90 only
        draft_backend = None if named is None else NAMED_DRAFT[major][named]
        for skip in ((None, "draft", "all") if kv == "fp8" else (None,)):
            yield Row(major, tp, dcp, dtype, kv, interleave, block, method,
                      draft_backend, k, shape, flashmla, skip)


VARIANTS = list(_variants())
SAMPLED = 10


def _rows() -> list[Row]:
    wanted = os.environ.get("VLLM_DCP_MATRIX_ROWS", str(SAMPLED))
    if wanted == "all":
        return VARIANTS
    seed = int(os.environ.get("VLLM_DCP_MATRIX_SEED", "0"))
    return random.Random(seed).sample(VARIANTS, int(wanted))


def _check(argv, major, shape, root, *, flashmla: bool = True):
    """The plugin's verdict: ("accept" | "warn" | "refuse", message)."""
    from vllm.v1.attention.backends.mla import dcp_startup_checks

    config = rs.recipe_config(argv, root, major=major, shape=shape)
    warnings: list[str] = []
    with mock.patch.object(dcp_startup_checks.logger, "warning_once",
                           lambda message, *args, **kwargs: warnings.append(message)):
        try:
            rs.check_on_cuda(config, major, flashmla=flashmla)
        except ValueError as refusal:
            return "refuse", str(refusal)
    return ("warn", warnings[0]) if warnings else ("accept", None)


def _vllm_alone(argv, major, shape, root, *, flashmla: bool = True):
    """vLLM's own start, the plugin's start-up check left out: the backends
    of the MLA layers (the target's, then the draft's), or the error it
    fails with."""
    from vllm.v1.attention.backends.mla import dcp_startup_checks

    config = rs.recipe_config(argv, root, major=major, shape=shape)
    with mock.patch.object(dcp_startup_checks, "check_vllm_config",
                           lambda config: None):
        try:
            start = rs.start_config(config, major, flashmla=flashmla)
        except (ValueError, AssertionError, RuntimeError, NotImplementedError) as error:
            return None, error
    return start.backends(), None


def _with_block_size(argv, block_size):
    argv = list(argv)
    if "--block-size" in argv:
        argv[argv.index("--block-size") + 1] = str(block_size)
        return argv
    return argv + ["--block-size", str(block_size)]


@pytest.mark.parametrize("row", _rows(), ids=lambda row: row.id)
def test_check_agrees_with_vllms_own_start(tmp_path, row):
    shape, argv = SHAPES[row.shape], row.argv()
    decision, message = _check(argv, row.major, shape, tmp_path / "check",
                               flashmla=row.flashmla)
    backends, error = _vllm_alone(argv, row.major, shape, tmp_path / "alone",
                                  flashmla=row.flashmla)
    seen = f"check: {decision} {message}\nvLLM alone: {backends} {error!r}"
    if decision == "accept":
        assert backends is not None, seen
        _on_triton_only_where_nothing_faster_starts(row, argv, backends, tmp_path, seen)
        return
    if decision == "warn":
        assert row.block is not None and backends is not None, seen
        assert FALLBACK in backends, seen
        return
    assert FLAG.search(message), seen
    fix = re.search(r"Pass --block-size (\d+)", message)
    assert backends is None or (FALLBACK in backends and fix), seen
    if fix:
        fixed = _with_block_size(argv, int(fix.group(1)))
        verdict = _check(fixed, row.major, shape, tmp_path / "fixed",
                         flashmla=row.flashmla)
        assert verdict[0] == "accept", f"{seen}\nwith the fix: {verdict}"
        fixed_backends, fixed_error = _vllm_alone(fixed, row.major, shape,
                                                  tmp_path / "fixed-alone",
                                                  flashmla=row.flashmla)
        seen += f"\nwith --block-size {fix.group(1)}: {fixed_backends} {fixed_error!r}"
        assert fixed_backends is not None, seen
        _on_triton_only_where_nothing_faster_starts(row, argv, fixed_backends,
                                                    tmp_path, seen)


def _on_triton_only_where_nothing_faster_starts(row, argv, backends, root, seen):
    """A start on TRITON_MLA is right only where no ``--block-size`` starts
    every model on a faster backend in vLLM alone (each one tried)."""
    if FALLBACK not in backends:
        return
    for size in sorted({math.lcm(row.interleave, size) for size in (16, 32, 64, 128, 256)}):
        sized, _ = _vllm_alone(_with_block_size(argv, size), row.major,
                               SHAPES[row.shape], root / f"alone-{size}",
                               flashmla=row.flashmla)
        assert sized is None or FALLBACK in sized, (
            f"{seen}\nwith --block-size {size}: {sized}")


def test_the_matrix_spans_every_dimension():
    """Every value of every dimension is in the matrix, and the sample is
    drawn from it."""
    spans = {field.name: {getattr(row, field.name) for row in VARIANTS}
             for field in dataclasses.fields(Row)}
    assert spans == {
        "major": {9, 10}, "tp": {8, 2}, "dcp": {8, 2},
        "dtype": {"bfloat16", "float16", "float32"}, "kv": {"auto", "fp8"},
        "interleave": {1, 16, 64, 128, 256}, "block": {None, 64, 256},
        "method": {"dspark", "ngram"},
        "draft_backend": {None, "FLASHMLA", "TOKENSPEED_MLA", "FLASHINFER_MLA"},
        "k": {4, 8}, "shape": set(SHAPES), "flashmla": {True, False},
        "skip": {None, "draft", "all"}}
    assert len(set(VARIANTS)) == len(VARIANTS)
    assert set(_rows()) <= set(VARIANTS)
