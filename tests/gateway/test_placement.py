"""Placement policies (issue 51 §2) over real simulator replicas, a real gateway and a real Redis: `cache_aware`
(the replica holding a prompt's prefix, unless it is loaded), `sticky_least_loaded` (a session moves off a loaded
replica), GRPO groups together (and spread where their replica has no room), placements released when sessions
finish, and two gateway processes that agree (one follows what the other recorded in Redis). Load is always real:
requests held on a slowed replica, some sent by another gateway, so only the engine's own report shows them."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from backends.sim.server import SimReplica
from common.hashing import string_key
from gateway.routing import Replica, ReplicaPool
from gateway.routing.load import least_loaded
from gateway.server import RunningGateway
from tests.conftest import GatewayFactory, SimFactory
from tests.gateway_helpers import generate_body, slow, stream_generate
from tests.sim_helpers import sim_state, wait_for

LOAD_READS = {"load_interval_s": 0.05}


def prompt_of(prefix: int, length: int = 48, suffix: int = 0) -> list[int]:
    """`length` ids shared by every prompt of `prefix`, then 8 of `suffix`'s own (ids inside the model's vocabulary)."""
    shared = [(prefix * 131 + i * 7) % 1900 + 20 for i in range(length)]
    return shared + [(suffix * 17 + i) % 1900 + 20 for i in range(8)]


async def turn(http: httpx.AsyncClient, gw: RunningGateway, session: str, prompt: list[int], **extra: Any) -> str:
    """One turn of `session` on `gw`; the replica that served it."""
    response = await http.post(f"{gw.url}/generate", json=generate_body(prompt, 2, session_id=session, **extra))
    assert response.status_code == 200, response.text
    replicas: list[str] = response.json()["replicas"]
    assert len(replicas) == 1
    return replicas[0]


def replica_of(gw: RunningGateway, sim: SimReplica) -> Replica:
    replica = gw.services.pool.get(sim.url.removeprefix("http://"))
    assert replica is not None
    return replica


def others(pool: ReplicaPool, replica: Replica) -> Iterator[Replica]:
    return (r for r in pool.all() if r is not replica)


@asynccontextmanager
async def busy(gw: RunningGateway, sessions: list[str]) -> AsyncIterator[None]:
    """Long streams of `sessions` through `gw`, all in flight (on `gw`'s pool) on entry, cancelled on exit."""
    async with httpx.AsyncClient(timeout=60) as client:
        tasks = [
            asyncio.create_task(stream_generate(client, gw.url, generate_body(prompt_of(90 + i), 3_000, session_id=s)))
            for i, s in enumerate(sessions)
        ]
        try:
            pool = gw.services.pool
            await wait_for(lambda: sum(r.in_flight for r in pool.all()) == len(sessions), what="the busy streams")
            yield
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task


# -- cache_aware ---------------------------------------------------------------------------------------------


async def test_cache_aware_places_a_new_session_where_its_prefix_is(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """Eight prefixes, each first sent by one session (placed by hand, four on each replica); a new session sharing
    one lands where it went (a policy blind to prefixes would put all eight there once in 256 runs), and so does
    the first session's second turn. The engine found the prefix cached."""
    sims = [await make_sim("vllm") for _ in range(2)]
    gw = await make_gateway(sims, routing={"policy": "cache_aware"} | LOAD_READS)
    ids = [sim.url.removeprefix("http://") for sim in sims]
    homes = {prefix: ids[prefix % 2] for prefix in range(8)}
    for prefix, home in homes.items():
        gw.services.pool.remember(f"first{prefix}", home)
        assert await turn(http, gw, f"first{prefix}", prompt_of(prefix)) == home
    hits_before = [(await sim_state(http, sim.url))["counters"]["prefix_cache_hits"] for sim in sims]
    for prefix, home in homes.items():
        assert await turn(http, gw, f"second{prefix}", prompt_of(prefix, suffix=1)) == home
        assert await turn(http, gw, f"first{prefix}", prompt_of(prefix, suffix=2)) == home  # its second turn
    for sim, before in zip(sims, hits_before, strict=True):
        hits = (await sim_state(http, sim.url))["counters"]["prefix_cache_hits"] - before
        assert hits == 4 * 2 * 48  # its four prefixes, each found whole by two requests
    trees = gw.services.pool.prefixes
    assert trees is not None and all(len(tree) > 0 for tree in trees.trees.values())


async def test_cache_aware_skips_a_replica_loaded_by_another_gateway(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """The replica holding the prefix serves requests of another gateway (so this one's in-flight count says
    nothing): its engine's report does, and a new session sharing the prefix goes to the other replica."""
    sims = [await make_sim("vllm") for _ in range(2)]
    gw = await make_gateway(sims, routing={"policy": "cache_aware", "load_bound": 2} | LOAD_READS)
    home_id = await turn(http, gw, "holder", prompt_of(1))
    home_sim = next(sim for sim in sims if sim.url.endswith(home_id))
    home = replica_of(gw, home_sim)
    assert await turn(http, gw, "sharer", prompt_of(1, suffix=1)) == home.id  # unloaded: the prefix wins
    await http.post(f"{home_sim.url}/sim/speed", json={"token_delay": 0.02})  # its streams stay in flight
    other_gw = await make_gateway([home_sim])
    async with busy(other_gw, [f"load{i}" for i in range(4)]):
        await wait_for(lambda: home.load > 2, what="the engine's report of the other gateway's requests")
        assert home.in_flight == 0  # none of this gateway's
        (other,) = others(gw.services.pool, home)
        assert await turn(http, gw, "newcomer", prompt_of(1, suffix=3)) == other.id


async def test_cache_aware_spreads_sessions_that_share_a_system_prompt(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """Eight sessions opening with one long prefix (a system prompt), each sent while the ones before are in flight:
    the prefix draws a session to a replica holding it only within the bounded load, so they spread over both
    replicas (an absolute bound of 32 requests above the least loaded piled all eight onto the first one)."""
    sims = [await make_sim(*slow("vllm", 0.02)) for _ in range(2)]
    gw = await make_gateway(sims, routing={"policy": "cache_aware"} | LOAD_READS)
    pool = gw.services.pool
    async with httpx.AsyncClient(timeout=60) as client:
        tasks: list[asyncio.Task[Any]] = []
        try:
            for i in range(8):
                body = generate_body(prompt_of(5, length=96, suffix=i), 400, session_id=f"agent{i}")
                tasks.append(asyncio.create_task(stream_generate(client, gw.url, body)))
                await wait_for(lambda n=i + 1: sum(r.in_flight for r in pool.all()) == n, what="the sessions so far")
            placed = Counter(pool.placements[f"agent{i}"] for i in range(8))
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    assert len(placed) == 2 and min(placed.values()) >= 3, placed


# -- sticky_least_loaded -------------------------------------------------------------------------------------


async def test_sticky_least_loaded_stays_then_moves_off_a_loaded_replica(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    sims = [await make_sim("vllm") for _ in range(2)]
    gw = await make_gateway(sims, routing={"policy": "sticky_least_loaded", "load_bound": 2} | LOAD_READS)
    pool = gw.services.pool
    first = await turn(http, gw, "s", prompt_of(1))
    assert await turn(http, gw, "s", prompt_of(1, suffix=1)) == first  # within the bound: it stays
    home_sim = next(sim for sim in sims if sim.url.endswith(first))
    home = replica_of(gw, home_sim)
    await http.post(f"{home_sim.url}/sim/speed", json={"token_delay": 0.02})
    other_gw = await make_gateway([home_sim])
    async with busy(other_gw, [f"load{i}" for i in range(4)]):
        await wait_for(lambda: home.load > 2, what="the engine's report of the other gateway's requests")
        (other,) = others(pool, home)
        assert await turn(http, gw, "s", prompt_of(1, suffix=2)) == other.id
    assert pool.affinity.moved == 1


async def test_the_default_policy_reads_no_engine_load(make_sim: SimFactory, make_gateway: GatewayFactory) -> None:
    gw = await make_gateway([await make_sim("vllm")])
    pool = gw.services.pool
    assert pool.loads is None and pool.prefixes is None
    await pool.check_health()
    assert all(r.engine_load is None for r in pool.all())


# -- GRPO groups ---------------------------------------------------------------------------------------------


async def members_at_once(
    http: httpx.AsyncClient, gw: RunningGateway, groups: int, size: int, max_tokens: int
) -> dict[str, set[str]]:
    """`groups` GRPO groups of `size` members, every member's first turn sent at once; each group's replicas."""

    async def member(group: int, index: int) -> tuple[str, list[str]]:
        body = generate_body(prompt_of(group), max_tokens, session_id=f"grp-g{group}-{index}of{size}")
        body["metadata"] = {"group_id": f"g{group}", "group_size": str(size)}
        response = await http.post(f"{gw.url}/generate", json=body)
        assert response.status_code == 200, response.text
        return f"g{group}", response.json()["replicas"]

    results = await asyncio.gather(*(member(g, i) for g in range(groups) for i in range(size)))
    placed: dict[str, set[str]] = {}
    for group, replicas in results:
        placed.setdefault(group, set()).update(replicas)
    return placed


async def test_group_members_sent_at_once_go_together(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """4 groups of 8 siblings sent at once to 2 replicas: each group on one replica (hashing each member's session
    split every group across both)."""
    sims = [await make_sim(*slow("vllm", 0.005)) for _ in range(2)]
    gw = await make_gateway(sims)
    placed = await members_at_once(http, gw, groups=4, size=8, max_tokens=30)
    assert all(len(replicas) == 1 for replicas in placed.values()), placed


async def test_group_members_hashed_spread(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """`group_placement: hash`, the behaviour before: members placed by their own session ids split groups."""
    sims = [await make_sim(*slow("vllm", 0.005)) for _ in range(2)]
    gw = await make_gateway(sims, routing={"group_placement": "hash"})
    placed = await members_at_once(http, gw, groups=4, size=8, max_tokens=30)
    assert any(len(replicas) == 2 for replicas in placed.values()), placed


async def test_a_group_spreads_where_its_replica_has_no_room(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    sims = [await make_sim(*slow("vllm", 0.01)) for _ in range(2)]
    gw = await make_gateway(sims, routing={"load_bound": 2})
    placed = await members_at_once(http, gw, groups=1, size=8, max_tokens=200)
    assert len(placed["g0"]) == 2


async def test_a_burst_of_groups_takes_the_replicas_evenly(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """Eight groups of 8 members, every member sent at once, over 4 replicas: each group on one replica, and two
    groups on each replica. A group's first member takes the least loaded replica, counting the members still to
    come of the groups placed before it (placed by a hash of the group id, 8 groups fall 2-2-2-2 once in 26 runs)."""
    sims = [await make_sim(*slow("vllm", 0.01)) for _ in range(4)]
    gw = await make_gateway(sims)
    placed = await members_at_once(http, gw, groups=8, size=8, max_tokens=100)
    assert all(len(replicas) == 1 for replicas in placed.values()), placed
    per_replica = Counter(next(iter(replicas)) for replicas in placed.values())
    assert sorted(per_replica.values()) == [2, 2, 2, 2], per_replica


# -- release at finish ---------------------------------------------------------------------------------------


async def test_finished_sessions_release_their_placement(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    gw = await make_gateway([await make_sim("vllm") for _ in range(2)], routing={"policy": "cache_aware"})
    pool = gw.services.pool
    sessions = [f"s{i}" for i in range(5)]
    for session in sessions:
        await turn(http, gw, session, prompt_of(1))
    assert set(pool.placements) == set(sessions)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert (await http.post(f"{gw.url}/v1/chat/completions", json=chat)).status_code == 200  # a one-turn session
    group = chat | {"n": 2, "group": True}
    assert (await http.post(f"{gw.url}/v1/chat/completions", json=group)).status_code == 200  # placed as its base
    assert set(pool.placements) == set(sessions)
    for session in sessions:
        finished = await http.post(f"{gw.url}/v1/sessions/{session}/finish", json={"reward": 1.0})
        assert finished.status_code == 200
    assert not pool.placements


# -- several gateway processes -------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["cache_aware", "sticky_least_loaded", "sticky"])
async def test_a_second_gateway_follows_the_placement_recorded_in_redis(
    policy: str, make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """Each session's first turn goes through one gateway, placed (by hand) where the other would not put it; its
    second turn, through the other gateway, follows the placement recorded with the session in Redis."""
    sims = [await make_sim("vllm") for _ in range(2)]
    first = await make_gateway(sims, routing={"policy": policy} | LOAD_READS)
    second = await make_gateway(sims, routing={"policy": policy} | LOAD_READS)
    candidates = second.services.pool.candidates()
    for i in range(4):
        session = f"shared{i}"
        own_choice = least_loaded(candidates, string_key(session)).id  # what the second would choose, unloaded
        elsewhere = next(r.id for r in candidates if r.id != own_choice)
        first.services.pool.remember(session, elsewhere)
        assert await turn(http, first, session, prompt_of(i)) == elsewhere
        assert await turn(http, second, session, prompt_of(i, suffix=1)) == elsewhere


async def test_two_gateways_put_a_group_on_one_replica(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """Members of one group through two gateways meet on one replica: both place them by the group id."""
    sims = [await make_sim("vllm") for _ in range(2)]
    gateways = [await make_gateway(sims) for _ in range(2)]
    for group in range(4):
        replicas = set()
        for index in range(6):
            body = {"metadata": {"group_id": f"g{group}"}}
            replicas.add(await turn(http, gateways[index % 2], f"grp-g{group}-{index}", prompt_of(group), **body))
        assert len(replicas) == 1


async def test_a_group_follows_its_first_member_placed_by_another_gateway(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """A group's first member goes through one gateway; the others through a second gateway whose own loads would
    place the group elsewhere (its requests in flight load the first member's replica): they follow the group's
    replica as recorded in Redis."""
    sims = [await make_sim(*slow("vllm", 0.01)) for _ in range(2)]
    first, second = [await make_gateway(sims) for _ in range(2)]
    metadata = {"metadata": {"group_id": "g"}}
    home = await turn(http, first, "grp-g-0of4", prompt_of(7), **metadata)
    busy_sessions = ["load0", "load1"]
    for session in busy_sessions:
        second.services.pool.remember(session, home)
    async with busy(second, busy_sessions):
        (other,) = (r.id for r in second.services.pool.all() if r.id != home)
        assert second.services.pool.get(home).load > second.services.pool.get(other).load  # type: ignore[union-attr]
        for index in range(1, 4):
            assert await turn(http, second, f"grp-g-{index}of4", prompt_of(7), **metadata) == home
