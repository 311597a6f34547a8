# SPDX-License-Identifier: Apache-2.0
"""The tiny DSpark draft checkpoint is one vLLM 0.32.0 accepts.

DSpark needs Model Runner V2 (Triton on a GPU), so on CPU these tests check
everything short of running it: the checkpoint is deterministic, vLLM parses
its config as a ``K3DSparkConfig``, a DSpark ``SpeculativeConfig`` validates
against the tiny target's ``ModelConfig`` (non-causal draft, MLA latent
layout, aux layers), and vLLM's own ``K3DSparkForCausalLM`` built on CPU
loads every one of its parameters from the checkpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.support.tiny_dspark import (bigram_successors, build_tiny_dspark_checkpoint,
                                       tiny_dspark_config, tiny_dspark_weight_shapes)
from tests.support.tiny_mla import build_tiny_mla_checkpoint

TESTS_DIR = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(target dir, draft dir) built once for the module."""
    root = tmp_path_factory.mktemp("tiny_dspark")
    target = build_tiny_mla_checkpoint(root / "target")
    draft = build_tiny_dspark_checkpoint(root / "draft", target)
    return target, draft


# A Markov head set to these successors (the rest of the vocabulary: none).
SUCCESSORS = {5: 9, 9: 5, 100: 7}


def test_bigram_successors():
    assert bigram_successors([[1, 2, 3, 2, 3, 2, 4], [5, 5]]) == {
        1: 2, 2: 3, 3: 2, 5: 5}
    assert bigram_successors([[7, 1, 7, 2]]) == {7: 1, 1: 7}  # tie: lower id


def test_build_is_deterministic(checkpoints, tmp_path):
    target, draft = checkpoints
    again = build_tiny_dspark_checkpoint(tmp_path / "again", target)
    other_seed = build_tiny_dspark_checkpoint(tmp_path / "seed2", target, seed=2)
    first = load_file(str(draft / "model.safetensors"))
    second = load_file(str(again / "model.safetensors"))
    third = load_file(str(other_seed / "model.safetensors"))
    assert first.keys() == second.keys() == third.keys()
    assert all((first[k] == second[k]).all() for k in first)
    assert any(not (first[k] == third[k]).all() for k in first
               if not k.endswith("norm.weight"))
    assert (draft / "config.json").read_text() == (again / "config.json").read_text()


def test_checkpoint_tensors_match_config(checkpoints):
    _, draft = checkpoints
    config = json.loads((draft / "config.json").read_text())
    weights = load_file(str(draft / "model.safetensors"))
    shapes = {name: tuple(t.shape) for name, t in weights.items()}
    assert shapes == tiny_dspark_weight_shapes(config)
    # The target's embedding and head are shared, never shipped.
    assert not any("embed_tokens" in n or "lm_head" in n for n in weights)


def test_draft_shares_target_latent_layout(checkpoints):
    target, draft = checkpoints
    target_cfg = json.loads((target / "config.json").read_text())
    draft_cfg = json.loads((draft / "config.json").read_text())
    for key in ("hidden_size", "vocab_size", "kv_lora_rank",
                "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
        assert draft_cfg[key] == target_cfg[key], key
    assert draft_cfg["kv_lora_rank"] + draft_cfg["qk_rope_head_dim"] == 576
    assert draft_cfg["target_layer_ids"] == list(range(target_cfg["num_hidden_layers"]))
    assert draft_cfg["num_target_layers"] == len(draft_cfg["target_layer_ids"])


def test_config_rejects_bad_target_layers():
    target_cfg = {"num_hidden_layers": 2, "q_lora_rank": 128}
    with pytest.raises(ValueError, match="target_layer_ids"):
        tiny_dspark_config(target_cfg, target_layer_ids=[2])
    with pytest.raises(ValueError, match="target_layer_ids"):
        tiny_dspark_config(target_cfg, target_layer_ids=[])


def test_vllm_parses_k3_dspark_config(checkpoints):
    from vllm.transformers_utils.config import get_config
    from vllm.transformers_utils.configs.k3_dspark import K3DSparkConfig

    _, draft = checkpoints
    config = get_config(str(draft), trust_remote_code=False)
    assert isinstance(config, K3DSparkConfig)
    assert config.target_layer_ids == [0, 1]
    assert config.num_target_layers == 2
    assert config.draft_vocab_size == config.vocab_size == 256
    assert config.n_routed_experts == 0  # dense draft
    # K3DSparkConfig itself refuses a draft without target layers.
    fields = json.loads((draft / "config.json").read_text())
    fields.pop("target_layer_ids")
    with pytest.raises(ValueError, match="target_layer_ids"):
        K3DSparkConfig(**fields)


def test_speculative_config_validates_against_target(checkpoints):
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig
    from vllm.model_executor.models.qwen3_dflash import dflash_has_any_non_causal
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import (
        get_eagle3_aux_layers_from_config)

    target, draft = checkpoints
    target_config = ModelConfig(model=str(target), dtype="float32",
                                max_model_len=512)
    spec = SpeculativeConfig(
        method="dspark", model=str(draft),
        target_model_config=target_config,
        target_parallel_config=ParallelConfig(tensor_parallel_size=1))
    draft_config = spec.draft_model_config
    # vLLM 0.32 records parallel drafting on the config; >= 0.33 leaves the
    # deprecated field None and takes it from the method's speculator config.
    parallel = spec.parallel_drafting
    if parallel is None:
        parallel = spec.speculator_config.parallel_drafting
    assert spec.use_dspark() and parallel is True
    assert draft_config.architectures == ["K3DSparkModel"]
    assert spec.num_speculative_tokens == 4  # the draft's block_size
    assert draft_config.use_mla  # same 576-wide latent cache as the target
    assert draft_config.get_head_size() == target_config.get_head_size() == 576
    assert dflash_has_any_non_causal(draft_config.hf_config)
    # vLLM captures the stream after target layer i as aux layer i + 1.
    assert get_eagle3_aux_layers_from_config(spec) == (1, 2)


def test_vllm_draft_class_loads_every_weight(checkpoints, tmp_path):
    """vLLM's K3DSparkForCausalLM, built on CPU, takes the whole checkpoint,
    and its Markov bias favours exactly the successors the head was set to.

    Runs in a subprocess: it initialises torch.distributed. Plugins are off
    there (VLLM_PLUGINS=""): this checks the checkpoint against stock vLLM,
    not this project's overlay.
    """
    target, _ = checkpoints
    draft = build_tiny_dspark_checkpoint(
        tmp_path / "markov", target, markov_successors=SUCCESSORS,
        markov_gain=20.0)
    env = dict(os.environ, VLLM_PLUGINS="")
    proc = subprocess.run(
        [sys.executable, str(TESTS_DIR / "support" / "tiny_dspark.py"), str(target),
         str(draft), "--check-load"],
        capture_output=True, text=True, timeout=300, env=env,
        cwd=TESTS_DIR.parent.parent)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["missing"] == [] and result["unexpected"] == []
    assert len(result["params"]) == 26  # 2 layers x 10 + 6 model-level
    assert "model.context_kv_proj.weight" in result["loaded"]
    assert result["context_kv_stacked"] and result["fused_qkv_a_stacked"]
    for prev, nxt in SUCCESSORS.items():
        assert result["markov_argmax"][prev] == nxt
        assert result["markov_max"][prev] == pytest.approx(20.0)
    others = [m for i, m in enumerate(result["markov_max"]) if i not in SUCCESSORS]
    assert max(others) == 0.0  # no bias after any other token
