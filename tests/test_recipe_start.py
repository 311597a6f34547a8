# SPDX-License-Identifier: Apache-2.0
"""Every recipe starts as vLLM starts it (``tests/support/recipe_start.py``).

For every ``vllm serve`` command of the README's "Production recipe" and
every command the launcher (``tools/serve_dcp_dspark.py``) generates for
sm90 bf16, sm90 fp8 and sm100 fp8, at ``-dcp 8`` and ``-dcp 1``, the draft's
backend named and not, interleave 1 and 16: vLLM's config from the exact
flags, the plugin's start-up checks, vLLM's model classes for a tiny Kimi-K3
target (KDA and MLA layers) and its K3 DSpark draft (each layer selecting its
backend with its own KV dtype, the selector answering as sm90 / sm100),
vLLM's KV-cache grouping, every group's metadata builder and the CUDA-graph
modes. At ``-dcp 8`` each layer runs the backend and KV dtype expected (the
README states them beside each recipe), the plugin's settings read the KV
dtype each layer was built with, and the target and the draft keep full
decode CUDA graphs; at ``-dcp 1`` everything is vLLM's own, also at
Kimi-K3's shape for the README's recipes (the same start without the
plugin, CUDA-graph modes and prefix caching included: where vLLM refuses a
recipe's named backend at DCP 1, e.g. FLASHINFER_MLA for a Hopper draft, it
refuses it with the plugin too).
A config the start-up checks accept starts; one they refuse, naming a flag,
would fail at model load.

At Kimi-K3's shape (``rs.K3_LIKE``: ``KimiK3ForConditionalGeneration`` with
its vision tower, 12 target layers KDA and MLA 3:1, a two-layer draft),
where vLLM's hybrid grouping puts target and draft MLA layers in one
KV-cache group: user variants (interleave 1/16/64, with and without
``--block-size``, a draft ``kv_cache_dtype``, k 3/4/7/8, a backend named or
not, sm90 and sm100, prefix caching on as vLLM leaves it and off) start on
the fast path with full decode CUDA graphs, and every layer's forwards are
built with its own model's setting. vLLM's ``check_attention_cp_compatibility``
is seen refusing an impl without the capabilities it asks for.
"""

from __future__ import annotations

import json
import re
import shlex
from unittest import mock
from pathlib import Path

import pytest

from tests.support import recipe_start as rs
from tools import serve_dcp_dspark as serve

REPO = Path(__file__).resolve().parents[1]
RECIPE_SECTION = "## Production recipe"
DTYPE_WORDS = {"bf16": ("auto", "bfloat16"), "fp8": ("fp8", "fp8_e4m3")}


# ---------------------------------------------------------------------------
# Expected layers

def assert_layers(start: rs.RecipeStart, target: tuple[str, str],
                  draft: tuple[str, str]) -> None:
    """Every target MLA layer runs ``target`` (backend, bf16 | fp8), every
    draft layer ``draft``, the target's KDA layers their own group's builder;
    the plugin's settings read the dtypes the layers hold."""
    assert start.state_layers and all(
        builder is not None for _, builder in start.state_layers.values())
    for role, (backend, word) in ((False, target), (True, draft)):
        got_backend, got_dtype = start.role(role)
        assert (got_backend, got_dtype in DTYPE_WORDS[word]) == (backend, True), (
            f"{'draft' if role else 'target'}: {got_backend} {got_dtype}, "
            f"expected {backend} {word}")
    assert_settings_read_the_layers(start)


def assert_settings_read_the_layers(start: rs.RecipeStart) -> None:
    """``DCPSetting`` (start-up checks, selection checks, builders) holds the
    KV dtype vLLM's layer classes were built with, per model."""
    from vllm.v1.attention.backends.mla.dcp_settings import model_kv_cache_dtype

    for draft in (False, True):
        _, layer_dtype = start.role(draft)
        setting_dtype = model_kv_cache_dtype(start.vllm_config, draft)
        assert setting_dtype == layer_dtype, (
            f"{'draft' if draft else 'target'}: the settings read {setting_dtype}, "
            f"vLLM built the layers with {layer_dtype}")


