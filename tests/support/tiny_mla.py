# SPDX-License-Identifier: Apache-2.0
"""A tiny random-weight DeepSeek-V3-style MLA checkpoint, built locally.

No download: the weights come from a seeded ``torch.Generator`` and the
tokenizer is a word-level ``tokenizers`` model over made-up words
(``"t4 t17 t200"``). The MLA dimensions are DeepSeek-V3's (latent 512 + rope
64, qk_nope 128, v 128), which the CPU MLA decode kernel requires.

The output head is sharpened (scaled by ``head_gain``) and the other weights
are drawn with a large ``init_std`` so that attention is peaked and each greedy
token wins by a clear logit margin: float32 noise from different TP / DCP
reduction orders cannot flip a token, while a real attention error does.

Usage::

    from tests.support.tiny_mla import build_tiny_mla_checkpoint
    path = build_tiny_mla_checkpoint("/tmp/tiny-mla")

Also a script: ``python tests/support/tiny_mla.py OUT_DIR``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

# Bump when the construction changes, so cached checkpoints are rebuilt.
TINY_MLA_VERSION = 1

NUM_SPECIAL = 4  # <s>, </s>, <unk>, <pad>


def tiny_mla_config(
    *,
    num_layers: int = 2,
    num_heads: int = 4,
    hidden_size: int = 256,
    vocab_size: int = 256,
    q_lora_rank: int | None = 128,
    max_position_embeddings: int = 2048,
) -> dict:
    """config.json fields of the tiny model (a ``DeepseekV3Config``).

    Every layer is dense (``first_k_dense_replace`` = layers), but the MoE
    routing fields are set to what vLLM's loader expects of a DeepSeek-V3
    (``noaux_tc`` + ``sigmoid``).
    """
    return dict(
        architectures=["DeepseekV3ForCausalLM"],
        model_type="deepseek_v3",
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        moe_intermediate_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        n_shared_experts=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=num_layers,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        norm_topk_prob=True,
        routed_scaling_factor=1.0,
        kv_lora_rank=512,
        q_lora_rank=q_lora_rank,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        hidden_act="silu",
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_interleave=True,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=3,
        num_nextn_predict_layers=0,
        torch_dtype="float32",
    )


def tiny_mla_words(vocab_size: int) -> list[str]:
    """The tokenizer's vocabulary, in id order."""
    return ["<s>", "</s>", "<unk>", "<pad>"] + [
        f"t{i}" for i in range(NUM_SPECIAL, vocab_size)
    ]


def _save_tokenizer(path: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {word: i for i, word in enumerate(tiny_mla_words(vocab_size))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    )
    fast.save_pretrained(path)


def _fill_weights(model: torch.nn.Module, seed: int, init_std: float,
                  head_gain: float) -> None:
    """Overwrite every parameter from one seeded generator, in name order
    (independent of transformers' own init scheme)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "norm" in name:
                param.fill_(1.0)
            elif name.endswith("bias"):
                param.zero_()
            else:
                std = init_std
                if param.dim() == 2 and "embed" not in name:
                    # Keep activations O(1): std ~ gain / sqrt(fan_in).
                    std = init_std * (256 / param.shape[1]) ** 0.5
                param.copy_(torch.randn(param.shape, generator=gen) * std)
        model.lm_head.weight.mul_(head_gain)


def build_tiny_mla_checkpoint(
    path: str | os.PathLike,
    *,
    num_layers: int = 2,
    num_heads: int = 4,
    seed: int = 0,
    init_std: float = 0.08,
    head_gain: float = 4.0,
    overwrite: bool = False,
) -> Path:
    """Write a tiny DeepSeek-V3 MLA checkpoint (float32) and tokenizer.

    Deterministic for a given set of arguments and torch version. Reuses an
    existing checkpoint at ``path`` built with the same arguments unless
    ``overwrite``.

    Args:
        path: output directory (config.json, model.safetensors, tokenizer).
        num_layers: decoder layers (all dense MLA).
        num_heads: attention heads (divisible by TP x DCP of the tests).
        seed: weight generator seed.
        init_std: weight scale (before the fan-in correction).
        head_gain: multiplier of the output head (sharpens greedy margins).

    Returns:
        ``Path(path)``.
    """
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    path = Path(path)
    stamp = dict(version=TINY_MLA_VERSION, num_layers=num_layers,
                 num_heads=num_heads, seed=seed, init_std=init_std,
                 head_gain=head_gain)
    stamp_file = path / "tiny_mla.json"
    if (not overwrite and stamp_file.exists()
            and json.loads(stamp_file.read_text()) == stamp):
        return path
    path.mkdir(parents=True, exist_ok=True)

    fields = tiny_mla_config(num_layers=num_layers, num_heads=num_heads)
    config = DeepseekV3Config(**{k: v for k, v in fields.items()
                                 if k not in ("architectures", "model_type",
                                              "torch_dtype")})
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(config).float().eval()
    _fill_weights(model, seed, init_std, head_gain)
    model.save_pretrained(path, safe_serialization=True)

    # transformers may drop or rename fields vLLM's DeepSeek loader reads.
    config_file = path / "config.json"
    saved = json.loads(config_file.read_text())
    saved.update(fields)
    config_file.write_text(json.dumps(saved, indent=2, sort_keys=True))
    _save_tokenizer(path, fields["vocab_size"])
    stamp_file.write_text(json.dumps(stamp, sort_keys=True))
    return path


def hf_greedy(path: str | os.PathLike, prompts: list[list[int]],
              max_tokens: int) -> list[list[int]]:
    """transformers' own greedy tokens for each prompt (float32, no EOS stop)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32).eval()
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                do_sample=False, eos_token_id=None, pad_token_id=3)
            outputs.append(out[0, len(prompt):].tolist())
    return outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(build_tiny_mla_checkpoint(args.out_dir, num_layers=args.layers,
                                    num_heads=args.heads, seed=args.seed,
                                    overwrite=True))


if __name__ == "__main__":
    main()
