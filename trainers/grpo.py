"""The GRPO learner: group-normalised advantages, a clipped policy-gradient loss with an off-policy correction,
one optimiser step per batch, and checkpoints the engines load.

Asynchronous RL trains on samples that older weights generated: the gateway records, per sampled token, the
log-probability the engine gave it (`old_logprobs`, the behaviour policy) and the weight version that sampled it.
The loss is the decoupled PPO objective (Hilton et al. 2022; AReaL): with `prox` the learner's log-probabilities
at the start of the step (no gradient), for each model token

    ratio  = exp(logp - prox)                     the PPO ratio against the weights being updated
    weight = exp(prox - old_logprobs)             how much more likely the learner finds the token than the
                                                  engine that sampled it (behaviour importance weight)
    loss   = -weight * min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A)

`off_policy` says what is done with `weight`: "tis" truncates it at `tis_cap` (truncated importance sampling,
the default), "mask" drops the tokens whose weight is outside [1 / tis_cap, tis_cap] and trains the others with
weight 1, "none" uses 1 everywhere (on-policy assumption). Tokens sampled more than `max_staleness` versions ago
are masked by the consumer before they reach the loss (`TrajectoryConsumer(max_staleness=..., stale_policy=
"mask")`). The loss is averaged over the batch's model tokens.

The mismatch between engine and learner is measured on the tokens sampled under the learner's own weights
(`version == learner.version`): there `weight` should be 1, and |prox - old_logprobs| is the numerical gap
between the engine's kernels and torch's.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.utils import logging as transformers_logging

from gateway.trainer import Batch
from trainers.lora import lora_model

OffPolicy = Literal["tis", "mask", "none"]
# Files an engine needs beside the weights to load a checkpoint folder as a model (SGLang loads the folder).
_MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
)


@dataclass(frozen=True)
class GRPOConfig:
    """The learner's knobs; the defaults learn the digits task on the tiny model in a few dozen steps."""

    lr: float = 2e-2
    clip_eps: float = 0.2
    off_policy: OffPolicy = "tis"
    tis_cap: float = 2.0
    max_grad_norm: float = 1.0
    seed: int = 0
    dtype: Literal["float32", "bfloat16"] = "float32"  # of the checkpoints written: what the engines serve
    # torch's CPU threads (None: torch's default). On a CPU host that also runs the engine, 1 leaves the engine a
    # core: with both taken, the engine answers its pauses seconds late and generation stalls while a step runs.
    threads: int | None = None
    # Train a LoRA adapter of this rank (peft, on every linear layer of the blocks) instead of every weight: each
    # version is published as the adapter alone, which a pool with `base_model` loads beside the versions in flight.
    lora_rank: int | None = None
    # On-policy distillation (a policy with a teacher, `pools[i].teacher`): each token's advantage is the teacher's
    # log-probability of it minus the engine's (`teacher_logprobs - old_logprobs`, the reverse-KL estimate on the
    # student's own tokens) instead of the group-normalised reward; every sample of a batch needs teacher scores.
    distill: bool = False


@dataclass(frozen=True)
class StepStats:
    """What one optimiser step saw."""

    loss: float
    reward_mean: float
    tokens: int
    stale_tokens: int  # model tokens sampled by older weights than the learner's
    masked_tokens: int  # model tokens the off-policy correction dropped ("mask")
    mismatch_mean: float  # |learner - engine| logprob on tokens of the learner's own version (nan: none)
    mismatch_max: float
    stale_mismatch_mean: float  # the same on tokens of older versions (what the correction corrects; nan: none)
    grad_norm: float


