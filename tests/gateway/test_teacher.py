"""A teacher pool (`pools[i].role: teacher`, issue 54 §3): it scores the finished samples of the policies that name
it (`pools[i].teacher`) before the trainer gets them, and serves no agent (`gateway.teacher`)."""

from __future__ import annotations

from typing import Any

import httpx
import numpy as np
import pytest

from backends.scoring import PromptScores
from backends.sim.engine import EngineSettings
from backends.sim.model import ModelShape
from backends.sim.reference import reference_scores
from gateway.config import ReplicaConfig, load_config
from gateway.errors import ConfigError
from gateway.server import RunningGateway
from gateway.teacher import teacher_fields
from gateway.trainer.batch import Batch
from gateway.trainer.consumer import TrajectoryConsumer
from gateway.trajectory import Sample, Trajectory
from tests.conftest import GatewayFactory, SimFactory
from tests.gateway_helpers import generate_body, scrape, value
from tests.sim_helpers import wait_for


def pool(model: str, sim: Any, **extra: Any) -> dict[str, Any]:
    return {"model": model, "replicas": [ReplicaConfig(url=sim.url, backend="sim", dialect=sim.dialect)]} | extra


SHAPE = ModelShape()


async def student_and_teachers(
    make_sim: SimFactory, make_gateway: GatewayFactory, teacher: dict[str, Any], *teachers: str
) -> RunningGateway:
    """A student pool on a vLLM-dialect simulator and one SGLang-dialect teacher pool per name, each simulator with
    weights of its own (`weights` = its name), so each teacher scores otherwise."""
    student = await make_sim("vllm")
    pools = [pool("student", student, teacher=teacher)]
    for name in teachers:
        sim = await make_sim("sglang", EngineSettings(block_size=1, weights=name))
        pools.append(pool(name, sim, role="teacher"))
    return await make_gateway([], pools=pools)


async def episode(http: httpx.AsyncClient, gw: RunningGateway, session: str, **metadata: str) -> dict[str, Any]:
    """One turn of session `session` (with `metadata`), then its finish's answer."""
    body = generate_body([5, 6, 7, 8], 12, model="student", session_id=session) | (
        {"metadata": metadata} if metadata else {}
    )
    answer = await http.post(f"{gw.url}/generate", json=body)
    assert answer.status_code == 200, answer.text
    finished = await http.post(f"{gw.url}/v1/sessions/{session}/finish", json={"reward": 1.0})
    assert finished.status_code == 200, finished.text
    return dict(finished.json())


async def delivered(gw: RunningGateway, count: int = 1) -> list[Trajectory]:
    async with TrajectoryConsumer(gw.services.redis_url, "trainer", "t0", pool="student") as consumer:
        batch = await consumer.next_batch(count, timeout=10)
        await consumer.ack(batch)
        return list(batch.trajectories)


def assert_scored_by(trajectory: Trajectory, weights: str, top_k: int) -> None:
    sample = trajectory.samples[0]
    start = sample.prompt_ids.size
    expected = reference_scores(SHAPE, sample.input_ids.tolist(), (weights, "default"), start, top_k=top_k)
    assert sample.teacher_logprobs is not None and sample.teacher_top_ids is not None
    np.testing.assert_allclose(sample.teacher_logprobs, [e.logprob for e in expected], rtol=1e-6)
    assert sample.teacher_top_ids.tolist() == [[t for t, _ in e.top] for e in expected]
    assert (trajectory.meta.scoring, trajectory.meta.teacher) == ("scored", f"{weights}@0")


