"""The reference GRPO trainer (trainers/): its loss pieces on known numbers, one optimiser step of a tiny model,
the checkpoints it writes, and the whole loop over the simulator (real gateway, Redis and HTTP). Whether it
learns is checked on the real engines (tests/engines: `test_the_reference_trainer_learns_through_the_gateway`),
where the log-probabilities are the model's own."""

from __future__ import annotations

import math
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from benchmarks.mismatch import build_model
from gateway.trainer import Batch
from gateway.trajectory import Sample, SessionMeta, Trajectory
from tests.conftest import ADMIN, ADMIN_TOKEN, GatewayFactory, SimFactory
from tests.sim_helpers import sim_state
from trainers.grpo import GRPOConfig, Learner, StepStats, behaviour_weight, group_advantages
from trainers.loop import LoopConfig, train
from trainers.rollouts import SamplingConfig
from trainers.task import DigitsTask


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The engine tiers' `dense` model (scripts/build_tiny_models.py), built here in a second."""
    return build_model(tmp_path_factory.mktemp("models"), "float32")


def test_advantages_are_normalised_within_each_group() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 0.2, 0.4, 0.6])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 2])
    got = group_advantages(rewards, groups)
    std = math.sqrt(((0.2 - 0.4) ** 2 + 0 + (0.6 - 0.4) ** 2) / 3)
    expected = [1.0, -1.0, 0.0, 0.0, -0.2 / std, 0.0, 0.2 / std]
    assert torch.allclose(got, torch.tensor(expected), atol=1e-4)


def test_the_off_policy_correction_truncates_or_masks_the_behaviour_weight() -> None:
    prox = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.5]]))
    old = torch.log(torch.tensor([[0.5, 0.1, 0.9, 0.01]]))  # weights 1, 5, 0.56, 50
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])  # the last is no model token: weight 1, never trained
    weight, kept = behaviour_weight(prox, old, mask, "tis", cap=2.0)
    assert torch.allclose(weight, torch.tensor([[1.0, 2.0, 5 / 9, 1.0]]), atol=1e-5) and torch.equal(kept, mask)
    weight, kept = behaviour_weight(prox, old, mask, "mask", cap=2.0)
    assert torch.equal(weight, torch.ones(1, 4)) and torch.equal(kept, torch.tensor([[1.0, 0.0, 1.0, 0.0]]))
    weight, kept = behaviour_weight(prox, old, mask, "none", cap=2.0)
    assert torch.equal(weight, torch.ones(1, 4)) and torch.equal(kept, mask)


def _logprobs(model: torch.nn.Module, prompt: list[int], response: list[int]) -> np.ndarray:
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1]
    picked = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    return picked[len(prompt) - 1 :].numpy().astype(np.float32)


def _trajectory(name: str, prompt: list[int], response: list[int], logprobs: np.ndarray, reward: float) -> Trajectory:
    n = len(response)
    sample = Sample(
        prompt_ids=np.array(prompt, np.int32),
        response_ids=np.array(response, np.int32),
        loss_mask=np.ones(n, np.uint8),
        logprobs=logprobs,
        versions=np.zeros(n, np.int32),
    )
    meta = SessionMeta(id=name, status="finished", metadata={"group_id": "g", "group_size": 2}, reward=reward)
    return Trajectory(meta, [sample])


def step_on_a_good_and_a_bad_answer(learner: Learner) -> StepStats:
    """One step on a group of two answers of one prompt, the rewarded one and the other; asserts the step made the
    rewarded answer likelier and the other less likely."""
    prompt, good, bad = [5, 6, 7], [300, 301, 302, 303], [400, 401, 402, 403]
    before = {name: _logprobs(learner.model, prompt, ids) for name, ids in (("good", good), ("bad", bad))}
    batch = Batch(
        trajectories=[
            _trajectory("a", prompt, good, before["good"], 1.0),
            _trajectory("b", prompt, bad, before["bad"], 0.0),
        ],
        group_index=[0, 0],
    )
    stats = learner.step(batch)
    after = {name: _logprobs(learner.model, prompt, ids) for name, ids in (("good", good), ("bad", bad))}
    assert after["good"].sum() > before["good"].sum() and after["bad"].sum() < before["bad"].sum()
    return stats


def test_one_step_makes_the_rewarded_answer_likelier_and_the_other_less_likely(tiny_model: Path) -> None:
    stats = step_on_a_good_and_a_bad_answer(Learner(tiny_model, GRPOConfig(lr=1e-2, threads=1)))
    assert stats.tokens == 8 and stats.stale_tokens == 0 and stats.reward_mean == 0.5
    assert stats.mismatch_max < 1e-5  # the logprobs given were the model's own