def assert_full_decode_graphs(start: rs.RecipeStart) -> None:
    """vLLM's CUDA-graph resolution keeps the mode a GPU asks for by
    default (FULL_AND_PIECEWISE: full graphs for uniform decode batches,
    the target's verify of 1 + k included) and the DSpark speculator
    captures its draft blocks in full graphs (FULL_DECODE_ONLY): every
    attention group, the DCP backends' included, supports uniform batches."""
    from vllm.config.compilation import CUDAGraphMode

    assert start.cudagraph_requested == CUDAGraphMode.FULL_AND_PIECEWISE
    runner, draft = start.cudagraph_support
    assert start.cudagraph_modes == (CUDAGraphMode.FULL_AND_PIECEWISE,
                                     CUDAGraphMode.FULL_DECODE_ONLY), (
        f"runner {start.cudagraph_modes[0]} ({runner}), draft "
        f"{start.cudagraph_modes[1]} ({draft})")


def _start_or_refusal(argv, major: int, root: Path, **kwargs):
    try:
        return rs.start_recipe(argv, major, root, **kwargs)
    except ValueError as error:
        return str(error)


def assert_upstream_at_dcp1(argv, major: int, root: Path, **kwargs) -> None:
    """At ``-dcp 1`` the recipe starts, or is refused, as without the plugin:
    per layer the same backend and KV dtype, and a builder that is vLLM's or
    a subclass of it (the plugin's overrides run vLLM's code at DCP 1); the
    same block sizes, prefix caching, CUDA-graph support and modes."""
    ours, theirs = (_start_or_refusal(argv, major, root / f"plugin-{plugin}",
                                      dcp=1, plugin=plugin, **kwargs)
                    for plugin in (True, False))
    if isinstance(theirs, str):
        assert ours == theirs
        return
    assert not isinstance(ours, str), ours
    assert (ours.block_size, ours.kernel_block_sizes) == (
        theirs.block_size, theirs.kernel_block_sizes)
    cache = [(start.vllm_config.cache_config.enable_prefix_caching,
              start.vllm_config.cache_config.mamba_cache_mode)
             for start in (ours, theirs)]
    assert cache[0] == cache[1]
    graphs = [(start.cudagraph_requested, start.cudagraph_modes,
               [info and info.min_cg_support for info in start.cudagraph_support])
              for start in (ours, theirs)]
    assert graphs[0] == graphs[1]
    assert ours.layers.keys() == theirs.layers.keys()
    assert ours.state_layers == theirs.state_layers
    for name, layer in ours.layers.items():
        upstream = theirs.layers[name]
        assert (layer.draft, layer.backend, layer.kv_cache_dtype) == (
            upstream.draft, upstream.backend, upstream.kv_cache_dtype), name
        assert issubclass(layer.builder, upstream.builder), name


# ---------------------------------------------------------------------------
# The README's recipes

RECIPE_COMMENT = re.compile(
    r"^# sm(?P<sm>\d+)0\b.*: target (?P<target>\w+) (?P<target_dtype>bf16|fp8), "
    r"draft (?P<draft>\w+) (?P<draft_dtype>bf16|fp8)$")


def readme_recipes() -> list[dict]:
    """Every ``vllm serve`` command of the README's recipe section, with the
    comment line above it: ``# smNN0 ...: target B dtype, draft B dtype``."""
    text = (REPO / "README.md").read_text()
    section = text[text.index(RECIPE_SECTION):]
    section = section[:section.index("\n## ", len(RECIPE_SECTION))]
    recipes = []
    for block in re.findall(r"```bash\n(.*?)```", section, flags=re.S):
        lines = block.replace("\\\n", " ").splitlines()
        for i, line in enumerate(lines):
            if not line.startswith("vllm serve "):
                continue
            match = RECIPE_COMMENT.match(lines[i - 1] if i else "")
            assert match, f"no '# smNN0 ...: target B dtype, draft B dtype' above {line}"
            recipes.append(dict(
                major=int(match["sm"]), argv=shlex.split(line)[3:],
                target=(match["target"], match["target_dtype"]),
                draft=(match["draft"], match["draft_dtype"]),
                id=f"sm{match['sm']}0-{match['target']}-{match['target_dtype']}"
                   f"-{match['draft']}-{match['draft_dtype']}"))
    return recipes


README_RECIPES = readme_recipes()


def test_readme_recipes_cover_each_generation_and_kv_dtype():
    kinds = {(r["major"], r["target"][1]) for r in README_RECIPES}
    assert {(9, "bf16"), (9, "fp8"), (10, "fp8")} <= kinds
    text = (REPO / "README.md").read_text()
    section = text[text.index(RECIPE_SECTION):]
    section = section[:section.index("\n## ", len(RECIPE_SECTION))]
    assert section.count("vllm serve ") == len(README_RECIPES)