async def test_a_finished_session_is_delivered_once_its_teacher_scored_it(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    gw = await student_and_teachers(make_sim, make_gateway, {"model": "teacher", "top_k": 2}, "teacher")
    finished = await episode(http, gw, "s-1")
    assert (finished["scoring"], finished["delivered"], finished["stream_id"]) == (True, False, None)
    (trajectory,) = await delivered(gw)
    assert_scored_by(trajectory, "teacher", 2)
    sample = trajectory.samples[0]
    response = slice(sample.prompt_ids.size, sample.prompt_ids.size + sample.response_ids.size)
    for layout in ("rows", "packed"):  # aligned as old_logprobs: position t scores token t
        tensors = Batch(trajectories=[trajectory]).to_tensors(layout=layout)  # type: ignore[arg-type]
        np.testing.assert_allclose(tensors["teacher_logprobs"][0, response].numpy(), sample.teacher_logprobs)
        assert not tensors["teacher_logprobs"][0, : sample.prompt_ids.size].any()
    again = await http.post(f"{gw.url}/v1/sessions/s-1/finish", json={"reward": 1.0})  # idempotent: its entry now
    assert again.json()["delivered"] and again.json()["stream_id"] == trajectory.entry_id
    samples = await scrape(http, gw.url)
    assert value(samples, "rollout_gateway_teacher_sessions_total", pool="student", outcome="scored") == 1


async def test_a_teacher_that_cannot_score_holds_the_session_until_its_deadline_then_it_goes_unscored(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    student = await make_sim("vllm")
    dead = ReplicaConfig(url="http://127.0.0.1:9", backend="sim", dialect="sglang")  # nothing listens there
    gw = await make_gateway(
        [],
        pools=[
            pool("student", student, teacher={"model": "teacher", "deadline_s": 3}),
            {"model": "teacher", "role": "teacher", "replicas": [dead]},
        ],
    )
    await episode(http, gw, "s-2")
    scoring = gw.services.scoring
    assert scoring is not None
    await wait_for(lambda: scoring.failures_total >= 1, what="a failed scoring round")
    assert await gw.services.store.repair_undelivered(0.0) == 0  # the repair sweeper leaves it to the scorer
    assert (await gw.services.store.get_session("s-2")).stream_id is None  # type: ignore[union-attr]
    (trajectory,) = await delivered(gw)
    assert (trajectory.meta.scoring, trajectory.meta.teacher) == ("unscored", "teacher@0")
    assert trajectory.samples[0].teacher_logprobs is None
    samples = await scrape(http, gw.url)
    assert value(samples, "rollout_gateway_teacher_sessions_total", pool="student", outcome="unscored") == 1
    assert value(samples, "rollout_gateway_teacher_failures_total", pool="student") >= 1


async def test_a_teacher_that_hangs_holds_the_session_only_until_its_deadline(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    student, teacher = await make_sim("vllm"), await make_sim("vllm")
    teacher.engine.set_stalled(True)  # it takes the scoring request and never answers
    gw = await make_gateway(
        [],
        pools=[
            pool("student", student, teacher={"model": "teacher", "deadline_s": 2}),
            pool("teacher", teacher, role="teacher"),
        ],
    )
    await episode(http, gw, "s-hung")
    (trajectory,) = await delivered(gw)
    assert (trajectory.meta.scoring, trajectory.samples[0].teacher_logprobs) == ("unscored", None)


async def test_two_gateway_processes_score_and_deliver_each_session_once(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """Both processes run a scorer on the one queue: each session is scored under one lease and delivered once,
    whichever process finished it; a session whose process stops before scoring it is scored by the other."""
    student, teacher = await make_sim("vllm"), await make_sim("sglang", EngineSettings(block_size=1, weights="teacher"))
    pools = [pool("student", student, teacher={"model": "teacher"}), pool("teacher", teacher, role="teacher")]
    first, second = await make_gateway([], pools=pools), await make_gateway([], pools=pools)
    assert first.services.scoring is not None
    await first.services.scoring.aclose()  # the first finishes sessions but scores none: the second's scorer does
    for index in range(6):
        await episode(http, first if index % 2 else second, f"s-{index}")
    trajectories = await delivered(second, 6)
    assert sorted(t.session_id for t in trajectories) == [f"s-{index}" for index in range(6)]
    for trajectory in trajectories:
        assert_scored_by(trajectory, "teacher", 0)
    assert await second.services.scoring.queue.size() == 0  # type: ignore[union-attr]


async def test_the_session_metadata_picks_its_teacher(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    teacher = {"model": "math", "by_metadata": "task", "models": {"code": "code"}}
    gw = await student_and_teachers(make_sim, make_gateway, teacher, "math", "code")
    await episode(http, gw, "s-code", task="code")
    await episode(http, gw, "s-other", task="poetry")  # a value no teacher is named for: the default
    by_session = {t.session_id: t for t in await delivered(gw, 2)}
    assert_scored_by(by_session["s-code"], "code", 0)
    assert_scored_by(by_session["s-other"], "math", 0)


async def test_scoring_on_demand_answers_with_the_scores_and_delivers_a_waiting_session(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    gw = await student_and_teachers(make_sim, make_gateway, {"model": "teacher"}, "teacher")
    body = generate_body([5, 6, 7, 8], 12, model="student", session_id="s-3")
    assert (await http.post(f"{gw.url}/generate", json=body)).status_code == 200
    scored = await http.post(f"{gw.url}/v1/sessions/s-3/score")  # active: scored, not delivered
    assert scored.status_code == 200, scored.text
    assert scored.json()["samples"] == [{"index": 0, "tokens": 12}] and not scored.json()["delivered"]
    await http.post(f"{gw.url}/v1/sessions/s-3/finish", json={"reward": 0.5})
    (trajectory,) = await delivered(gw)
    assert_scored_by(trajectory, "teacher", 0)
    missing = await http.post(f"{gw.url}/v1/sessions/nope/score")
    assert missing.status_code == 404


def test_scores_stored_for_a_shorter_response_are_not_read_as_this_samples() -> None:
    """A sample scored on demand and extended by a later turn holds scores of its earlier, shorter self: read back,
    it has none (its finish scores it again), never misaligned ones."""
    ids = np.arange(7, 10, dtype=np.int32)
    sample = Sample(
        prompt_ids=np.array([5, 6], np.int32),
        response_ids=ids,
        loss_mask=np.ones(3, np.uint8),
        logprobs=np.zeros(3, np.float32),
        versions=np.zeros(3, np.int32),
    )
    scored = PromptScores(np.full(3, -0.5, np.float32), np.zeros((3, 1), np.int32), np.zeros((3, 1), np.float32))
    fields: dict[str, Any] = sample.to_redis() | teacher_fields(scored)
    assert Sample.from_redis(fields).teacher_logprobs.tolist() == [-0.5] * 3  # type: ignore[union-attr]
    shorter = PromptScores(np.full(2, -0.5, np.float32), np.zeros((2, 1), np.int32), np.zeros((2, 1), np.float32))
    assert Sample.from_redis(sample.to_redis() | teacher_fields(shorter)).teacher_logprobs is None


async def test_a_policy_without_a_teacher_refuses_scoring(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    gw = await make_gateway([await make_sim("vllm")])
    body = generate_body([5, 6, 7, 8], 4, session_id="s-4")
    assert (await http.post(f"{gw.url}/generate", json=body)).status_code == 200
    refused = await http.post(f"{gw.url}/v1/sessions/s-4/score")
    assert refused.status_code == 400 and "has no teacher" in refused.json()["error"]["message"]
    finished = await http.post(f"{gw.url}/v1/sessions/s-4/finish", json={"reward": 1.0})
    assert finished.json()["delivered"] and not finished.json()["scoring"]


def chat(model: str) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "temperature": 0}


async def test_a_teacher_pool_serves_no_agent_and_the_policy_is_the_default_model(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    student, teacher = await make_sim("vllm"), await make_sim("sglang")
    gw = await make_gateway(
        [], pools=[pool("student", student, teacher={"model": "teacher"}), pool("teacher", teacher, role="teacher")]
    )
    models = (await http.get(f"{gw.url}/v1/models")).json()
    assert [card["id"] for card in models["data"]] == ["student"]
    refused = await http.post(f"{gw.url}/v1/chat/completions", json=chat("teacher"))
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "model"
    assert "`teacher` is a teacher" in refused.json()["error"]["message"]
    assert "`student`" in refused.json()["error"]["message"]
    answer = await http.post(f"{gw.url}/generate", json=generate_body([5, 6, 7], 4))  # no model: the one policy
    assert answer.status_code == 200, answer.text
    assert len(answer.json()["output_ids"]) == 4
    assert (
        student.engine.total_counters()["generation_tokens"],
        teacher.engine.total_counters()["generation_tokens"],
    ) == (4, 0)


def test_a_teacher_is_validated_naming_what_is_wrong() -> None:
    replica = {"url": "http://127.0.0.1:9", "backend": "sim"}
    teacher = {"model": "t", "role": "teacher", "replicas": [replica]}
    cases = {
        r"pools\[0\]\.teacher names 'u', which is no teacher pool \(the teacher pools: 't'\)": [
            {"model": "p", "teacher": {"model": "u"}},
            teacher,
        ],
        r"pools\[0\]\.teacher names 'p2', which is no teacher pool": [
            {"model": "p", "teacher": {"model": "t", "by_metadata": "task", "models": {"code": "p2"}}},
            {"model": "p2"},
            teacher,
        ],
        r"pools\[1\] \('t'\) is a teacher: it has no teacher of its own": [
            {"model": "p"},
            teacher | {"teacher": {"model": "t"}},
        ],
        r"top_k": [{"model": "p", "teacher": {"model": "t", "top_k": 21}}, teacher],
    }
    for expected, pools in cases.items():
        with pytest.raises(ConfigError, match=expected):
            load_config(pools=pools)
