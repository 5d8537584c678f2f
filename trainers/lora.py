"""LoRA adapters of the reference model in peft's format, the one vLLM and SGLang load
(`adapter_config.json` + `adapter_model.safetensors`): a policy trained as an adapter publishes each version as one
(`POST /admin/weights {model, version, path}` on a pool with `base_model`, `backends.lora`).

`random_adapter` makes one whose B matrices are drawn instead of zero, so that it samples differently from the base
model at once: what the engine tiers load to tell two versions apart. Never downloaded; a pure function of the seed.
"""

from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, PreTrainedModel


def lora_model(model: PreTrainedModel, rank: int) -> PeftModel:
    """`model` with a LoRA adapter of `rank` on every linear layer of its blocks (peft's "all-linear": the
    attention and MLP projections, not the head), scaled by alpha = 2 × rank; only the adapter trains."""
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", lora_dropout=0.0, bias="none")
    return get_peft_model(model, config)


def random_adapter(base: str | Path, out: str | Path, seed: int, rank: int = 8, scale: float = 0.2) -> Path:
    """Write an adapter of the model at `base` to `out` (made if missing) with every LoRA matrix drawn from
    N(0, `scale`²) under `seed`; returns `out`."""
    peft_model = lora_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), rank)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * scale)
    target = Path(out)
    target.mkdir(parents=True, exist_ok=True)
    peft_model.save_pretrained(str(target))
    return target