@pytest.mark.parametrize("recipe", README_RECIPES, ids=[r["id"] for r in README_RECIPES])
def test_readme_recipe_starts(tmp_path, recipe):
    args = rs.serve_args(recipe["argv"])
    assert (args.tensor_parallel_size, args.decode_context_parallel_size) == (8, 8)
    assert args.speculative_config["method"] == "dspark"
    start = rs.start_recipe(recipe["argv"], recipe["major"], tmp_path)
    assert_layers(start, recipe["target"], recipe["draft"])
    assert_full_decode_graphs(start)
    for shape in (rs.TINY, rs.K3_LIKE):
        assert_upstream_at_dcp1(recipe["argv"], recipe["major"],
                                tmp_path / f"dcp1-{shape.target}", shape=shape)


# ---------------------------------------------------------------------------
# The launcher's recipes

# (GPU major, --kv-cache-dtype, --draft-attention-backend when named)
GENERATIONS = [(9, None, "FLASHINFER_MLA"), (9, "fp8", "FLASHINFER_MLA"),
               (10, "fp8", "TOKENSPEED_MLA")]


def launcher_expected(major, kv, interleave, draft_backend):
    """(target, draft) layers at -dcp 8 of what the launcher generates."""
    if major == 10:
        return ("FLASHINFER_MLA", "fp8"), (draft_backend or "FLASHINFER_MLA", "fp8")
    target = "FLASH_ATTN_MLA" if interleave == 1 and kv is None else "FLASHMLA"
    word = "fp8" if kv else "bf16"
    if draft_backend == "FLASHINFER_MLA":
        return (target, word), ("FLASHINFER_MLA", "bf16")
    return (target, word), ("FLASHMLA", word)


def launcher_argv(major, kv, interleave, draft_backend, target: Path, draft: Path,
                  dcp: int = 8) -> list[str]:
    """The flags after the model of the launcher's ``vllm serve`` command."""
    argv = ["--model", str(target), "--tp", "8", "--dcp", str(dcp),
            "--draft", str(draft), "--num-spec", "4", "--interleave", str(interleave)]
    if kv:
        argv += ["--kv-cache-dtype", kv]
    if draft_backend:
        argv += ["--draft-attention-backend", draft_backend]
    command = serve.launch_command(serve.build_parser().parse_args(argv), [], major)
    return command[command.index("-tp"):]  # after --host and --port


LAUNCHER_CASES = [(major, kv, interleave, backend)
                  for major, kv, named in GENERATIONS
                  for interleave in (1, 16) for backend in (None, named)]


@pytest.mark.parametrize(
    "major,kv,interleave,draft_backend", LAUNCHER_CASES,
    ids=[f"sm{m}0-{kv or 'bf16'}-i{i}-{b or 'vllm'}" for m, kv, i, b in LAUNCHER_CASES])
def test_launcher_recipe_starts(tmp_path, major, kv, interleave, draft_backend):
    target, draft = rs.write_tiny_k3_pair(tmp_path / "models")
    argv = launcher_argv(major, kv, interleave, draft_backend, target, draft)
    start = rs.start_recipe(argv, major, tmp_path, k3_layer_indices=False)
    assert_layers(start, *launcher_expected(major, kv, interleave, draft_backend))
    assert_full_decode_graphs(start)
    assert_upstream_at_dcp1(launcher_argv(major, kv, interleave, draft_backend,
                                          target, draft, dcp=1),
                            major, tmp_path, k3_layer_indices=False)


# ---------------------------------------------------------------------------
# Start-up checks against model load

def _spec(**fields) -> str:
    return json.dumps({"method": "dspark", "model": "draft",
                       "num_speculative_tokens": 4} | fields)


# Kimi-K3's prefill over an fp8 cache on sm100 (k3_fp8_prefill; the forward's
# agreement with that check is tests/test_recipe_forward.py's).
SM100_PREFILL = serve.SM100_FP8_PREFILL_ATTENTION_CONFIG

