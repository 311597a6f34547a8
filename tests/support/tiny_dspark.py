# SPDX-License-Identifier: Apache-2.0
"""A tiny random-weight Kimi-K3 DSpark draft for the tiny MLA target.

vLLM 0.32.0 loads a Kimi-K3 DSpark draft (``K3DSparkConfig``, model type
``k3_dspark``, architecture ``K3DSparkModel``) as a separate checkpoint that
shares the target's token embedding and output head. This module writes one
that matches ``tests/support/tiny_mla.py``'s target, locally and deterministically
(seeded ``torch.Generator``, no download):

* same hidden size, vocabulary and MLA latent layout as the target
  (``kv_lora_rank`` 512 + ``qk_rope_head_dim`` 64 = a 576-wide latent row),
  so the draft's KV cache has the target's shape;
* dense MLA layers with non-causal attention over the draft block (vLLM's
  default for a DSpark draft without ``layer_types``),
  ``num_speculative_tokens`` = ``block_size``;
* ``target_layer_ids`` naming which target layers' outputs feed the draft
  (vLLM captures the stream after layer ``i`` for id ``i``), with
  ``num_target_layers`` = ``len(target_layer_ids)``;
* the low-rank Markov head (``markov_w1`` / ``markov_w2``) DSpark adds to the
  draft logits while it samples the block left to right.

The checkpoint holds no ``embed_tokens`` / ``lm_head``: vLLM aliases the
target's after loading the draft.

Usage::

    from tests.support.tiny_mla import build_tiny_mla_checkpoint
    from tests.support.tiny_dspark import build_tiny_dspark_checkpoint
    target = build_tiny_mla_checkpoint("/tmp/tiny-mla")
    draft = build_tiny_dspark_checkpoint("/tmp/tiny-dspark", target)

Also a script: ``python tests/support/tiny_dspark.py TARGET_DIR OUT_DIR``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

# Bump when the construction changes, so cached checkpoints are rebuilt.
TINY_DSPARK_VERSION = 1

# Fields copied from the target: the draft shares its embedding, head and
# latent KV layout.
SHARED_TARGET_FIELDS = (
    "vocab_size", "hidden_size", "kv_lora_rank", "qk_rope_head_dim",
    "qk_nope_head_dim", "v_head_dim", "q_lora_rank", "rms_norm_eps",
    "max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id",
)


def tiny_dspark_config(
    target_config: dict,
    *,
    num_layers: int = 2,
    num_heads: int | None = None,
    block_size: int = 4,
    target_layer_ids: list[int] | None = None,
    markov_rank: int = 32,
    noise_token_id: int | None = None,
) -> dict:
    """config.json fields of a DSpark draft matching ``target_config``.

    Args:
        target_config: the target's config.json as a dict.
        num_layers: draft decoder layers (dense MLA, non-causal).
        num_heads: draft attention heads (default: the target's).
        block_size: tokens drafted per pass (= ``num_speculative_tokens``).
        target_layer_ids: zero-based target layers whose outputs the draft
            reads (default: every target layer).
        markov_rank: rank of the Markov transition head.
        noise_token_id: id filling the block's non-anchor slots (default:
            the target's pad token).
    """
    num_target = target_config["num_hidden_layers"]
    if target_layer_ids is None:
        target_layer_ids = list(range(num_target))
    if not target_layer_ids or not all(0 <= i < num_target
                                       for i in target_layer_ids):
        raise ValueError(
            f"target_layer_ids {target_layer_ids} must be non-empty ids of "
            f"the target's {num_target} layers")
    if target_config.get("q_lora_rank") is None:
        raise ValueError("an MLA DSpark draft needs q_lora_rank")
    shared = {k: target_config[k] for k in SHARED_TARGET_FIELDS}
    hidden = shared["hidden_size"]
    heads = num_heads or target_config["num_attention_heads"]
    if noise_token_id is None:
        noise_token_id = target_config["pad_token_id"]
    return dict(
        architectures=["K3DSparkModel"],
        model_type="k3_dspark",
        **shared,
        draft_vocab_size=shared["vocab_size"],
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        intermediate_size=2 * hidden,
        hidden_act="silu",
        first_k_dense_replace=num_layers,
        n_routed_experts=0,
        n_shared_experts=0,
        num_experts_per_tok=0,
        rope_theta=10000.0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        # DSpark: the draft reads these target layers' outputs ...
        target_hidden_size=hidden,
        target_layer_ids=list(target_layer_ids),
        num_target_layers=len(target_layer_ids),
        # ... and drafts a block with non-causal attention over it.
        # No ``is_causal`` / ``layer_types``: vLLM then treats every draft
        # layer as non-causal (``dflash_has_any_non_causal``), while an
        # explicit ``is_causal: false`` would switch the draft off MLA.
        block_size=block_size,
        sample_from_anchor=True,
        dspark_noise_token_id=noise_token_id,
        markov_rank=markov_rank,
        enable_confidence_head=False,
        mla_use_nope=False,
        mla_use_output_gate=False,
        mla_use_qk_norm=False,
        num_nextn_predict_layers=0,
        torch_dtype="float32",
    )


def tiny_dspark_weight_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor names (HF layout, before vLLM's mapper) -> shapes."""
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    q_lora = config["q_lora_rank"]
    kv_lora = config["kv_lora_rank"]
    rope = config["qk_rope_head_dim"]
    nope = config["qk_nope_head_dim"]
    v_dim = config["v_head_dim"]
    inter = config["intermediate_size"]
    vocab = config["vocab_size"]
    rank = config["markov_rank"]
    shapes: dict[str, tuple[int, ...]] = {
        "context_proj.weight":
            (hidden, config["target_hidden_size"] * config["num_target_layers"]),
        "context_norm.weight": (hidden,),
        "final_norm.weight": (hidden,),
        "markov_head.markov_w1.weight": (vocab, rank),
        "markov_head.markov_w2.weight": (config["draft_vocab_size"], rank),
    }
    for i in range(config["num_hidden_layers"]):
        layer = f"layers.{i}"
        shapes.update({
            f"{layer}.input_layernorm.weight": (hidden,),
            f"{layer}.post_attention_layernorm.weight": (hidden,),
            f"{layer}.self_attn.q_a_proj.weight": (q_lora, hidden),
            f"{layer}.self_attn.q_a_layernorm.weight": (q_lora,),
            f"{layer}.self_attn.q_b_proj.weight": (heads * (nope + rope), q_lora),
            f"{layer}.self_attn.kv_a_proj_with_mqa.weight":
                (kv_lora + rope, hidden),
            f"{layer}.self_attn.kv_a_layernorm.weight": (kv_lora,),
            f"{layer}.self_attn.kv_b_proj.weight": (heads * (nope + v_dim), kv_lora),
            f"{layer}.self_attn.o_proj.weight": (hidden, heads * v_dim),
            f"{layer}.mlp.gate_proj.weight": (inter, hidden),
            f"{layer}.mlp.up_proj.weight": (inter, hidden),
            f"{layer}.mlp.down_proj.weight": (hidden, inter),
        })
    return shapes


def tiny_dspark_weights(config: dict, seed: int, init_std: float,
                        markov_successors: dict[int, int] | None = None,
                        markov_gain: float = 20.0) -> dict[str, torch.Tensor]:
    """Seeded float32 weights: norms 1, matrices ~ N(0, init_std^2 * 256/fan_in).

    With ``markov_successors`` (prev token -> next token) the Markov head is
    set, not drawn: its bias adds ``markov_gain`` to the logit of
    ``markov_successors[prev]`` after ``prev`` and nothing elsewhere (rank =
    vocabulary: ``markov_w1`` one-hot rows, ``markov_w2[next]`` the one-hot
    rows of every ``prev`` it follows), so the draft proposes the target's
    usual successor and its acceptance rate is far from chance.
    """
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in sorted(tiny_dspark_weight_shapes(config).items()):
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape)
            continue
        std = init_std
        if "markov_w1" not in name:  # an embedding table has no fan-in
            std = init_std * (256 / shape[1]) ** 0.5
        weights[name] = torch.randn(shape, generator=gen) * std
    if markov_successors is not None:
        vocab, rank = config["vocab_size"], config["markov_rank"]
        if rank != vocab:
            raise ValueError("a set Markov head needs markov_rank == vocab_size")
        scale = markov_gain ** 0.5
        w1 = torch.zeros(vocab, rank)
        w2 = torch.zeros(vocab, rank)
        for prev, nxt in markov_successors.items():
            w1[prev, prev] = scale
            w2[nxt, prev] = scale
        weights["markov_head.markov_w1.weight"] = w1
        weights["markov_head.markov_w2.weight"] = w2
    return weights


