"""`PromptScorer` (`backends.scoring`): a teacher's scoring calls against simulator replicas of both dialects (real
HTTP), compared with the simulator's offline reference; the answers the simulator never gives, from a scripted
server."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
import orjson
import pytest

from backends.base import EngineBackend, ReplicaSpec
from backends.errors import BackendProtocolError
from backends.factory import Dialect, create_backend
from backends.sim.engine import EngineSettings
from backends.sim.model import ModelShape
from backends.sim.reference import reference_scores
from backends.sim.server import SimReplica
from tests.conftest import SimFactory
from tests.scripted_server import ScriptedServer, replying, scripted_server

SHAPE = ModelShape()
INIT = ("init", "default")
IDS = [5, 100, 200, 300, 400, 500, 600, 700, 800, 900, 1000, 1100]

BackendFor = Callable[[SimReplica | ScriptedServer, Dialect], EngineBackend]


@pytest.fixture
async def backend_for() -> AsyncIterator[BackendFor]:
    backends: list[EngineBackend] = []

    def make(target: SimReplica | ScriptedServer, dialect: Dialect) -> EngineBackend:
        backend = create_backend("sim", ReplicaSpec(id="teacher-0", url=target.url), dialect)
        backends.append(backend)
        return backend

    yield make
    for backend in backends:
        await backend.aclose()


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
@pytest.mark.parametrize("top_k", [0, 3])
@pytest.mark.parametrize("start", [1, 7, 11])
async def test_each_token_is_scored_as_the_engine_gives_it(
    make_sim: SimFactory, backend_for: BackendFor, dialect: Dialect, top_k: int, start: int
) -> None:
    backend = backend_for(await make_sim(dialect), dialect)
    scores = await backend.scorer.score(IDS, start, top_k)
    expected = reference_scores(SHAPE, IDS, INIT, start, top_k=top_k)
    assert len(scores) == len(IDS) - start
    np.testing.assert_allclose(scores.logprobs, [s.logprob for s in expected], rtol=1e-6)
    assert scores.top_ids.shape == scores.top_logprobs.shape == (len(IDS) - start, top_k)
    assert scores.top_ids.tolist() == [[t for t, _ in s.top] for s in expected]
    np.testing.assert_allclose(scores.top_logprobs, [[lp for _, lp in s.top] for s in expected], rtol=1e-6)
    if top_k:
        assert np.all(scores.logprobs <= scores.top_logprobs[:, 0] + 1e-6)  # nothing scores above the best


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
async def test_a_teacher_adapter_scores_under_its_own_weights(
    make_sim: SimFactory, backend_for: BackendFor, dialect: Dialect
) -> None:
    sim = await make_sim(dialect, EngineSettings(block_size=16 if dialect == "vllm" else 1, max_loras=2))
    backend = backend_for(sim, dialect)
    await backend.adapters.load("teacher-v1", "teacher-path")  # type: ignore[attr-defined]
    base = await backend.scorer.score(IDS, 4)
    taught = await backend.scorer.score(IDS, 4, adapter="teacher-v1")
    expected = reference_scores(SHAPE, IDS, INIT, 4, adapter_path="teacher-path")
    np.testing.assert_allclose(taught.logprobs, [s.logprob for s in expected], rtol=1e-6)
    assert not np.allclose(taught.logprobs, base.logprobs)


@pytest.mark.parametrize("start", [0, len(IDS)])
async def test_a_start_outside_the_ids_is_refused_before_any_call(
    make_sim: SimFactory, backend_for: BackendFor, start: int
) -> None:
    backend = backend_for(await make_sim("vllm"), "vllm")
    with pytest.raises(ValueError, match="start must be in"):
        await backend.scorer.score(IDS, start)


@pytest.mark.parametrize(
    ("dialect", "answer"),
    [
        ("vllm", {"choices": [{"prompt_logprobs": None}]}),
        ("vllm", {"choices": [{"prompt_logprobs": [None, {"100": {"logprob": -1.0, "rank": 1}}]}]}),
        ("sglang", {"meta_info": {"input_token_logprobs": [[None, 5, None]]}}),
        ("sglang", {"meta_info": {}}),
    ],
    ids=["vllm-none", "vllm-short", "sglang-short", "sglang-missing"],
)
async def test_an_answer_that_does_not_cover_the_ids_is_a_protocol_error(
    backend_for: BackendFor, dialect: Dialect, answer: dict[str, Any]
) -> None:
    async with scripted_server(replying(orjson.dumps(answer))) as server:
        backend = backend_for(server, dialect)
        with pytest.raises(BackendProtocolError, match="teacher-0"):
            await backend.scorer.score(IDS, 2)