# (id, GPU major, flags, None if it starts, else the flag the refusal names)
AGREEMENT_CASES = [
    # The target's FLASHMLA (vLLM's Hopper choice for fp8) under DSpark x DCP.
    ("sm90-fp8", 9, f"-tp 8 -dcp 8 --kv-cache-dtype fp8 --speculative-config '{_spec()}'",
     None),
    # Kimi-K3's draft layers ignore the skip list: they are fp8, which
    # FLASHINFER_MLA does not read on sm90.
    ("sm90-fp8-skip-list", 9,
     "-tp 8 -dcp 8 --kv-cache-dtype fp8 --kv-cache-dtype-skip-layers 61 "
     f"--speculative-config '{_spec(attention_backend='FLASHINFER_MLA')}'",
     '"kv_cache_dtype": "auto"'),
    # ... while vLLM's choice for them, FLASHMLA, reads fp8: it starts, the
    # settings reading fp8 for the draft's layers, as vLLM built them.
    ("sm90-fp8-skip-list-ignored", 9,
     "-tp 8 -dcp 8 --kv-cache-dtype fp8 --kv-cache-dtype-skip-layers 61 "
     f"--speculative-config '{_spec()}'", None),
    # vLLM's per-draft KV dtype.
    ("sm90-fp8-draft-bf16", 9,
     "-tp 8 -dcp 8 --kv-cache-dtype fp8 --block-size 64 --speculative-config "
     f"'{_spec(attention_backend='FLASHINFER_MLA', kv_cache_dtype='auto')}'", None),
    # Interleave 16 with vLLM's choice for the target.
    ("sm90-bf16-i16", 9, "-tp 8 -dcp 8 --cp-kv-cache-interleave-size 16 "
     f"--speculative-config '{_spec()}'", None),
    ("sm90-bf16-i16-flash-attn-named", 9,
     "-tp 8 -dcp 8 --cp-kv-cache-interleave-size 16 --attention-backend "
     f"FLASH_ATTN_MLA --speculative-config '{_spec()}'",
     "--cp-kv-cache-interleave-size"),
    ("sm90-fp8-flash-attn-named", 9,
     "-tp 8 -dcp 8 --kv-cache-dtype fp8 --attention-backend FLASH_ATTN_MLA "
     f"--speculative-config '{_spec()}'", "--kv-cache-dtype"),
    # Tokenspeed decodes at most 8 query tokens: the draft's block of 8 fits,
    # also where vLLM's DSpark loader rebuilds the draft's config in a worker
    # (the start-up checks run on it again, as the draft's).
    ("sm100-tokenspeed-draft-block-8", 10, "-tp 8 -dcp 8 --kv-cache-dtype fp8 "
     f"--attention-config '{SM100_PREFILL}' --speculative-config "
     f"'{_spec(num_speculative_tokens=8, attention_backend='TOKENSPEED_MLA')}'",
     None),
    ("sm100-tokenspeed-target-verify-9", 10, "-tp 8 -dcp 8 --kv-cache-dtype fp8 "
     f"--attention-config '{SM100_PREFILL}' "
     "--attention-backend TOKENSPEED_MLA --speculative-config "
     f"'{_spec(num_speculative_tokens=8)}'", "num_speculative_tokens"),
    # ... also where the draft's layers run Tokenspeed too: at Kimi-K3's
    # shape both models' layers share one builder, which must judge the
    # target's verify of 9, not the draft's block of 8.
    ("sm100-tokenspeed-both-verify-9", 10, "-tp 8 -dcp 8 --kv-cache-dtype fp8 "
     f"--attention-config '{SM100_PREFILL}' "
     "--attention-backend TOKENSPEED_MLA --speculative-config "
     f"'{_spec(num_speculative_tokens=8, attention_backend='TOKENSPEED_MLA')}'",
     "num_speculative_tokens"),
    # Kimi-K3 is hybrid: vLLM aligns its block size to a multiple of 128
    # after selection, but its selector judges the named Tokenspeed (pages
    # by 32 or 64) at --block-size 16 and refuses it.
    ("sm100-tokenspeed-block-16", 10,
     "-tp 8 -dcp 8 --kv-cache-dtype fp8 --block-size 16 "
     f"--attention-config '{SM100_PREFILL}' "
     f"--speculative-config '{_spec(attention_backend='TOKENSPEED_MLA')}'",
     "leave --block-size 16 out"),
    # An interleave past the block size vLLM will use (Kimi-K3's 128, its
    # hybrid alignment), no --block-size and no backend named: the engine
    # core's KV-cache set-up asserts; the block size the refusal names starts.
    ("sm90-bf16-i256", 9, "-tp 8 -dcp 8 --cp-kv-cache-interleave-size 256 "
     f"--speculative-config '{_spec()}'", "Pass --block-size 256"),
    ("sm90-bf16-i256-bs256", 9, "-tp 8 -dcp 8 --cp-kv-cache-interleave-size 256 "
     f"--block-size 256 --speculative-config '{_spec()}'", None),
    ("sm100-fp8-i256", 10, "-tp 8 -dcp 8 --kv-cache-dtype fp8 "
     f"--attention-config '{SM100_PREFILL}' --cp-kv-cache-interleave-size 256 "
     f"--speculative-config '{_spec()}'", "Pass --block-size 256"),
    ("sm100-fp8-i256-bs256", 10, "-tp 8 -dcp 8 --kv-cache-dtype fp8 "
     f"--attention-config '{SM100_PREFILL}' --cp-kv-cache-interleave-size 256 "
     f"--block-size 256 --speculative-config '{_spec()}'", None),
    # FLASH_ATTN_MLA is Hopper's: vLLM's selector refuses it on sm100.
    ("sm100-flash-attn-named", 10, "-tp 8 -dcp 8 --attention-backend FLASH_ATTN_MLA "
     f"--speculative-config '{_spec()}'", "in --attention-backend"),
    # An MLA backend without DSpark x DCP: vLLM's builder refuses it in the
    # workers, after the weights load.
    ("sm100-cutlass-named", 10, "-tp 8 -dcp 8 --kv-cache-dtype fp8 "
     f"--attention-config '{SM100_PREFILL}' --attention-backend CUTLASS_MLA "
     f"--speculative-config '{_spec()}'", "--attention-backend"),
    ("sm100-cutlass-named-draft", 10, "-tp 8 -dcp 8 --kv-cache-dtype fp8 "
     f"--attention-config '{SM100_PREFILL}' "
     f"--speculative-config '{_spec(attention_backend='CUTLASS_MLA')}'",
     "attention_backend in --speculative-config"),
]