def bigram_successors(sequences: list[list[int]]) -> dict[int, int]:
    """Each token's most frequent successor in ``sequences`` (ties: lowest id)."""
    counts: dict[int, dict[int, int]] = {}
    for seq in sequences:
        for prev, nxt in zip(seq, seq[1:]):
            row = counts.setdefault(prev, {})
            row[nxt] = row.get(nxt, 0) + 1
    return {prev: min(row, key=lambda t: (-row[t], t))
            for prev, row in sorted(counts.items())}


def build_tiny_dspark_checkpoint(
    path: str | os.PathLike,
    target_path: str | os.PathLike,
    *,
    num_layers: int = 2,
    block_size: int = 4,
    target_layer_ids: list[int] | None = None,
    markov_rank: int = 32,
    markov_successors: dict[int, int] | None = None,
    markov_gain: float = 20.0,
    seed: int = 1,
    init_std: float = 0.08,
    overwrite: bool = False,
) -> Path:
    """Write a tiny K3 DSpark draft checkpoint (float32) for ``target_path``.

    Deterministic for a given set of arguments, target config and torch
    version; reuses an existing checkpoint built with the same arguments
    unless ``overwrite``. The target's tokenizer files are copied so the
    draft directory is a self-contained HF checkpoint. ``markov_successors``
    (e.g. ``bigram_successors`` of the target's own greedy outputs) sets the
    Markov head instead of drawing it (``markov_rank`` becomes the vocabulary
    size; see ``tiny_dspark_weights``).

    Returns:
        ``Path(path)``.
    """
    import shutil

    from safetensors.torch import save_file

    path, target_path = Path(path), Path(target_path)
    target_config = json.loads((target_path / "config.json").read_text())
    if markov_successors is not None:
        markov_successors = {int(k): int(v) for k, v in markov_successors.items()}
        markov_rank = target_config["vocab_size"]
    config = tiny_dspark_config(
        target_config, num_layers=num_layers, block_size=block_size,
        target_layer_ids=target_layer_ids, markov_rank=markov_rank)
    stamp = dict(version=TINY_DSPARK_VERSION, seed=seed, init_std=init_std,
                 config=config, markov_gain=markov_gain,
                 markov_successors=([[k, v] for k, v in sorted(markov_successors.items())]
                                    if markov_successors is not None else None))
    stamp_file = path / "tiny_dspark.json"
    if (not overwrite and stamp_file.exists()
            and json.loads(stamp_file.read_text()) == stamp):
        return path
    path.mkdir(parents=True, exist_ok=True)
    save_file(tiny_dspark_weights(config, seed, init_std, markov_successors,
                                  markov_gain),
              str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2,
                                                 sort_keys=True))
    for name in ("tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json"):
        if (target_path / name).exists():
            shutil.copyfile(target_path / name, path / name)
    stamp_file.write_text(json.dumps(stamp, sort_keys=True))
    return path


