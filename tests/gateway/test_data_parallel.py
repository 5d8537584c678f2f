"""Data-parallel ranks as routing targets (issue 51 §2), over real simulator replicas that run two ranks behind one
server, a real gateway and a real Redis: a replica with `data_parallel_size: 2` is two targets, `<id>@dp0` and
`<id>@dp1`; each request is pinned to its target's rank (vLLM's `X-data-parallel-rank` header, SGLang's
`routed_dp_rank`), which the simulator's per-rank counters show; load is read per rank; and a weight update pauses,
loads and resumes the engine once, after which every rank serves the new version."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx
import pytest

from backends.base import EngineBackend, ReplicaSpec, SamplingParams
from backends.factory import create_backend
from backends.sim.engine import EngineSettings
from backends.sim.server import SimReplica
from gateway.config import ReplicaConfig
from gateway.routing import rank_id
from gateway.server import RunningGateway
from tests.conftest import ADMIN, GatewayFactory, SimFactory
from tests.gateway_helpers import Streamed, expected_tokens, generate_body, publish, slow, stream_generate
from tests.sim_helpers import gateway_transport, sim_state, wait_for

DIALECTS = ["vllm", "sglang"]
LOAD_READS = {"load_interval_s": 0.05}


def dp_config(sim: SimReplica, size: int = 2) -> ReplicaConfig:
    return ReplicaConfig(url=sim.url, backend="sim", dialect=sim.dialect, data_parallel_size=size)  # type: ignore[arg-type]


def two_ranks(dialect: str, delay: float = 0.0) -> tuple[str, EngineSettings]:
    """A simulator of `dialect` running two data-parallel ranks (slowed by `delay` seconds per token)."""
    return slow(dialect, delay, data_parallel_size=2)


def prompt_of(index: int) -> list[int]:
    """A prompt of its own length per index, so that the tokens a rank counts tell which prompts it ran."""
    return [(index * 37 + i * 11) % 1900 + 20 for i in range(5 + index)]


async def rank_prompt_tokens(http: httpx.AsyncClient, sim: SimReplica) -> list[int]:
    """The prompt tokens each rank of `sim` was sent so far."""
    return [rank["counters"].get("prompt_tokens", 0) for rank in (await sim_state(http, sim.url))["ranks"]]


async def turn(http: httpx.AsyncClient, gw: RunningGateway, session: str, prompt: list[int]) -> str:
    """One turn of `session`; the routing target that served it."""
    response = await http.post(f"{gw.url}/generate", json=generate_body(prompt, 2, session_id=session))
    assert response.status_code == 200, response.text
    (target,) = response.json()["replicas"]
    assert isinstance(target, str)
    return target


@contextlib.asynccontextmanager
async def held_on_rank(backend: EngineBackend, rank: int, count: int) -> AsyncIterator[None]:
    """`count` long requests sent straight to the engine (not through the gateway), pinned to `rank`; cancelled on
    exit."""

    async def hold(index: int) -> None:
        sampling = SamplingParams(max_tokens=3_000, ignore_eos=True)
        chunks = backend.generate(prompt_of(index), sampling, f"held-{rank}-{index}", dp_rank=rank)
        async with contextlib.aclosing(chunks):
            async for _ in chunks:
                pass

    tasks = [asyncio.create_task(hold(index)) for index in range(count)]
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def adapter(sim: SimReplica, transport: bool = True) -> EngineBackend:
    """The gateway's adapter of `sim` as a two-rank engine: the gateway's generation transport, or aiohttp's."""
    spec = ReplicaSpec(
        id="direct", url=sim.url, data_parallel_size=2, generation_transport=gateway_transport() if transport else None
    )
    return create_backend("sim", spec, sim.dialect)  # type: ignore[arg-type]


# -- the adapters: pinned requests, load per rank ------------------------------------------------------------------