# What the workers say for each refused case (vLLM's builders and selector,
# with the plugin's backends' own selection checks), the start-up checks
# left out.
WORKER_REFUSALS = {
    "sm90-fp8-skip-list": "FLASHINFER_MLA on sm90 reads a bf16/fp16 KV cache",
    "sm90-bf16-i16-flash-attn-named":
        "FLASH_ATTN_MLA decodes speculative tokens under decode context "
        "parallelism at --cp-kv-cache-interleave-size 1 only",
    "sm90-fp8-flash-attn-named": "kv_cache_dtype not supported",
    "sm100-tokenspeed-target-verify-9": "decodes at most 8 query tokens per request",
    "sm100-tokenspeed-both-verify-9": "decodes at most 8 query tokens per request",
    "sm100-cutlass-named": "does not support causal multi-token MLA attention for "
                           "DSpark with decode context parallelism",
    "sm100-cutlass-named-draft": "non-causal MLA attention with DCP not supported",
    "sm90-bf16-i256": (AssertionError, "Block_size(128) should be greater than or "
                       "equal to and divisible by cp_kv_cache_interleave_size (256)"),
    "sm100-fp8-i256": (AssertionError, "Block_size(128) should be greater than or "
                       "equal to and divisible by cp_kv_cache_interleave_size (256)"),
    "sm100-flash-attn-named": "compute capability not supported",
    "sm100-tokenspeed-block-16": "block_size not supported",
}


# Also at Kimi-K3's shape, where target and draft MLA layers share a
# KV-cache group (and, with one backend, a builder).
K3_SHAPE_AGREEMENT = ("sm90-fp8", "sm100-tokenspeed-draft-block-8",
                      "sm100-tokenspeed-both-verify-9")
AGREEMENT_RUNS = [(case, rs.TINY) for case in AGREEMENT_CASES] + [
    (case, rs.K3_LIKE) for case in AGREEMENT_CASES if case[0] in K3_SHAPE_AGREEMENT]


@pytest.mark.parametrize(
    "case,shape", AGREEMENT_RUNS,
    ids=[c[0] + ("-k3-shape" if shape == rs.K3_LIKE else "")
         for c, shape in AGREEMENT_RUNS])
def test_start_up_checks_agree_with_model_load(tmp_path, case, shape):
    """Accepted at start-up: it starts. Refused: the error names the flag,
    and the workers would have refused it at model load."""
    from tests.support.cuda_selection import check_as_gpu

    case_id, major, flags, refused_by = case
    config = rs.recipe_config(shlex.split(flags), tmp_path, major=major, shape=shape)
    if refused_by is None:
        check_as_gpu(config, major)
        start = rs.start_config(config, major)
        assert_settings_read_the_layers(start)
        return
    with pytest.raises(ValueError) as refusal:
        check_as_gpu(config, major)
    assert refused_by in str(refusal.value)
    # What vLLM's workers do with it, the plugin's start-up checks left out
    # (vLLM's DSpark loader runs the config hook again on the draft's).
    from vllm.v1.attention.backends.mla import dcp_startup_checks

    refusal = WORKER_REFUSALS[case_id]
    error, text = refusal if isinstance(refusal, tuple) else (ValueError, refusal)
    with mock.patch.object(dcp_startup_checks, "check_vllm_config",
                           lambda config: None), \
            pytest.raises(error, match=re.escape(text)):
        rs.start_config(config, major)


