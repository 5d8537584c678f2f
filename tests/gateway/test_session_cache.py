"""The per-process cache of sessions (`SessionManager`, issue 38 §16): bounded by estimated bytes, least recently
used out first, a finished session out at once; an evicted session's next turn reads it back from Redis."""

from __future__ import annotations

import gc
import random
import tracemalloc

import httpx
from redis.asyncio import Redis

from gateway.server import RunningGateway
from gateway.session.samples import PROMPT_TOKEN_BYTES, RESPONSE_TOKEN_BYTES, SESSION_BYTES, SessionManager
from gateway.store import Keys, TrajectoryStore
from tests.conftest import GatewayFactory, SimFactory
from tests.gateway.test_session_samples import SYSTEM, TOKENIZER, record_reply, user
from tests.gateway_helpers import generate_body

PROMPT_TOKENS, OUT = 100, 4
ENTRY = SESSION_BYTES + PROMPT_TOKENS * PROMPT_TOKEN_BYTES + OUT * RESPONSE_TOKEN_BYTES  # a one-turn session


def prompt(session: str) -> list[int]:
    return [10 + ord(session[0]) % 50 + i % 7 for i in range(PROMPT_TOKENS)]


async def turn(http: httpx.AsyncClient, gw: RunningGateway, session: str, ids: list[int]) -> list[int]:
    """One /generate turn of `session`; the ids it ends with (prompt + sampled)."""
    response = await http.post(f"{gw.url}/generate", json=generate_body(ids, OUT, session_id=session))
    assert response.status_code == 200, response.text
    return ids + response.json()["output_ids"]


async def test_finishing_a_session_drops_it_from_the_cache(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    gw = await make_gateway([await make_sim("vllm")])
    sessions = gw.services.turns.sessions
    await turn(http, gw, "kept", prompt("kept"))
    await turn(http, gw, "done", prompt("done"))
    assert sessions.cached("done") and sessions.cached_bytes == 2 * ENTRY
    finished = await http.post(f"{gw.url}/v1/sessions/done/finish", json={"reward": 1.0})
    assert finished.status_code == 200
    assert not sessions.cached("done") and sessions.cached("kept")
    assert sessions.cached_bytes == ENTRY and sessions.evictions == 0


async def test_the_byte_bound_evicts_the_least_recently_used_session_which_still_works(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    # Room for two sessions of one turn plus a second turn of one of them (6 response tokens more), not for three.
    bound = 2 * ENTRY + 6 * RESPONSE_TOKEN_BYTES
    gw = await make_gateway([await make_sim("vllm")], store={"session_cache_bytes": bound})
    sessions = gw.services.turns.sessions
    ids = {name: await turn(http, gw, name, prompt(name)) for name in ("a", "b")}
    ids["a"] = await turn(http, gw, "a", ids["a"] + [5, 6])  # "a" used last: "b" is the least recently used
    assert sessions.cached("a") and sessions.cached("b") and sessions.evictions == 0
    ids["c"] = await turn(http, gw, "c", prompt("c"))
    assert not sessions.cached("b") and sessions.cached("a") and sessions.cached("c")
    assert sessions.evictions == 1 and sessions.cached_bytes <= bound

    # The evicted session's next turn reads it back from Redis and extends its sample, as if it had stayed.
    ids["b"] = await turn(http, gw, "b", ids["b"] + [5, 6])
    stored = (await http.get(f"{gw.url}/v1/sessions/b")).json()
    assert [s["num_turns"] for s in stored["samples"]] == [2]
    assert stored["samples"][0]["prompt_tokens"] + stored["samples"][0]["response_tokens"] == len(ids["b"])
    assert sessions.cached("b") and sessions.cached_bytes <= bound


async def test_the_estimate_bounds_what_cached_chat_sessions_hold(redis: Redis) -> None:
    """`store.session_cache_bytes` bounds memory only if the estimate (`_footprint`) is at least what a cached session
    really holds: chat sessions of a few turns (ids above the small ints python shares), their conversation, its
    rendering, measured by tracemalloc, take no more than the estimate, and not so much less that the bound would
    keep a fraction of the sessions it could (token ids held as python lists cost about 40 bytes a token)."""
    store = TrajectoryStore(redis, Keys(), sweep_interval_s=None)
    sessions = SessionManager(TOKENIZER, store)
    rng = random.Random(7)
    vocabulary = ["alpha", "gamma", "kettle", "window", "seventeen", "orbit", "lantern", "quiet", "marble", "river"]

    def words(count: int) -> str:
        return " ".join(rng.choice(vocabulary) for _ in range(count))

    async def chat(session_id: str) -> None:
        messages = [SYSTEM, user(f"{session_id} {words(64)}")]
        for _ in range(4):
            turn = await sessions.begin_chat_turn(session_id, messages, None)
            reply = words(24)
            record_reply(sessions, turn, reply)
            messages = [*messages, {"role": "assistant", "content": reply}, user(words(32))]

    await chat("warm")  # the tokenizer's and template's own caches, before the count
    gc.collect()
    tracemalloc.start()
    try:
        before, estimated = tracemalloc.get_traced_memory()[0], sessions.cached_bytes
        for number in range(100):
            await chat(f"held-{number}")
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    estimated = sessions.cached_bytes - estimated
    assert sessions.cached_sessions == 101
    assert held <= estimated, f"a session holds {held / 100:.0f} bytes, estimated {estimated / 100:.0f}"
    assert held >= estimated / 3, f"a session holds {held / 100:.0f} bytes, estimated {estimated / 100:.0f}"