@pytest.mark.parametrize("transport", [True, False], ids=["gateway-transport", "aiohttp"])
@pytest.mark.parametrize("dialect", DIALECTS)
async def test_an_adapter_pins_each_request_to_its_rank_and_reads_each_ranks_load(
    make_sim: SimFactory, http: httpx.AsyncClient, dialect: str, transport: bool
) -> None:
    """Streamed and whole answers reach the rank they name; `load()` reports each rank's running requests apart."""
    sim = await make_sim(*two_ranks(dialect, 0.01))
    backend = adapter(sim, transport)
    try:
        for rank, stream in ((1, True), (0, False), (1, False)):
            before = await rank_prompt_tokens(http, sim)
            chunks = backend.generate(prompt_of(rank), SamplingParams(max_tokens=2), f"r{rank}{stream}", dp_rank=rank)
            async with contextlib.aclosing(chunks):
                assert [chunk async for chunk in chunks][-1].finish_reason == "length"
            after = await rank_prompt_tokens(http, sim)
            sent = [len(prompt_of(rank)) if r == rank else 0 for r in range(2)]
            assert [a - b for a, b in zip(after, before, strict=True)] == sent
        async with held_on_rank(backend, 1, 3):
            await wait_for(lambda: sim.engine.ranks[1].num_running == 3, what="three requests running on rank 1")
            load = await backend.load()
            assert load.running == 3 and sorted(load.ranks) == [0, 1]
            assert (load.ranks[0].running, load.ranks[1].running) == (0, 3)
    finally:
        await backend.aclose()


# -- placement over ranks ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_sessions_spread_over_the_ranks_each_pinned_and_sticking_to_its_rank(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient, dialect: str
) -> None:
    """Sixteen sessions on one two-rank replica: both ranks are targets and get sessions; every request ran on the
    rank its target names (each rank's prompt tokens are exactly those of the prompts sent to it), and a session's
    second turn goes to its first turn's rank."""
    sim = await make_sim(*two_ranks(dialect))
    gw = await make_gateway([dp_config(sim)])
    engine_id = sim.url.removeprefix("http://")
    targets = [rank_id(engine_id, rank) for rank in range(2)]
    assert sorted(r.id for r in gw.services.pool.all()) == targets
    sent = dict.fromkeys(targets, 0)
    homes = {}
    for index in range(16):
        homes[index] = await turn(http, gw, f"s{index}", prompt_of(index))
        sent[homes[index]] += len(prompt_of(index))
    assert set(homes.values()) == set(targets)
    for index, home in homes.items():
        follow_up = prompt_of(index) + [7, 8]
        assert await turn(http, gw, f"s{index}", follow_up) == home
        sent[home] += len(follow_up)
    assert await rank_prompt_tokens(http, sim) == [sent[target] for target in targets]
    assert gw.services.pool.affinity.ratio == 1.0


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_least_loaded_spreads_streams_over_the_ranks(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient, dialect: str
) -> None:
    sim = await make_sim(*two_ranks(dialect, 0.01))
    gw = await make_gateway([dp_config(sim)], routing={"policy": "least_loaded"})
    pool = gw.services.pool
    tasks = []
    async with httpx.AsyncClient(timeout=60) as client:
        for index in range(4):
            body = generate_body(prompt_of(index), 3_000, session_id=f"s{index}")
            tasks.append(asyncio.create_task(stream_generate(client, gw.url, body)))
            await wait_for(lambda n=index + 1: sum(r.in_flight for r in pool.all()) == n, what="the stream placed")
        try:
            assert sorted(r.in_flight for r in pool.all()) == [2, 2]
            await wait_for(lambda: [rank.num_running for rank in sim.engine.ranks] == [2, 2], what="2 on each rank")
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_a_rank_loaded_by_others_is_avoided_and_a_session_moves_off_it(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient, dialect: str
) -> None:
    """`sticky_least_loaded` reads each rank's load from the engine: requests sent to one rank by someone else (not
    this gateway, so only the engine's report shows them) make it loaded; a new session goes to the other rank, and a
    session placed on the loaded one moves there at its next turn."""
    sim = await make_sim(*two_ranks(dialect, 0.01))
    gw = await make_gateway([dp_config(sim)], routing={"policy": "sticky_least_loaded", "load_bound": 2} | LOAD_READS)
    pool = gw.services.pool
    home_id = await turn(http, gw, "placed", prompt_of(1))
    home = pool.get(home_id)
    assert home is not None and home.rank is not None
    (other,) = (r for r in pool.all() if r is not home)
    backend = adapter(sim)
    try:
        async with held_on_rank(backend, home.rank, 4):
            await wait_for(lambda: home.load > 2 and other.load == 0, what="the engine's report of the loaded rank")
            assert home.in_flight == 0 and home.kv_usage is not None
            assert await turn(http, gw, "newcomer", prompt_of(2)) == other.id
            assert await turn(http, gw, "placed", prompt_of(1) + [7]) == other.id
    finally:
        await backend.aclose()
    assert pool.affinity.moved == 1