# ---------------------------------------------------------------------------
# Kimi-K3's shape: several KDA and MLA target layers, a multi-layer draft

def assert_each_layer_runs_its_models_setting(start: rs.RecipeStart) -> int:
    """Every MLA layer's forwards are built with its own model's setting:
    a target layer's by the target runner's builder with the target's
    (causal verify of 1 + k, host slack k), a draft layer's by the DSpark
    speculator's builder with the draft's (block of k, slack 2k), also
    where one builder of the target runner serves both models' layers.
    Returns how many layers carry a plugin setting (FLASH_ATTN_MLA's
    builder is vLLM's own and has none)."""
    spec = start.vllm_config.speculative_config
    k = spec.num_speculative_tokens
    checked = 0
    for name, layer in start.layers.items():
        setting = getattr(start.forward_builders[name], "dcp_setting", None)
        if setting is None:
            continue
        expected = (True, k, 2 * k) if layer.draft else (False, 1 + k, k)
        got = (setting.draft, setting.max_decode_query_len,
               setting.host_length_slack)
        assert got == expected, (
            f"{name} ({'draft' if layer.draft else 'target'}): its forwards' "
            f"builder has (draft, query length, host slack) {got}, expected "
            f"{expected}")
        checked += 1
    return checked


def shared_builders(start: rs.RecipeStart) -> set[int]:
    """The target runner's builders that serve target and draft layers."""
    roles: dict[int, set[bool]] = {}
    for name, layer in start.layers.items():
        roles.setdefault(id(start.runner_builders[name]), set()).add(layer.draft)
    return {builder for builder, seen in roles.items() if seen == {False, True}}


# (id, GPU major, flags after the model; k = 4 unless the spec says)
SHARED_GROUP_CASES = [
    ("sm90-fp8-flashmla", 9, "-tp 8 -dcp 8 --kv-cache-dtype fp8 "
     f"--speculative-config '{_spec()}'"),
    ("sm90-bf16-i16-flashmla", 9, "-tp 8 -dcp 8 --cp-kv-cache-interleave-size 16 "
     f"--speculative-config '{_spec()}'"),
    ("sm100-fp8-tokenspeed-both-k7", 10, "-tp 8 -dcp 8 --kv-cache-dtype fp8 "
     f"--attention-config '{SM100_PREFILL}' "
     "--attention-backend TOKENSPEED_MLA --speculative-config "
     f"'{_spec(num_speculative_tokens=7, attention_backend='TOKENSPEED_MLA')}'"),
]


@pytest.mark.parametrize("case", SHARED_GROUP_CASES,
                         ids=[c[0] for c in SHARED_GROUP_CASES])
def test_target_and_draft_layers_in_one_group_keep_their_settings(tmp_path, case):
    """At Kimi-K3's shape vLLM's hybrid grouping puts target and draft MLA
    layers in one KV-cache group, and the target runner makes one builder
    for both: no target layer runs with the draft's setting."""
    _, major, flags = case
    start = rs.start_recipe(shlex.split(flags), major, tmp_path, shape=rs.K3_LIKE)
    assert shared_builders(start), "no builder serves both models' layers"
    assert assert_each_layer_runs_its_models_setting(start) == len(start.layers)


def _k3_spec(k: int, **fields) -> str:
    return _spec(num_speculative_tokens=k, **fields)