def build_config_only_pair(root: str | os.PathLike) -> tuple[Path, Path]:
    """A tiny target holding only its ``config.json`` (``tiny_mla_config``)
    and a tiny DSpark draft for it under ``root``: enough for vLLM to build
    its config with DSpark, not to load the target.

    Returns:
        ``(target_dir, draft_dir)``.
    """
    from tests.support.tiny_mla import tiny_mla_config

    target = Path(root) / "target"
    target.mkdir(parents=True, exist_ok=True)
    (target / "config.json").write_text(json.dumps(tiny_mla_config(num_heads=8)))
    return target, build_tiny_dspark_checkpoint(Path(root) / "draft", target)


def check_draft_loads(target_path: str | os.PathLike,
                      draft_path: str | os.PathLike) -> dict:
    """Build vLLM's ``K3DSparkForCausalLM`` on CPU and load the draft into it.

    Model Runner V2 (which DSpark needs) does not run on CPU, so the engine
    config is built without speculation and the validated DSpark
    ``SpeculativeConfig`` attached afterwards; then the draft model class is
    instantiated in a one-rank gloo group and its ``load_weights`` fed the
    checkpoint. Initialises torch.distributed: run it in its own process.

    Returns:
        ``{"params": [...], "loaded": [...], "missing": [...],
        "unexpected": [...], "context_kv_stacked": bool,
        "fused_qkv_a_stacked": bool, "markov_argmax": [...],
        "markov_max": [...]}``: the two booleans say whether the fused
        projections hold the checkpoint's per-layer tensors; the lists are,
        for each previous token id, the id vLLM's Markov bias favours most
        and that bias.
    """
    import tempfile

    from safetensors.torch import load_file
    from vllm.config import SpeculativeConfig, set_current_vllm_config
    from vllm.distributed import (init_distributed_environment,
                                  initialize_model_parallel)
    from vllm.engine.arg_utils import EngineArgs
    from vllm.models.kimi_k3.nvidia.dspark_mla import K3DSparkForCausalLM

    vllm_config = EngineArgs(model=str(target_path), dtype="float32",
                             max_model_len=512,
                             enforce_eager=True).create_engine_config()
    vllm_config.speculative_config = SpeculativeConfig(
        method="dspark", model=str(draft_path),
        target_model_config=vllm_config.model_config,
        target_parallel_config=vllm_config.parallel_config)
    weights = load_file(str(Path(draft_path) / "model.safetensors"))
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(
            world_size=1, rank=0, local_rank=0, backend="gloo",
            distributed_init_method=f"file://{tempfile.mktemp()}")
        initialize_model_parallel(1, 1)
        torch.set_default_dtype(torch.float32)
        model = K3DSparkForCausalLM(vllm_config=vllm_config)
        loaded = model.load_weights(iter(weights.items()))
        model.process_weights_after_loading()
        # Ready the Markov head's CPU GEMM as vLLM's loader would.
        markov_w2 = model.model.markov_head.markov_w2
        markov_w2.quant_method.process_weights_after_loading(markov_w2)
        with torch.no_grad():
            vocab = torch.arange(model.config.vocab_size)
            bias = model.markov_bias(model.markov_embed(vocab))
    params = {name for name, _ in model.named_parameters()}
    inner = model.model
    kv_a = [weights[f"layers.{i}.self_attn.kv_a_proj_with_mqa.weight"]
            for i in range(len(inner.layers))]
    q_a = [weights[f"layers.{i}.self_attn.q_a_proj.weight"]
           for i in range(len(inner.layers))]
    return dict(
        params=sorted(params),
        loaded=sorted(loaded),
        missing=sorted(params - loaded),
        unexpected=sorted(loaded - params),
        context_kv_stacked=bool(torch.equal(inner.context_kv_proj.weight,
                                            torch.cat(kv_a))),
        fused_qkv_a_stacked=all(
            torch.equal(layer.self_attn.fused_qkv_a_proj.weight,
                        torch.cat([q, kv]))
            for layer, q, kv in zip(inner.layers, q_a, kv_a)),
        markov_argmax=bias.argmax(dim=-1).tolist(),
        markov_max=bias.max(dim=-1).values.tolist(),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target_dir", help="tiny MLA target (tests/support/tiny_mla.py)")
    parser.add_argument("out_dir")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--block-size", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--markov-from", help="JSON list of token-id lists "
                        "(e.g. the target's greedy outputs): set the Markov "
                        "head to their bigram successors")
    parser.add_argument("--check-load", action="store_true",
                        help="only load OUT_DIR into vLLM's draft class on "
                             "CPU and print the result as JSON")
    args = parser.parse_args()
    if args.check_load:
        print(json.dumps(check_draft_loads(args.target_dir, args.out_dir)),
              flush=True)
        return
    successors = None
    if args.markov_from:
        successors = bigram_successors(json.loads(Path(args.markov_from).read_text()))
    print(build_tiny_dspark_checkpoint(
        args.out_dir, args.target_dir, num_layers=args.layers,
        block_size=args.block_size, seed=args.seed,
        markov_successors=successors, overwrite=True))


if __name__ == "__main__":
    main()
