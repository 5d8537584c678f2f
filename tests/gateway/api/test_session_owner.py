"""A session belongs to the API key that created it (issue 38 §6: with `server.api_keys` set, key B read, extended and
finished a session key A created; A's later finish answered 200 and its reward was dropped). Another key gets a
404 on every route, as if the session did not exist, and changes nothing. Real simulator, gateway and Redis."""

from __future__ import annotations

from typing import Any

import httpx

from tests.conftest import GatewayFactory, SimFactory
from tests.gateway_helpers import generate_body

A, B = "sk-key-a-0123456789", "sk-key-b-9876543210"
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def key(token: str, session: str | None = None) -> dict[str, str]:
    headers = {"Authorization": f"Bearer {token}"}
    return headers | ({"X-Session-ID": session} if session else {})


async def test_another_key_sees_no_session_of_this_one(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    gw = await make_gateway([await make_sim("vllm")], server={"api_keys": [A, B]})
    url = gw.url
    assert (await http.post(f"{url}/v1/sessions", json={"session_id": "made"}, headers=key(A))).status_code == 201
    for session in ("made", "by-turn"):  # made by POST /v1/sessions, or by a first turn
        assert (await http.post(f"{url}/v1/chat/completions", json=CHAT, headers=key(A, session))).status_code == 200
    by_generate = generate_body([1, 2, 3], 2, session_id="by-generate")
    assert (await http.post(f"{url}/generate", json=by_generate, headers=key(A))).status_code == 200

    for session in ("made", "by-turn", "by-generate"):
        attempts: list[tuple[str, str, dict[str, Any] | None, dict[str, str]]] = [
            ("GET", f"/v1/sessions/{session}", None, key(B)),
            ("POST", "/v1/chat/completions", CHAT, key(B, session)),
            ("POST", f"/sessions/{session}/v1/chat/completions", CHAT, key(B)),
            ("POST", "/generate", generate_body([1, 2, 3], 2, session_id=session), key(B)),
            ("POST", f"/v1/sessions/{session}/finish", {"reward": 999.0}, key(B)),
        ]
        for method, path, body, headers in attempts:
            response = await http.request(method, f"{url}{path}", json=body, headers=headers)
            assert response.status_code == 404, (session, path, response.text)
            assert response.json()["error"]["param"] == "session_id"
        taken = await http.post(f"{url}/v1/sessions", json={"session_id": session}, headers=key(B))
        assert taken.status_code == 409
        mine = (await http.get(f"{url}/v1/sessions/{session}", headers=key(A))).json()
        assert mine["status"] == "active" and [s["num_turns"] for s in mine["samples"]] == [1]  # B changed nothing
        finish = await http.post(f"{url}/v1/sessions/{session}/finish", json={"reward": 0.5}, headers=key(A))
        assert finish.status_code == 200 and finish.json()["delivered"]
        assert (await http.get(f"{url}/v1/sessions/{session}", headers=key(A))).json()["reward"] == 0.5


async def test_without_api_keys_sessions_are_open_to_every_caller(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    gw = await make_gateway([await make_sim("vllm")])
    assert (await http.post(f"{gw.url}/v1/chat/completions", json=CHAT, headers={"X-Session-ID": "open"})).is_success
    assert (await http.get(f"{gw.url}/v1/sessions/open", headers={"Authorization": "Bearer anything"})).is_success


async def test_another_key_sees_no_stored_response_of_this_one(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """A stored response belongs to the key that created it (issue 52 §5: key B read key A's response and continued
    it): B's `GET` is A's 404 for an unknown id, and B's `previous_response_id` the 400 an unknown id gets, whether
    A's turn was a one-turn session's or a named one's. A keeps both."""
    gw = await make_gateway([await make_sim("vllm")], server={"api_keys": [A, B]})
    ask = {"model": "tiny", "input": "hi", "max_output_tokens": 2}
    one_turn = await http.post(f"{gw.url}/v1/responses", json=ask, headers=key(A))
    named = await http.post(f"{gw.url}/v1/responses", json=ask, headers=key(A, "responses-of-a"))
    unknown_id = "resp_" + "0" * 32
    unknown_get = await http.get(f"{gw.url}/v1/responses/{unknown_id}", headers=key(A))
    unknown_next = await http.post(
        f"{gw.url}/v1/responses", json=ask | {"previous_response_id": unknown_id}, headers=key(B)
    )
    assert unknown_get.status_code == 404 and unknown_next.status_code == 400

    for made in (one_turn, named):
        assert made.status_code == 200, made.text
        response_id = made.json()["id"]
        for path in (f"/v1/responses/{response_id}", f"/sessions/elsewhere/v1/responses/{response_id}"):
            theirs = await http.get(f"{gw.url}{path}", headers=key(B))
            assert theirs.status_code == 404, theirs.text[:300]
            assert theirs.json()["error"]["type"] == unknown_get.json()["error"]["type"]
            assert made.json()["output"][0]["id"] not in theirs.text
        after = ask | {"previous_response_id": response_id}
        continued = await http.post(f"{gw.url}/v1/responses", json=after, headers=key(B))
        assert continued.status_code == 400, continued.text
        assert continued.json()["error"]["code"] == unknown_next.json()["error"]["code"]
        assert continued.json()["error"]["code"] == "previous_response_not_found"
        mine = await http.get(f"{gw.url}/v1/responses/{response_id}", headers=key(A))
        assert mine.status_code == 200 and mine.json()["output"] == made.json()["output"]
        again = await http.post(f"{gw.url}/v1/responses", json=after, headers=key(A))
        assert again.status_code == 200, again.text