# Flags users pass beyond the README's, started at Kimi-K3's shape without the
# start-up checks' help: (id, GPU major, flags after the model, target
# (backend, dtype), draft (backend, dtype)). Every one starts on the fast
# path: vLLM's hybrid alignment pages Kimi-K3 by a multiple of 128 tokens
# (kernel blocks of 64), which every interleave here divides.
USER_VARIANTS = [
    # A draft KV dtype of its own without --block-size: the draft's backend
    # is selected at the block size vLLM will page with, not the provisional
    # 16 its rebuilt cache config passes (vLLM's choice there: TRITON_MLA).
    # A draft KV dtype of its own: vLLM's DSpark loader rebuilds the draft's
    # cache config, its selector then judging the provisional block size
    # (0.32's 16) as given; --block-size 64 keeps the draft on a fast path
    # (without it the start-up check refuses, naming it).
    ("sm90-fp8-draft-dtype-fp8-k3", 9,
     f"-tp 8 -dcp 8 --kv-cache-dtype fp8 --block-size 64 --speculative-config "
     f"'{_k3_spec(3, kv_cache_dtype='fp8')}'", ("FLASHMLA", "fp8"), ("FLASHMLA", "fp8")),
    ("sm90-fp8-draft-dtype-auto", 9,
     f"-tp 8 -dcp 8 --kv-cache-dtype fp8 --block-size 64 --speculative-config "
     f"'{_k3_spec(4, kv_cache_dtype='auto')}'", ("FLASHMLA", "fp8"), ("FLASHMLA", "bf16")),
    ("sm100-fp8-draft-dtype-auto-k7", 10,
     f"-tp 8 -dcp 8 --kv-cache-dtype fp8 --block-size 64 "
     f"--attention-config '{SM100_PREFILL}' "
     "--speculative-config "
     f"'{_k3_spec(7, kv_cache_dtype='auto')}'",
     ("FLASHINFER_MLA", "fp8"), ("FLASHINFER_MLA", "bf16")),
    # Interleave 64 without --block-size: the README's backends.
    ("sm100-fp8-i64-tokenspeed-draft", 10,
     "-tp 8 -dcp 8 --kv-cache-dtype fp8 "
     f"--attention-config '{SM100_PREFILL}' "
     "--cp-kv-cache-interleave-size 64 "
     f"--speculative-config '{_k3_spec(4, attention_backend='TOKENSPEED_MLA')}'",
     ("FLASHINFER_MLA", "fp8"), ("TOKENSPEED_MLA", "fp8")),
    ("sm100-fp8-i64-vllm-picks", 10,
     "-tp 8 -dcp 8 --kv-cache-dtype fp8 "
     f"--attention-config '{SM100_PREFILL}' "
     "--cp-kv-cache-interleave-size 64 "
     f"--speculative-config '{_k3_spec(4)}'",
     ("FLASHINFER_MLA", "fp8"), ("FLASHINFER_MLA", "fp8")),
    ("sm100-fp8-i64-bs64-k8", 10,
     "-tp 8 -dcp 8 --kv-cache-dtype fp8 "
     f"--attention-config '{SM100_PREFILL}' "
     "--cp-kv-cache-interleave-size 64 "
     "--block-size 64 --speculative-config "
     f"'{_k3_spec(8, attention_backend='TOKENSPEED_MLA')}'",
     ("FLASHINFER_MLA", "fp8"), ("TOKENSPEED_MLA", "fp8")),
    ("sm90-fp8-i64-k8", 9,
     "-tp 8 -dcp 8 --kv-cache-dtype fp8 --cp-kv-cache-interleave-size 64 "
     f"--speculative-config '{_k3_spec(8)}'", ("FLASHMLA", "fp8"), ("FLASHMLA", "fp8")),
    ("sm90-bf16-i16-bs64-k3", 9,
     "-tp 8 -dcp 8 --cp-kv-cache-interleave-size 16 --block-size 64 "
     f"--speculative-config '{_k3_spec(3)}'", ("FLASHMLA", "bf16"), ("FLASHMLA", "bf16")),
    ("sm90-bf16-i1-k7", 9, f"-tp 8 -dcp 8 --speculative-config '{_k3_spec(7)}'",
     ("FLASH_ATTN_MLA", "bf16"), ("FLASHMLA", "bf16")),
    ("sm100-fp8-i16-k3", 10, "-tp 8 -dcp 8 --kv-cache-dtype fp8 "
     f"--attention-config '{SM100_PREFILL}' "
     f"--cp-kv-cache-interleave-size 16 --speculative-config '{_k3_spec(3)}'",
     ("FLASHINFER_MLA", "fp8"), ("FLASHINFER_MLA", "fp8")),
    # Prefix caching off: Kimi-K3's KDA state is then one block of
    # max_model_len tokens (no mamba-cache alignment).
    ("sm100-fp8-i64-no-prefix-caching", 10, "-tp 8 -dcp 8 --kv-cache-dtype fp8 "
     f"--attention-config '{SM100_PREFILL}' --no-enable-prefix-caching "
     "--cp-kv-cache-interleave-size 64 "
     f"--speculative-config '{_k3_spec(4, attention_backend='TOKENSPEED_MLA')}'",
     ("FLASHINFER_MLA", "fp8"), ("TOKENSPEED_MLA", "fp8")),
]