class Learner:
    """A causal LM being trained with GRPO, starting from the checkpoint the engines serve as `version`."""

    def __init__(self, model_path: str | Path, config: GRPOConfig | None = None, version: int = 0) -> None:
        self.config = config or GRPOConfig()
        torch.manual_seed(self.config.seed)
        if self.config.threads is not None:
            torch.set_num_threads(self.config.threads)
        self.source = Path(model_path)
        model = AutoModelForCausalLM.from_pretrained(self.source, dtype=torch.float32)
        rank = self.config.lora_rank
        self.model: PreTrainedModel | PeftModel = model if rank is None else lora_model(model, rank)
        self.model.train()
        trained = [p for p in self.model.parameters() if p.requires_grad]  # a LoRA model's base is frozen
        self.optimizer = torch.optim.Adam(trained, lr=self.config.lr)
        self.version = version  # the weight version the learner's parameters are

    def step(self, batch: Batch, pad_token_id: int = 0) -> StepStats:
        """One optimiser step on `batch` (complete groups); the learner's version is unchanged until `save`."""
        t = batch.to_tensors(pad_token_id=pad_token_id)
        mask = t["loss_mask"][:, 1:]
        old = t["old_logprobs"][:, 1:]
        versions = t["versions"][:, 1:]
        advantages = self._advantages(t, old, mask)

        logp = self.token_logprobs(t["input_ids"], t["attention_mask"])
        prox = logp.detach()
        weight, kept = behaviour_weight(prox, old, mask, self.config.off_policy, self.config.tis_cap)
        ratio = torch.exp(logp - prox)
        clipped = torch.clamp(ratio, 1 - self.config.clip_eps, 1 + self.config.clip_eps)
        surrogate = torch.minimum(ratio * advantages, clipped * advantages)
        tokens = kept.sum().clamp(min=1.0)
        loss = -(weight * surrogate * kept).sum() / tokens

        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
        self.optimizer.step()

        model_tokens = mask.bool()
        own = model_tokens & (versions == self.version)
        older = model_tokens & (versions < self.version)
        gap = (prox - old).abs()
        return StepStats(
            loss=float(loss.detach()),
            reward_mean=float(torch.nanmean(t["rewards"])),
            tokens=int(model_tokens.sum()),
            stale_tokens=int(older.sum()),
            masked_tokens=int((model_tokens & ~kept.bool()).sum()),
            mismatch_mean=float(gap[own].mean()) if own.any() else float("nan"),
            mismatch_max=float(gap[own].max()) if own.any() else float("nan"),
            stale_mismatch_mean=float(gap[older].mean()) if older.any() else float("nan"),
            grad_norm=float(grad_norm.detach()),
        )

    def _advantages(self, t: dict[str, torch.Tensor], old: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(B, 1) group-normalised rewards, or (B, T - 1) per token when distilling (`GRPOConfig.distill`)."""
        if not self.config.distill:
            return group_advantages(t["rewards"], t["group_index"])[:, None]
        if "teacher_logprobs" not in t:
            raise ValueError(
                "distill needs a teacher's scores for every sample of the batch (a policy with pools[i].teacher; "
                "a session delivered unscored has none: leave it out)"
            )
        return (t["teacher_logprobs"][:, 1:] - old) * mask

    def token_logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(B, T - 1): the log-probability of `input_ids[:, t + 1]` given the tokens before it, in float32."""
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
        return torch.log_softmax(logits.float(), dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)

    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """The weights as the engines load them: checkpoint names, in the checkpoint dtype, copies taken now (the next
        step may run while they travel); a tensor tied to an earlier one (shared storage) is sent once, under the
        first name, as a checkpoint stores it."""
        if self.config.lora_rank is not None:
            raise NotImplementedError("a LoRA policy's versions are adapters the engines load from a path (save)")
        dtype = getattr(torch, self.config.dtype)
        seen: set[int] = set()
        named = []
        for name, tensor in self.model.state_dict().items():
            storage = tensor.untyped_storage().data_ptr()
            if storage in seen:
                continue
            seen.add(storage)
            named.append((name, tensor.detach().to(dtype, copy=True)))
        return named

    def save(self, out_dir: str | Path, version: int) -> Path:
        """Write the weights as version `version` (safetensors, with the files an engine loads beside them) into
        `out_dir/v{version}` and return that folder; written aside and renamed, so no engine reads half a file."""
        target = Path(out_dir) / f"v{version}"
        target.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=f".v{version}-", dir=target.parent))
        if self.config.lora_rank is not None:
            self.model.save_pretrained(str(scratch))  # the adapter alone: adapter_config.json, adapter_model.*
            return self._publish(scratch, target, version)
        dtype = getattr(torch, self.config.dtype)
        state = {name: tensor.detach().to(dtype) for name, tensor in self.model.state_dict().items()}
        transformers_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # one bar per checkpoint
        self.model.save_pretrained(str(scratch), state_dict=state, safe_serialization=True)
        for name in _MODEL_FILES:
            if (self.source / name).exists() and not (scratch / name).exists():
                shutil.copy2(self.source / name, scratch / name)
        _set_dtype(scratch / "config.json", self.config.dtype)
        return self._publish(scratch, target, version)

    def _publish(self, scratch: Path, target: Path, version: int) -> Path:
        if target.exists():
            shutil.rmtree(target)
        os.replace(scratch, target)
        self.version = version
        return target


def group_advantages(rewards: torch.Tensor, group_index: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """(reward - group mean) / (group std + eps) per row; rows of a group whose rewards are all equal get 0."""
    groups = int(group_index.max()) + 1 if group_index.numel() else 0
    count = torch.zeros(groups).index_add_(0, group_index, torch.ones_like(rewards))
    mean = torch.zeros(groups).index_add_(0, group_index, rewards) / count
    centred = rewards - mean[group_index]
    var = torch.zeros(groups).index_add_(0, group_index, centred**2) / count
    return centred / (var[group_index].sqrt() + eps)


def behaviour_weight(
    prox: torch.Tensor, old: torch.Tensor, mask: torch.Tensor, mode: OffPolicy, cap: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The importance weight exp(prox - old) of each token under `mode`, and the mask of the tokens trained."""
    raw = torch.exp((prox - old) * mask)  # 1 off the model tokens, whatever `old` holds there
    if mode == "tis":
        return raw.clamp(max=cap), mask
    if mode == "mask":
        inside = ((raw >= 1 / cap) & (raw <= cap)).to(mask.dtype)
        return torch.ones_like(raw), mask * inside
    return torch.ones_like(raw), mask


def _set_dtype(config: Path, dtype: str) -> None:
    data = json.loads(config.read_text())
    data["dtype"] = dtype
    data.pop("torch_dtype", None)
    config.write_text(json.dumps(data, indent=2))
