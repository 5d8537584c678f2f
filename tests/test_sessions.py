"""The session manager's cache of samples, over the real trajectory store (embedded Redis).

A turn runs as `TurnRunner` runs it: take the session's lock, `begin_*_turn`, generate, `record`, save the
sample, release the lock. The cache is LRU-bounded; these tests make it tiny so that other sessions evict one
while its turn is in flight.
"""

from __future__ import annotations

from redis.asyncio import Redis

from backends.base import SamplingParams
from gateway.config import DEFAULT_TOKENIZER
from gateway.generation import GenerationRequest, GenerationState
from gateway.sessions import SessionManager, Turn
from gateway.store import Keys, TrajectoryStore
from gateway.tokenization import ChatTokenizer

TOKENIZER = ChatTokenizer.load(DEFAULT_TOKENIZER)


def sampled(turn: Turn, output_ids: list[int]) -> GenerationState:
    request = GenerationRequest("r", turn.prompt_ids, SamplingParams(max_tokens=len(output_ids)))
    state = GenerationState(request, output_ids=list(output_ids), logprobs=[-0.5] * len(output_ids))
    state.versions = [0] * len(output_ids)
    state.finish_reason = "length"
    return state


async def finish_turn(sessions: SessionManager, store: TrajectoryStore, turn: Turn, output_ids: list[int]) -> None:
    sample = sessions.record(turn, sampled(turn, output_ids), None)
    await store.save_sample(turn.session_id, turn.sample.index, sample)


async def one_turn(sessions: SessionManager, store: TrajectoryStore, session_id: str, prompt: list[int]) -> Turn:
    async with sessions.lock(session_id):
        turn = await sessions.begin_completion_turn(session_id, prompt)
        await finish_turn(sessions, store, turn, [7, 8])
    return turn


async def test_a_session_evicted_from_the_cache_during_its_turn_keeps_every_sample(redis: Redis) -> None:
    store = TrajectoryStore(redis, Keys(), sweep_interval_s=None)
    sessions = SessionManager(TOKENIZER, store, cache_size=1)
    for session_id in ("a", "b"):
        await store.ensure_session(session_id, {})
    await one_turn(sessions, store, "a", [1, 2, 3])  # sample 0

    lock = sessions.lock("a")
    async with lock:
        second = await sessions.begin_completion_turn("a", [4, 5, 6])  # extends nothing: sample 1
        await one_turn(sessions, store, "b", [9, 9])  # another session's turn meanwhile: "a" leaves the cache
        await finish_turn(sessions, store, second, [10, 11])
    assert second.sample.index == 1
    third = await one_turn(sessions, store, "a", [12, 13])  # a third unrelated prompt: sample 2, not 1 again

    assert third.sample.index == 2
    stored = await store.load_samples("a")
    assert [s.prompt_ids.tolist() for s in stored] == [[1, 2, 3], [4, 5, 6], [12, 13]]


async def test_a_session_with_a_turn_in_flight_keeps_its_lock_when_evicted(redis: Redis) -> None:
    store = TrajectoryStore(redis, Keys(), sweep_interval_s=None)
    sessions = SessionManager(TOKENIZER, store, cache_size=1)
    for session_id in ("a", "b"):
        await store.ensure_session(session_id, {})
    lock = sessions.lock("a")
    async with lock:
        await sessions.begin_completion_turn("a", [1, 2, 3])
        await one_turn(sessions, store, "b", [9, 9])
        assert sessions.lock("a") is lock  # a second turn of "a" would wait for this one
