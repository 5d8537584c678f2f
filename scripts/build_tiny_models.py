#!/usr/bin/env python3
"""Build the tiny random-weight models the real-engine test tiers serve (no downloads, a few seconds on a CPU).

Writes these checkpoints, each with the project's tiny tokenizer (gateway/assets/tiny_tokenizer) beside it:

    dense      Qwen2ForCausalLM, hidden 128, 2 layers, 4 heads / 2 kv heads, vocab 2048
    dense_v2   the same architecture with other weights (the weight-update tests load it over `dense`)
    moe        Qwen3MoeForCausalLM, same dims, 8 experts, top-2, every layer MoE
    moe_v2     the MoE architecture with other weights (loaded over `moe` when a server serves the MoE)
    think      a Qwen2 of the same dims on the tiny tokenizer dressed as Qwen3, trained to reason and call a tool
               (scripts/think_model.py); think_v2 the same weights, for weight updates

Weights are drawn with a large init scale so each next-token distribution is peaked: a near-uniform random
model makes greedy decoding flip between tokens whose logits differ in the last bit, and the tests compare
greedy runs. The output is a pure function of the seeds (same torch, same files). Never commit the output.

`--size large` builds `dense` and `dense_v2` at about 130 M parameters instead (hidden 1024, 8 layers, 516 MB of
float32 weights each, drawn at the usual small scale): the model `benchmarks.updates --engine` measures a weight
transfer on, where moving the weights takes visible time. Never built by setup.sh.

Usage::

    python scripts/build_tiny_models.py --out DIR [--dtype float32|bfloat16]
    python scripts/build_tiny_models.py --out DIR --size large --only dense --only dense_v2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO_ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = REPO_ROOT / "gateway" / "assets" / "tiny_tokenizer"

VOCAB_SIZE = 2048
EOS_ID = 2  # <|im_end|>
PAD_ID = 0  # <|endoftext|>
INIT_STD = 0.5  # peaked logits: see the module docstring
MAX_POSITIONS = 4096

COMMON: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 256,
    "max_position_embeddings": MAX_POSITIONS,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "initializer_range": INIT_STD,
    "bos_token_id": PAD_ID,
    "eos_token_id": EOS_ID,
    "pad_token_id": PAD_ID,
}

MOE: dict[str, Any] = {
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
}

# `--size large`: the dense architecture made big enough that its weights take time to move (about 130 M parameters)
LARGE: dict[str, Any] = {
    "hidden_size": 1024,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "intermediate_size": 4096,
    "initializer_range": 0.02,
}
SIZES: dict[str, dict[str, Any]] = {"tiny": {}, "large": LARGE}

# name -> (architecture, seed)
MODELS: dict[str, tuple[str, int]] = {
    "dense": ("qwen2", 1),
    "dense_v2": ("qwen2", 2),
    "moe": ("qwen3_moe", 3),
    "moe_v2": ("qwen3_moe", 4),
}


def build(name: str, out: Path, dtype: str, size: str = "tiny") -> Path:
    """Build one checkpoint into `out/name` and return its directory."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    kind, seed = MODELS[name]
    torch.manual_seed(seed)
    dims = COMMON | SIZES[size]
    model: Any
    if kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**dims))
    else:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**dims, **MOE))
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:  # embeddings, projections, experts, router; norms stay at 1
                param.normal_(0.0, dims["initializer_range"])
    model = model.to(getattr(torch, dtype))
    target = out / name
    if target.exists():
        shutil.rmtree(target)
    model.save_pretrained(target, safe_serialization=True)
    for file in TOKENIZER.iterdir():
        shutil.copy2(file, target / file.name)
    _write_generation_config(target)
    return target


def build_think(out: Path, dtype: str) -> Path:
    """The trained `think` model (and `think_v2`): scripts/think_model.py, beside this file."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from think_model import build_think_model

    return build_think_model(out, COMMON, dtype)


def _write_generation_config(target: Path) -> None:
    """Plain defaults: engines otherwise read sampling defaults from here."""
    config = {"bos_token_id": PAD_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID, "do_sample": False}
    (target / "generation_config.json").write_text(json.dumps(config, indent=2) + "\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out", type=Path, required=True, help="folder that receives dense/, dense_v2/, moe/, moe_v2/")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--only", choices=sorted([*MODELS, "think"]), action="append", help="build only these")
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny", help="large: the transfer benchmark's model")
    args = parser.parse_args(argv)
    if args.size != "tiny" and (not args.only or set(args.only) - {"dense", "dense_v2"}):
        parser.error("--size large builds dense and dense_v2 only: name them with --only")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.only or [*MODELS, "think"]:
        path = build_think(args.out, args.dtype) if name == "think" else build(name, args.out, args.dtype, args.size)
        size = sum(f.stat().st_size for f in path.iterdir())
        print(f"{name}: {path} ({size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
