"""`gateway.weights.state`: the coordinator's transition table, proven from real scenarios.

Each scenario runs over real simulator replicas, real HTTP and the session's Redis, and asserts the exact set of
transitions the coordinator's machine took (`StateMachine.taken`); `SCENARIOS` names them, and the last test checks
that together they reach every transition of `TRANSITIONS` (one the table lists but no scenario reaches fails it).
The out-of-band sync's deadline, and the wire format of the bus's typed events, are tested here too."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import httpx
import orjson
import pytest

import gateway.routing
import gateway.weights
from gateway.embedded_redis import EmbeddedRedis
from gateway.errors import Conflict, WeightsUpdateTimedOut
from gateway.store import Commit, Drained, Keys, Pausing, Serving, WeightsBus, connect
from gateway.store.weights_events import parse_event
from gateway.weights import TRANSITIONS, IllegalTransition, State, StateMachine, UpdateReport
from gateway.weights.state import all_transitions
from tests.conftest import ADMIN, GatewayFactory, SimFactory
from tests.gateway_helpers import PROMPT, expected_tokens, generate_body, publish, slow, stream_generate, weights_of
from tests.sim_helpers import sim_state, wait_for

S, PG, PD, U, R, F = State.SERVING, State.PAUSING, State.PAUSED, State.UPDATING, State.RESUMING, State.FOLLOWING
T = State.TRANSFERRING

UPDATE = {(S, PG), (PG, U), (U, R), (R, S)}
OUT_OF_BAND = {(S, PG), (PG, PD), (PD, U), (U, R), (R, S)}

SCENARIOS: dict[str, set[tuple[State, State]]] = {
    "an update (updated, partial or failed)": UPDATE,
    "an out-of-band sync, resumed or ended at its deadline": OUT_OF_BAND,
    # tests/gateway/test_weight_transfer.py
    "an in-memory transfer, committed or ended at its deadline": {(S, PG), (PG, T), (T, U), (U, R), (R, S)},
    "an update whose pause outlasts weights.update_timeout_s": {(S, PG), (PG, S)},
    "an update whose load outlasts weights.update_timeout_s": {(S, PG), (PG, U), (U, S)},
    "following another process's update": {(S, F), (F, S)},
    "recovering from an update whose coordinator died": {(S, F), (F, PG), (PG, U), (U, R), (R, S)},
}


def replica_id(url: str) -> str:
    return url.removeprefix("http://")


async def until_subscribed(redis_server: EmbeddedRedis, processes: int) -> None:
    """Wait until `processes` gateway processes listen on the control channel: an event sent before one subscribed
    would not reach it (a scenario of its own, made up for elsewhere)."""
    client = connect(redis_server.url)
    try:

        async def subscribed() -> bool:
            [(_, count)] = await client.pubsub_numsub(Keys().control)
            return int(count) >= processes

        await wait_for(subscribed, what=f"{processes} processes on the control channel")
    finally:
        await client.aclose()


# -- the table -------------------------------------------------------------------------------------------------------


def test_an_illegal_transition_is_refused_and_changes_nothing() -> None:
    machine = StateMachine()
    with pytest.raises(IllegalTransition, match="from serving to resuming"):
        machine.to(State.RESUMING)
    assert machine.state is State.SERVING and machine.taken == set()
    machine.to(State.PAUSING)
    machine.to(State.PAUSED)
    with pytest.raises(IllegalTransition):  # an out-of-band sync ends through the update sequence, never at once
        machine.to(State.SERVING)
    assert machine.state is State.PAUSED and machine.taken == {(S, PG), (PG, PD)}


def test_the_packages_export_what_they_name() -> None:
    for package in (gateway.weights, gateway.routing):
        assert all(hasattr(package, name) for name in package.__all__), package.__name__


def test_every_state_has_a_row_and_the_scenarios_reach_every_transition() -> None:
    assert set(TRANSITIONS) == set(State)
    reached = set().union(*SCENARIOS.values())
    assert reached == all_transitions(), (all_transitions() - reached, reached - all_transitions())


# -- updates ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("outcome", "status"), [("updated", 200), ("partial", 207), ("failed", 502)])
async def test_an_update_runs_the_sequence(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient, outcome: str, status: int
) -> None:
    good = await make_sim("vllm", weights_must_exist=outcome == "failed")
    bad = await make_sim("vllm", weights_must_exist=outcome != "updated")
    gw = await make_gateway([good, bad], routing={"health_interval_s": 30})
    response = await publish(http, gw.url, 1)
    assert response.status_code == status, response.text
    assert gw.services.weights.machine.taken == SCENARIOS["an update (updated, partial or failed)"]
    assert gw.services.weights.state is State.SERVING


async def test_an_update_whose_pause_outlasts_its_deadline_ends_serving(
    make_sim: SimFactory, make_gateway: GatewayFactory
) -> None:
    sim = await make_sim("vllm")
    gw = await make_gateway([sim], weights={"update_timeout_s": 0.3})
    async with httpx.AsyncClient() as client:
        await client.post(f"{sim.url}/sim/faults", json={"pause_delay": 2.0})
    weights = gw.services.weights
    with pytest.raises(WeightsUpdateTimedOut, match="did not finish within weights.update_timeout_s"):
        await weights.update(1, "ckpt-1")
    assert weights.machine.taken == SCENARIOS["an update whose pause outlasts weights.update_timeout_s"]
    assert (weights.state, weights.version, weights.serving) == (State.SERVING, 0, True)


async def test_an_update_whose_load_outlasts_its_deadline_ends_serving(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    sim = await make_sim("sglang")
    gw = await make_gateway([sim], weights={"update_timeout_s": 1.0})
    await http.post(f"{sim.url}/sim/faults", json={"load_delay": 4.0})
    weights = gw.services.weights
    answer = await http.post(f"{gw.url}/admin/weights", json={"version": 1, "path": "ckpt-1"}, headers=ADMIN)
    assert answer.status_code == 504, answer.text
    error = answer.json()["error"]
    assert error["code"] == "weights_update_timed_out" and error["version"] == 0 and error["requested_version"] == 1
    assert weights.machine.taken == SCENARIOS["an update whose load outlasts weights.update_timeout_s"]
    assert (weights.state, weights.version, weights.serving) == (State.SERVING, 0, True)


# -- the out-of-band sync ------------------------------------------------------------------------------------------


async def test_an_out_of_band_sync_holds_no_lock_and_turns_other_updates_away(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    sim = await make_sim("vllm")
    gw = await make_gateway([sim])
    assert (await http.post(f"{gw.url}/admin/pause", json={}, headers=ADMIN)).status_code == 200
    weights = gw.services.weights
    assert weights.state is State.PAUSED and not weights.lock.locked()  # nothing held across the requests
    for path, body in (("/admin/weights", {"version": 1, "path": "ckpt-1"}), ("/admin/pause", {})):
        refused = await http.post(f"{gw.url}{path}", json=body, headers=ADMIN)
        assert refused.status_code == 409 and "out-of-band" in refused.json()["error"]["message"], refused.text
    assert (await http.post(f"{gw.url}/admin/resume", json={"version": 0}, headers=ADMIN)).status_code == 409
    assert weights.state is State.PAUSED  # a version that is not newer leaves it paused
    resumed = await http.post(f"{gw.url}/admin/resume", json={"version": 1}, headers=ADMIN)
    assert resumed.status_code == 200 and resumed.json()["updated"] == [replica_id(sim.url)]
    assert weights.machine.taken == SCENARIOS["an out-of-band sync, resumed or ended at its deadline"]
    assert (await sim_state(http, sim.url))["version"] == "1"


async def test_an_out_of_band_sync_past_its_deadline_ends_as_a_failed_update(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """The trainer never resumes (it died): past `weights.update_timeout_s` the sync ends as a failed update. The
    replica whose label still shows the served version resumes on it; the one relabelled behind the gateway's back
    (its weights unknown) is held out; the request held meanwhile finishes under the served version; a late resume
    is a 409 saying why."""
    kept, odd = await make_sim(*slow("vllm")), await make_sim("vllm")
    gw = await make_gateway([kept, odd], weights={"update_timeout_s": 2.0}, routing={"health_interval_s": 30})
    weights = gw.services.weights
    reports: list[UpdateReport] = []
    weights.on_update.append(reports.append)
    total, progress = 60, [0]
    streaming = asyncio.create_task(stream_generate(http, gw.url, generate_body(PROMPT, total), progress))
    await wait_for(lambda: progress[0] >= 10, what="tokens before the pause")
    paused_at = time.monotonic()
    assert (await http.post(f"{gw.url}/admin/pause", json={"mode": "abort"}, headers=ADMIN)).status_code == 200
    assert (await http.post(f"{odd.url}/update_weight_version", json={"new_version": "7"})).status_code == 200

    await wait_for(lambda: weights.state is State.SERVING, timeout=6.0, what="the sync ended at its deadline")
    assert time.monotonic() - paused_at >= 2.0
    assert weights.machine.taken == SCENARIOS["an out-of-band sync, resumed or ended at its deadline"]
    assert weights.version == 0 and len(reports) == 1
    report = reports[0]
    assert (report.status, report.version, report.kept, report.stale) == (
        "failed",
        0,
        [replica_id(kept.url)],
        [replica_id(odd.url)],
    )
    assert "reports version '7'" in report.errors[replica_id(odd.url)]
    stale = {r.id: (r.stale, r.version) for r in gw.services.pool.all()}
    assert stale == {replica_id(kept.url): (False, 0), replica_id(odd.url): (True, 0)}
    for sim in (kept, odd):
        assert (await sim_state(http, sim.url))["paused"] is False

    result = await streaming
    assert result.error is None and result.final["versions"] == [0] * total
    assert result.output_ids == expected_tokens(PROMPT, [0] * total, total)
    late = await http.post(f"{gw.url}/admin/resume", json={"version": 1}, headers=ADMIN)
    assert late.status_code == 409 and "not resumed within 2 s" in late.json()["error"]["message"], late.text
    with pytest.raises(Conflict, match="not resumed within"):
        await weights.resume(1)
    # A new sync works as before.
    assert (await http.post(f"{gw.url}/admin/pause", json={}, headers=ADMIN)).status_code == 200
    assert (await http.post(f"{gw.url}/admin/resume", json={"version": 1}, headers=ADMIN)).status_code == 200
    assert weights.version == 1


# -- several gateway processes -------------------------------------------------------------------------------------


async def test_a_follower_follows_another_processs_update(
    make_sim: SimFactory, make_gateway: GatewayFactory, redis_server: EmbeddedRedis, http: httpx.AsyncClient
) -> None:
    sim = await make_sim("vllm")
    leader, follower = await make_gateway([sim]), await make_gateway([sim])
    await until_subscribed(redis_server, 2)
    assert (await publish(http, leader.url, 1)).status_code == 200
    await wait_for(lambda: follower.services.weights.version == 1, what="the follower adopting v1")
    assert leader.services.weights.machine.taken == SCENARIOS["an update (updated, partial or failed)"]
    assert follower.services.weights.machine.taken == SCENARIOS["following another process's update"]


@contextlib.asynccontextmanager
async def dying_coordinator(redis_server: EmbeddedRedis, version: int, ttl_s: float) -> AsyncIterator[WeightsBus]:
    """The test as a process that takes the update lock, announces `pausing`, and dies (its one heartbeat expires
    after `ttl_s`; nothing more is sent)."""
    await until_subscribed(redis_server, 1)
    client = connect(redis_server.url)
    bus = WeightsBus(client, Keys(), origin="doomed-coordinator")
    try:
        await bus.join(ttl_s=ttl_s)
        token = bus.new_token()
        assert await bus.acquire(token, ttl_s=60)
        await bus.announce(Pausing(version, "abort", token))
        yield bus
    finally:
        await client.aclose()


async def test_a_follower_recovers_from_an_update_whose_coordinator_died(
    make_sim: SimFactory, make_gateway: GatewayFactory, redis_server: EmbeddedRedis, http: httpx.AsyncClient
) -> None:
    sim = await make_sim("vllm")
    follower = await make_gateway([sim], weights={"member_ttl_s": 1.0})
    weights = follower.services.weights
    async with dying_coordinator(redis_server, 1, ttl_s=0.5) as bus:
        await wait_for(lambda: weights.state is State.FOLLOWING, what="the follower following the update")
        await wait_for(lambda: weights.state is State.SERVING, timeout=10.0, what="the follower recovering")
        assert await bus.holder() is None  # the lock it took over, given back
        record = await bus.read()
    assert record is not None and (record.version, record.updated) == (0, (replica_id(sim.url),))
    assert weights.machine.taken == SCENARIOS["recovering from an update whose coordinator died"]
    body = (await http.post(f"{follower.url}/generate", json=generate_body(PROMPT, 3))).json()
    assert body["versions"] == [0, 0, 0]


async def drop_subscriptions(redis_server: EmbeddedRedis) -> None:
    """Close every control-channel subscription on the server, as a Redis restart does: each process subscribes again,
    and whatever the channel carried meanwhile never reached it."""
    client = connect(redis_server.url)
    try:
        await client.client_kill_filter(_type="pubsub")
    finally:
        await client.aclose()


async def test_a_result_sent_while_a_process_was_not_subscribed_is_adopted_when_it_subscribes_again(
    make_sim: SimFactory, make_gateway: GatewayFactory, redis_server: EmbeddedRedis, http: httpx.AsyncClient
) -> None:
    """A `keep` update flushes no cache: a process that missed its result would go on salting the engine's cache
    with the old version, reuse KV computed under the old weights, and label the tokens with the new one. It adopts
    the result as soon as its subscription is back (here with no health probe to notice the engine's version)."""
    sim = await make_sim("vllm")
    follower = await make_gateway([sim], routing={"health_interval_s": 60.0})
    # The update runs from a process on another bus (its own key prefix), so the follower hears nothing of it: as a
    # process whose subscription was down while it ran.
    updater = await make_gateway([sim], store={"prefix": "elsewhere"})
    prompt = list(range(100, 140))  # two full blocks of the engine's prefix cache
    first = (await http.post(f"{follower.url}/generate", json=generate_body(prompt, 4))).json()
    assert first["output_ids"] == expected_tokens(prompt, [0] * 4, 4)  # cached under version 0's salt and weights
    assert (await publish(http, updater.url, 1, mode="keep")).status_code == 200
    client = connect(redis_server.url)
    try:
        bus = WeightsBus(client, Keys(), origin="the-missed-coordinator")
        await bus.record(1, "serving", weights_of(1)[0], [replica_id(sim.url)], [])  # what its coordinator recorded
    finally:
        await client.aclose()
    assert follower.services.weights.version == 0
    await drop_subscriptions(redis_server)
    await wait_for(lambda: follower.services.weights.version == 1, what="the follower adopting the recorded v1")
    answer = (await http.post(f"{follower.url}/generate", json=generate_body(prompt, 4))).json()
    assert (answer["output_ids"], answer["versions"]) == (expected_tokens(prompt, [1] * 4, 4), [1] * 4)


async def test_an_update_that_began_while_a_process_was_not_subscribed_is_followed_when_it_subscribes_again(
    make_sim: SimFactory, make_gateway: GatewayFactory, redis_server: EmbeddedRedis, http: httpx.AsyncClient
) -> None:
    sim = await make_sim("vllm")
    follower = await make_gateway([sim], routing={"health_interval_s": 60.0}, weights={"member_ttl_s": 1.0})
    weights = follower.services.weights
    client = connect(redis_server.url)
    try:
        bus = WeightsBus(client, Keys(), origin="a-coordinator")
        await bus.join(ttl_s=30.0)
        token = bus.new_token()
        assert await bus.acquire(token, ttl_s=60)  # its `pausing` is never heard here
        await drop_subscriptions(redis_server)
        await wait_for(lambda: weights.state is State.FOLLOWING, what="the follower following the unheard update")
        held = asyncio.create_task(http.post(f"{follower.url}/generate", json=generate_body(PROMPT, 3)))
        await asyncio.sleep(0.3)
        assert not held.done()  # no dispatch while the update runs
        await bus.release(token)  # the update ends, its `serving` unheard too: read from `rg:weights`
        await wait_for(lambda: weights.state is State.SERVING, what="the follower serving again")
        assert (await held).json()["output_ids"] == expected_tokens(PROMPT, [0] * 3, 3)
    finally:
        await client.aclose()
    assert weights.machine.taken == SCENARIOS["following another process's update"]


async def test_a_wait_update_that_began_while_a_process_was_not_subscribed_has_it_drain_and_report(
    make_sim: SimFactory, make_gateway: GatewayFactory, redis_server: EmbeddedRedis, http: httpx.AsyncClient
) -> None:
    """The lock says what the missed `pausing` said, `wait` mode included: the process reports its requests drained
    as soon as it subscribes again (here `pausing` never goes out again)."""
    sim = await make_sim("vllm")
    follower = await make_gateway([sim], routing={"health_interval_s": 60.0})
    weights = follower.services.weights
    assert weights.bus is not None
    client = connect(redis_server.url)
    try:
        bus = WeightsBus(client, Keys(), origin="a-coordinator")
        await bus.join(ttl_s=30.0)
        token = bus.new_token()
        assert await bus.acquire(token, ttl_s=60, update=Pausing(1, "wait", token))  # its `pausing` never heard here
        await drop_subscriptions(redis_server)
        await wait_for(lambda: weights.state is State.FOLLOWING, what="the follower following the unheard update")

        async def reported() -> bool:
            return weights.bus is not None and weights.bus.origin in await bus.drained(token)

        await wait_for(reported, what="the follower reporting its requests drained")
        await bus.release(token)
        await wait_for(lambda: weights.state is State.SERVING, what="the follower serving again")
    finally:
        await client.aclose()
    assert weights.machine.taken == SCENARIOS["following another process's update"]


async def test_a_process_started_while_an_update_runs_recovers_from_its_coordinators_death_as_a_follower_does(
    make_sim: SimFactory, make_gateway: GatewayFactory, redis_server: EmbeddedRedis, http: httpx.AsyncClient
) -> None:
    """The lock says which version the update loads: a process started mid-update follows it as if it had heard its
    `pausing`, and once the coordinator died (its last heartbeat two TTLs ago) takes the lock over and recovers,
    rather than waiting `weights.update_timeout_s` (600 s). The coordinator here loaded version 1 and recorded it,
    then died without announcing it or letting the lock go: the new process serves version 1 and labels its tokens
    with it."""
    ttl_s = 1.0
    sim = await make_sim("vllm")
    loader = await make_gateway([sim], store={"prefix": "elsewhere"})  # the coordinator's load, unheard here
    client = connect(redis_server.url)
    try:
        bus = WeightsBus(client, Keys(), origin="doomed-coordinator")
        await bus.join(ttl_s=30.0)
        token = bus.new_token()
        assert await bus.acquire(token, ttl_s=60, update=Pausing(1, "abort", token))
        started = await make_gateway([sim], routing={"health_interval_s": 60.0}, weights={"member_ttl_s": ttl_s})
        weights = started.services.weights
        assert weights.state is State.FOLLOWING  # from its start on
        assert (await publish(http, loader.url, 1)).status_code == 200
        await bus.record(1, "serving", weights_of(1)[0], [replica_id(sim.url)], [])
        await bus.join(ttl_s=ttl_s)  # its last heartbeat: it dies
        died = time.monotonic()
        heartbeat_s = weights.heartbeat_s
        await wait_for(
            lambda: weights.state is State.SERVING, timeout=2 * ttl_s + 3 * heartbeat_s + 3, what="it recovering"
        )
        recovered_s = time.monotonic() - died
        assert 2 * ttl_s - heartbeat_s - 0.5 < recovered_s, recovered_s  # not before the coordinator counts as dead
        assert await bus.holder() is None  # the lock it took over, given back
        record = await bus.read()
    finally:
        await client.aclose()
    assert record is not None and (record.version, record.updated) == (1, (replica_id(sim.url),))
    assert weights.machine.taken == SCENARIOS["recovering from an update whose coordinator died"]
    assert weights.version == 1
    body = (await http.post(f"{started.url}/generate", json=generate_body(PROMPT, 3))).json()
    assert (body["output_ids"], body["versions"]) == (expected_tokens(PROMPT, [1] * 3, 3), [1] * 3)


async def test_a_process_started_while_an_update_runs_serves_only_after_it(
    make_sim: SimFactory, make_gateway: GatewayFactory, redis_server: EmbeddedRedis, http: httpx.AsyncClient
) -> None:
    """A process (re)started mid-update missed its `pausing`: it reads the engines' versions from before the load,
    and must not dispatch with them while the update runs. The lock here is bare, as a gateway of an older release
    takes it: the update is followed all the same, its version unknown."""
    sim = await make_sim("vllm")
    client = connect(redis_server.url)
    try:
        bus = WeightsBus(client, Keys(), origin="a-coordinator")
        await bus.join(ttl_s=30.0)
        token = bus.new_token()
        assert await bus.acquire(token, ttl_s=60)
        started = await make_gateway([sim], routing={"health_interval_s": 60.0}, weights={"member_ttl_s": 1.0})
        weights = started.services.weights
        assert weights.state is State.FOLLOWING  # from its start on
        held = asyncio.create_task(http.post(f"{started.url}/generate", json=generate_body(PROMPT, 3)))
        await asyncio.sleep(0.3)
        assert not held.done()
        await bus.release(token)
        await wait_for(lambda: weights.state is State.SERVING, what="the new process serving")
        assert (await held).json()["output_ids"] == expected_tokens(PROMPT, [0] * 3, 3)
    finally:
        await client.aclose()


# -- the bus's events on the wire ------------------------------------------------------------------------------------


def test_the_typed_events_keep_the_wire_format() -> None:
    """Gateways of two releases share a bus during a rolling deploy: the objects are those sent before the events
    were typed, and what an older gateway sends (no token, an unknown kind) still reads."""
    assert Pausing(3, "wait", "p.t").to_wire() == {"event": "pausing", "version": 3, "mode": "wait", "token": "p.t"}
    assert Drained("p.t").to_wire() == {"event": "drained", "token": "p.t"}
    serving = Serving(3, "ckpt-3", "partial", ("a",), ("b",))
    assert serving.to_wire() == {
        "event": "serving",
        "version": 3,
        "source": "ckpt-3",
        "status": "partial",
        "updated": ["a"],
        "stale": ["b"],
    }
    # Fields added since go on the wire only when set: a transfer's version in its lock, the lock in a result, and
    # the relayed commit (a kind an older gateway skips).
    transfer, answered = Pausing(None, "keep", "p.t", transfer=4), Serving(4, token="p.t")
    assert transfer.to_wire() == {"event": "pausing", "version": None, "mode": "keep", "token": "p.t", "transfer": 4}
    assert answered.to_wire()["token"] == "p.t" and "token" not in serving.to_wire()
    assert Commit(4, "p.t").to_wire() == {"event": "commit", "version": 4, "token": "p.t"}
    events = (Pausing(3, "wait", "p.t"), Drained("p.t"), serving, Pausing(None, "abort", None), transfer, answered)
    for event in (*events, Commit(4, "p.t")):
        assert parse_event(orjson.loads(orjson.dumps(event.to_wire() | {"origin": "x"}))) == event
    assert parse_event({"event": "pausing", "version": 2, "mode": "abort"}) == Pausing(2, "abort", None)
    assert parse_event({"event": "serving", "version": 2}) == Serving(2)
    assert parse_event({"event": "something-new"}) is None and parse_event({"event": "drained"}) is None
    assert parse_event({"event": "commit", "version": 4}) is None
