"""The per-process cache of sessions (`SessionManager`, issue 38 §16): bounded by estimated bytes, least recently
used out first, a finished session out at once; an evicted session's next turn reads it back from Redis."""

from __future__ import annotations

import httpx

from gateway.server import RunningGateway
from gateway.session.samples import PROMPT_TOKEN_BYTES, RESPONSE_TOKEN_BYTES, SESSION_BYTES
from tests.conftest import GatewayFactory, SimFactory
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