# -- weights: once per engine ----------------------------------------------------------------------------------------


async def placed_streams(
    client: httpx.AsyncClient, gw: RunningGateway, total: int, progress: list[list[int]]
) -> list[asyncio.Task[Streamed]]:
    """A stream of `total` tokens per progress counter, placed one after the other (under `least_loaded`, each on a
    target of its own while there are idle ones)."""
    pool = gw.services.pool
    tasks = []
    for index, counter in enumerate(progress):
        body = generate_body(prompt_of(index), total, session_id=f"u{index}")
        tasks.append(asyncio.create_task(stream_generate(client, gw.url, body, counter)))
        await wait_for(lambda n=index + 1: sum(r.in_flight for r in pool.all()) == n, what="the stream placed")
    return tasks


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_an_update_pauses_and_loads_a_data_parallel_replica_once_and_every_rank_serves_it(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient, dialect: str
) -> None:
    """Streams on both ranks of a two-rank replica (beside a one-rank one) when version 1 is published: the engine is
    paused once and loads once; both targets run version 1; every stream resumes on its rank and its tokens are
    exactly those of the versions that sampled them."""
    dp_sim = await make_sim(*two_ranks(dialect, 0.005))
    single = await make_sim(*slow(dialect, 0.005))
    gw = await make_gateway([dp_config(dp_sim), single], routing={"policy": "least_loaded"})
    total, progress = 300, [[0] for _ in range(3)]
    async with httpx.AsyncClient(timeout=60) as client:
        tasks = await placed_streams(client, gw, total, progress)
        await wait_for(lambda: all(counter[0] >= 10 for counter in progress), what="tokens before the update")
        update = await publish(http, gw.url, 1)
        assert update.status_code == 200, update.text
        results = await asyncio.gather(*tasks)
    engine_id = dp_sim.url.removeprefix("http://")
    targets = [rank_id(engine_id, rank) for rank in range(2)]
    assert sorted(update.json()["updated"]) == sorted([engine_id, single.url.removeprefix("http://")])
    for sim in (dp_sim, single):
        counters = (await sim_state(http, sim.url))["counters"]
        assert (counters["pauses"], counters["weight_loads"]) == (1, 1)
    placed = sorted(target for result in results for target in set(result.final["replicas"]))
    assert set(targets) <= set(placed)  # both ranks had a stream across the update
    for index, result in enumerate(results):
        assert result.error is None and result.final["finish_reason"] == "length"
        assert len(set(result.final["replicas"])) == 1  # resumed on its own target
        assert result.final["versions"][0] == 0 and result.final["versions"][-1] == 1
        assert result.output_ids == expected_tokens(prompt_of(index), result.final["versions"], total)
    status = (await http.get(f"{gw.url}/admin/status", headers=ADMIN)).json()
    ranks = {r["id"]: (r["rank"], r["version"], r["stale"]) for r in status["replicas"] if r["id"] in targets}
    assert ranks == {targets[0]: (0, 1, False), targets[1]: (1, 1, False)}


async def test_a_data_parallel_replica_added_at_run_time_is_its_ranks_and_removed_whole(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    first = await make_sim("vllm")
    gw = await make_gateway([first])
    await publish(http, gw.url, 1)
    newcomer = await make_sim(*two_ranks("sglang"))
    body = {"url": newcomer.url, "backend": "sim", "dialect": "sglang", "data_parallel_size": 2}
    added = await http.post(f"{gw.url}/admin/replicas", json=body, headers=ADMIN)
    assert added.status_code == 201, added.text
    engine_id = newcomer.url.removeprefix("http://")
    targets = [rank_id(engine_id, rank) for rank in range(2)]
    assert (added.json()["id"], added.json()["targets"], added.json()["version"]) == (engine_id, targets, 1)
    assert (await sim_state(http, newcomer.url))["counters"]["weight_loads"] == 1  # caught up once
    assert (await http.delete(f"{gw.url}/admin/replicas/{targets[0]}", headers=ADMIN)).status_code == 404
    assert (await http.delete(f"{gw.url}/admin/replicas/{engine_id}", headers=ADMIN)).status_code == 204
    assert [r.id for r in gw.services.pool.all()] == [first.url.removeprefix("http://")]