def test_distilling_makes_what_the_teacher_prefers_likelier_and_what_it_rejects_less_likely(tiny_model: Path) -> None:
    """`GRPOConfig.distill`: no reward, each token's advantage is the teacher's logprob minus the sampler's; a
    teacher that scores one answer above the student and the other below moves the student towards the first."""
    learner = Learner(tiny_model, GRPOConfig(lr=1e-2, threads=1, distill=True))
    prompt, liked, disliked = [5, 6, 7], [300, 301, 302, 303], [400, 401, 402, 403]
    before = {name: _logprobs(learner.model, prompt, ids) for name, ids in (("liked", liked), ("disliked", disliked))}
    trajectories = [
        _trajectory("a", prompt, liked, before["liked"], float("nan")),
        _trajectory("b", prompt, disliked, before["disliked"], float("nan")),
    ]
    trajectories[0].samples[0].teacher_logprobs = before["liked"] + 2.0
    trajectories[1].samples[0].teacher_logprobs = before["disliked"] - 2.0
    learner.step(Batch(trajectories=trajectories, group_index=[0, 1]))
    after = {name: _logprobs(learner.model, prompt, ids) for name, ids in (("liked", liked), ("disliked", disliked))}
    assert after["liked"].sum() > before["liked"].sum() and after["disliked"].sum() < before["disliked"].sum()
    trajectories[1].samples[0].teacher_logprobs = None  # delivered unscored
    with pytest.raises(ValueError, match="distill needs a teacher's scores"):
        learner.step(Batch(trajectories=trajectories, group_index=[0, 1]))


def test_a_lora_learner_trains_its_adapter_alone_and_publishes_it_as_a_peft_folder(
    tiny_model: Path, tmp_path: Path
) -> None:
    learner = Learner(tiny_model, GRPOConfig(lr=1e-2, threads=1, lora_rank=4))
    base = {n: p.detach().clone() for n, p in learner.model.named_parameters() if "lora_" not in n}
    step_on_a_good_and_a_bad_answer(learner)
    assert all(torch.equal(p, base[n]) for n, p in learner.model.named_parameters() if n in base)  # frozen
    folder = learner.save(tmp_path, 1)
    assert {f.name for f in folder.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
    assert not (folder / "model.safetensors").exists()
    assert '"r": 4' in (folder / "adapter_config.json").read_text()
    with pytest.raises(NotImplementedError):
        learner.named_weights()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_checkpoint_is_an_engine_loadable_folder_of_the_learner_weights(
    tiny_model: Path, tmp_path: Path, dtype: str
) -> None:
    learner = Learner(tiny_model, GRPOConfig(dtype=dtype, threads=1))  # type: ignore[arg-type]
    with torch.no_grad():
        learner.model.lm_head.weight.add_(1.0)
    folder = learner.save(tmp_path, 3)
    assert folder == tmp_path / "v3" and learner.version == 3
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        f.name for f in folder.iterdir()
    }
    assert not [f for f in tmp_path.iterdir() if f.name.startswith(".")]  # no scratch folder left behind
    tensors = load_file(folder / "model.safetensors")
    assert all(t.dtype == getattr(torch, dtype) for t in tensors.values())
    expected = learner.model.lm_head.weight.detach().to(getattr(torch, dtype))
    assert torch.equal(tensors["lm_head.weight"], expected)
    assert f'"dtype": "{dtype}"' in (folder / "config.json").read_text()


def test_the_digits_reward_is_the_share_of_digit_tokens(tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    task = DigitsTask.for_tokenizer(tokenizer)
    digits = tokenizer.encode("12340", add_special_tokens=False)
    words = tokenizer.encode("hello there", add_special_tokens=False)
    assert set(digits) <= task.digit_ids and not set(words) & task.digit_ids
    assert task.reward(digits) == 1.0 and task.reward(words) == 0.0 and task.reward([]) == 0.0
    assert task.reward(digits + words) == len(digits) / (len(digits) + len(words))


async def test_the_loop_trains_and_publishes_each_step_over_the_simulator(
    tiny_model: Path, tmp_path: Path, make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """Mechanics, not learning (the simulator's tokens are no model's): each step trains on complete groups, writes
    its checkpoint, and the gateway loads it on the replica as the next version after the one it serves, while
    rollouts go on."""
    sim = await make_sim("vllm")
    gw = await make_gateway([sim], model={"tokenizer": str(tiny_model)})
    synced = {"version": 2, "source": "external"}  # the gateway is at version 2 before the trainer starts
    (await http.post(f"{gw.url}/admin/weights", json=synced, headers=ADMIN)).raise_for_status()
    config = LoopConfig(
        steps=3,
        groups_per_step=2,
        workers=2,
        keep_checkpoints=2,
        sampling=SamplingConfig(group_size=4, max_tokens=8),
        grpo=GRPOConfig(threads=1),
    )
    seen = []
    result = await train(
        gw.url, gw.services.redis_url, tiny_model, tmp_path, config, admin_token=ADMIN_TOKEN, on_step=seen.append
    )
    assert [s.step for s in result.steps] == [1, 2, 3] and seen == result.steps
    assert [s.version for s in result.steps] == [3, 4, 5]
    assert all(s.groups == 2 and s.stats.tokens > 0 for s in result.steps)
    assert gw.services.weights.version == 5
    assert sorted(f.name for f in tmp_path.iterdir()) == ["v4", "v5"]  # the older ones pruned
    assert (await sim_state(http, sim.url))["weights"] == str(tmp_path / "v5")