@pytest.mark.parametrize("case", USER_VARIANTS, ids=[c[0] for c in USER_VARIANTS])
def test_user_variants_start_on_the_fast_path(tmp_path, case):
    """Each variant passes the start-up checks and starts, every layer on
    the backend expected, with its own model's setting, through the engine
    core's KV-cache plan and its ``validate_block_size``, with full decode
    CUDA graphs; at ``-dcp 1`` it starts as without the plugin."""
    _, major, flags, target, draft = case
    start = rs.start_recipe(shlex.split(flags), major, tmp_path, shape=rs.K3_LIKE)
    assert start.block_size % 128 == 0, start.block_size
    assert_layers(start, target, draft)
    assert assert_each_layer_runs_its_models_setting(start) > 0
    assert_full_decode_graphs(start)
    # Prefix caching as vLLM leaves it on a GPU: on unless the flags say
    # otherwise (a DSpark draft is not a non-causal model for the engine
    # core), Kimi-K3's KDA state then cached in blocks aligned to the
    # attention's ("align").
    cache = start.vllm_config.cache_config
    caching = "--no-enable-prefix-caching" not in flags
    assert (cache.enable_prefix_caching, cache.mamba_cache_mode) == (
        caching, "align" if caching else "none")
    assert_upstream_at_dcp1(shlex.split(flags), major, tmp_path / "dcp1",
                            shape=rs.K3_LIKE)


# ---------------------------------------------------------------------------
# The model runner's check of every layer's impl under DCP

# What vLLM's ``check_attention_cp_compatibility`` asks of each impl, and
# its refusal when an impl does not give it. No backend the plugin serves
# under DCP lacks either (upstream's, which do, are refused earlier: at
# selection, or by their builders under DSpark x DCP), so the check is seen
# refusing FLASHMLA's impl with that capability taken away.
CP_CHECK_CASES = [
    ("supports_mtp_with_cp_non_trivial_interleave_size",
     "MTP with cp_kv_cache_interleave_size > 1 is not supported in FlashMLADCPImpl"),
    ("can_return_lse_for_decode",
     r"\(DCP\) requires attention implementations to return the softmax LSE"),
]


def checks_module():
    from vllm.v1.attention.backends.mla import dcp_config_checks

    return dcp_config_checks


@pytest.mark.parametrize("capability,refusal", CP_CHECK_CASES,
                         ids=[c[0] for c in CP_CHECK_CASES])
def test_vllm_cp_check_reads_every_layer_impl(tmp_path, monkeypatch, capability,
                                              refusal):
    """vLLM's CP check on the impls the layers were built with (target and
    draft, at Kimi-K3's shape) refuses an impl without the capability with
    vLLM's message; the start-up check, asking that same check of vLLM,
    refuses it before load with vLLM's message and the flags to change."""
    from vllm.v1.attention.backends.mla import dcp_startup_checks
    from vllm.v1.attention.backends.mla.flashmla_dcp_mla import FlashMLADCPImpl

    argv = shlex.split("-tp 8 -dcp 8 --cp-kv-cache-interleave-size 16 "
                       f"--speculative-config '{_spec()}'")
    monkeypatch.setattr(FlashMLADCPImpl, capability, False)
    if capability == "supports_mtp_with_cp_non_trivial_interleave_size":
        # The plugin's selection hook reads it too: vLLM's order moves on.
        start = rs.start_recipe(argv, 9, tmp_path / "moved-on", shape=rs.K3_LIKE)
        assert "FLASHMLA" not in start.backends()
        # Without that, FLASHMLA is picked and vLLM's runner refuses it.
        asked = checks_module().spec_decodes_at_any_interleave
        monkeypatch.setattr(checks_module(), "spec_decodes_at_any_interleave",
                            lambda cls: cls.get_name() == "FLASHMLA" or asked(cls))
    with pytest.raises(ValueError, match=refusal) as before_load:
        rs.start_recipe(argv, 9, tmp_path / "checked", shape=rs.K3_LIKE)
    assert "vLLM's model runner refuses FLASHMLA" in str(before_load.value)
    assert "--cp-kv-cache-interleave-size" in str(before_load.value)
    config = rs.recipe_config(argv, tmp_path / "alone", major=9, shape=rs.K3_LIKE)
    with mock.patch.object(dcp_startup_checks, "check_vllm_config",
                           lambda config: None), \
            pytest.raises(AssertionError, match=refusal):
        rs.start_config(config, 9)
