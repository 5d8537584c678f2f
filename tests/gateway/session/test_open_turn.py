"""`OpenTurn` (gateway/session/open_turn.py) through the real `SessionLifecycle` of a running gateway, on real Redis:
a turn holds its session's lock and its caller's slot from `begin` until it closes, closes once however its block
ends, and a turn refused before it was handed over stores nothing."""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest

from gateway.errors import SessionNotFound
from gateway.server import RunningGateway
from gateway.session.lifecycle import owner_of
from gateway.turns.request import Sampling, TokenPrompt, TurnRequest
from tests.conftest import GatewayFactory, SimFactory


async def _gateway(make_sim: SimFactory, make_gateway: GatewayFactory) -> RunningGateway:
    return await make_gateway([await make_sim("vllm")])


def _held(gw: RunningGateway, session_id: str, key: str) -> tuple[bool, int]:
    """Whether the session's lock is held, and how many turns the key holds a slot for."""
    return gw.services.turns.sessions.lock(session_id).locked(), gw.services.quota.in_flight(key)


async def test_a_refused_turn_stores_nothing_and_releases_its_lock_and_slot_once(
    make_sim: SimFactory, make_gateway: GatewayFactory
) -> None:
    gw = await _gateway(make_sim, make_gateway)
    lifecycle = gw.services.turns.lifecycle
    turn = await lifecycle.begin("ot-refused", "key")
    assert _held(gw, "ot-refused", "key") == (True, 1)
    with pytest.raises(ValueError, match="the handler failed"):
        async with turn:
            raise ValueError("the handler failed")
    assert turn.closed
    assert _held(gw, "ot-refused", "key") == (False, 0)
    assert await gw.services.store.get_session("ot-refused") is None  # never adopted: nothing stored
    await turn.aclose()  # closing again does nothing
    assert _held(gw, "ot-refused", "key") == (False, 0)


async def test_a_second_turn_of_a_session_begins_once_the_first_closed(
    make_sim: SimFactory, make_gateway: GatewayFactory
) -> None:
    gw = await _gateway(make_sim, make_gateway)
    lifecycle = gw.services.turns.lifecycle
    first = await lifecycle.begin("ot-serial", "key")
    second = asyncio.create_task(lifecycle.begin("ot-serial", "key"))
    await asyncio.sleep(0.05)
    assert not second.done()  # waits on the session's lock
    await first.aclose()
    async with await asyncio.wait_for(second, 5):
        assert _held(gw, "ot-serial", "key") == (True, 1)
    assert _held(gw, "ot-serial", "key") == (False, 0)


async def test_a_turn_that_fails_to_begin_is_closed_there(make_sim: SimFactory, make_gateway: GatewayFactory) -> None:
    """Another key's session is a 404 at `begin`: the lock and the slot it took are released before it raises."""
    gw = await _gateway(make_sim, make_gateway)
    await gw.services.store.create_session({}, "ot-theirs", fresh=True, owner=owner_of("key-a"))
    with pytest.raises(SessionNotFound):
        await gw.services.turns.lifecycle.begin("ot-theirs", "key-b")
    assert _held(gw, "ot-theirs", "key-b") == (False, 0)


async def test_a_one_turn_session_refused_is_forgotten(make_sim: SimFactory, make_gateway: GatewayFactory) -> None:
    gw = await _gateway(make_sim, make_gateway)
    async with await gw.services.turns.lifecycle.begin(None, "key", kind="chat") as turn:
        assert turn.one_turn and turn.session_id.startswith("chat-")
        assert gw.services.turns.sessions.cached(turn.session_id)
    assert not gw.services.turns.sessions.cached(turn.session_id)
    assert await gw.services.store.get_session(turn.session_id) is None


async def test_a_recorded_turn_is_freed_when_dropped_not_left_to_the_cycle_collector(
    make_sim: SimFactory, make_gateway: GatewayFactory
) -> None:
    """The prepared turn holds its handle and the handle the turn it records: closing lets go, so a turn's token
    lists are freed as the request ends (a cycle kept every turn alive until the collector ran, at a measured CPU
    cost on every short request)."""
    gw = await _gateway(make_sim, make_gateway)
    runner = gw.services.turns
    request = TurnRequest(TokenPrompt([5, 6, 7], checked=True), Sampling(max_tokens=3, ignore_eos=True))
    gc.disable()
    try:
        prepared = await runner.prepare(request, "ot-freed", "key")
        await runner.run(prepared)
        await prepared.close()
        handle = weakref.ref(prepared.handle)
        del prepared
        await asyncio.sleep(0)  # the record task's done callbacks
        assert handle() is None
    finally:
        gc.enable()
    stored = await gw.services.store.get_session("ot-freed")
    assert stored is not None  # recorded
