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
