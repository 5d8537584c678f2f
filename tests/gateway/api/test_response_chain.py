"""A chain of one-turn Responses (`previous_response_id`, no session named) stores each turn once (issue 52 §12: 70
turns stored 1,665 KiB, every record holding the whole conversation so far, against 169 KiB in a session). A record
holds its own messages and the response it continues; the conversation is read back link by link, by the process
that answered (its cache) or any other (Redis). Real simulator, real gateways, real Redis."""

from __future__ import annotations

from typing import Any

import httpx

from gateway.server import RunningGateway
from tests.conftest import GatewayFactory, SimFactory

ASK = {"model": "tiny", "max_output_tokens": 6, "temperature": 0}
A, B = "key-a", "key-b"


def question(turn: int) -> str:
    return f"question {turn}: " + "tell me more about it " * 8


async def chain(http: httpx.AsyncClient, url: str, turns: int, **extra: Any) -> list[dict[str, Any]]:
    """`turns` one-turn responses, each continuing the one before."""
    answers: list[dict[str, Any]] = []
    for turn in range(turns):
        body = ASK | {"input": question(turn), "instructions": "Answer briefly."} | extra.get("body", {})
        if answers:
            body["previous_response_id"] = answers[-1]["id"]
        response = await http.post(f"{url}/v1/responses", json=body, headers=extra.get("headers"))
        assert response.status_code == 200, response.text
        answers.append(response.json())
    return answers


async def stored_bytes(gw: RunningGateway, response_id: str) -> int:
    store = gw.services.store
    found: int = await store.client.strlen(store.keys.response(response_id))
    assert found > 0
    return found


def said(answer: dict[str, Any]) -> str:
    return "".join(part["text"] for item in answer["output"] for part in item.get("content", []))


async def conversation_of(gw: RunningGateway, answer: dict[str, Any]) -> list[Any]:
    """The contents of the conversation the turn of `answer` rendered and recorded, its reply included."""
    [sample] = await gw.services.store.load_samples(answer["rollout"]["session_id"])
    return [message.get("content") for message in sample.conversation]


def expected(answers: list[dict[str, Any]], then: str | None = None) -> list[Any]:
    """The conversation of the chain `answers`, with `then` asked after it."""
    contents: list[Any] = ["Answer briefly."]
    for turn, answer in enumerate(answers):
        contents += [question(turn), said(answer)]
    return contents + ([then] if then is not None else [])


async def test_a_chain_of_one_turn_responses_stores_each_turn_once(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """30 turns: each record holds about the same bytes (its own input and reply, and its answer), so the chain's
    total grows linearly; before, the 30th record held the 29 turns before it too."""
    gw = await make_gateway([await make_sim("vllm")])
    answers = await chain(http, gw.url, 30)
    sizes = [await stored_bytes(gw, answer["id"]) for answer in answers]
    assert max(sizes[1:]) < 1.25 * sizes[1], sizes
    assert sum(sizes) < 30 * 1.25 * sizes[1], sizes
    # The last turn rendered the whole chain, read from this process's cache.
    assert await conversation_of(gw, answers[-1]) == expected(answers)


async def test_a_chain_continues_and_reads_back_on_any_process(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """Another process, with no cache, walks the chain in Redis: continuing its last response or one in the middle
    (a branch) renders that response's whole conversation, and `GET` answers each response as it was answered."""
    gw = await make_gateway([await make_sim("vllm")])
    other = await make_gateway([gw.services.settings.replicas[0]], store={"response_cache_size": 0})
    answers = await chain(http, gw.url, 12)
    for answer in answers:
        for url in (gw.url, other.url):
            got = await http.get(f"{url}/v1/responses/{answer['id']}")
            assert got.status_code == 200, got.text
            assert got.json() == {key: value for key, value in answer.items() if key != "rollout"}
    for upto in (12, 5, 1):
        ask = ASK | {"input": "and then?", "previous_response_id": answers[upto - 1]["id"]}
        continued = await http.post(f"{other.url}/v1/responses", json=ask | {"instructions": "Answer briefly."})
        assert continued.status_code == 200, continued.text
        assert await conversation_of(gw, continued.json()) == [
            *expected(answers[:upto], "and then?"),
            said(continued.json()),
        ]
        # And the branch goes on: its own record links to the middle of the chain.
        after = ASK | {
            "input": "more",
            "previous_response_id": continued.json()["id"],
            "instructions": "Answer briefly.",
        }
        more = await http.post(f"{other.url}/v1/responses", json=after)
        assert await conversation_of(gw, more.json()) == [
            *expected(answers[:upto], "and then?"),
            said(continued.json()),
            "more",
            said(more.json()),
        ]


async def test_a_link_no_longer_stored_is_a_409_naming_it(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """A record lives its TTL from its own write: a chain whose middle expired cannot be rebuilt from Redis, and says
    which response is gone. The process that answered last still has the chain in its cache."""
    gw = await make_gateway([await make_sim("vllm")])
    other = await make_gateway([gw.services.settings.replicas[0]], store={"response_cache_size": 0})
    answers = await chain(http, gw.url, 4)
    store = gw.services.store
    await store.client.delete(store.keys.response(answers[1]["id"]))
    ask = ASK | {"input": "next", "previous_response_id": answers[-1]["id"]}
    refused = await http.post(f"{other.url}/v1/responses", json=ask)
    assert refused.status_code == 409, refused.text
    error = refused.json()["error"]
    assert error["param"] == "previous_response_id" and answers[1]["id"] in error["message"], error
    assert (await http.post(f"{gw.url}/v1/responses", json=ask)).status_code == 200


async def test_a_chain_stays_its_keys(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """Every link belongs to the key that made the chain: another key neither reads one nor continues one."""
    gw = await make_gateway([await make_sim("vllm")], server={"api_keys": [A, B]})
    answers = await chain(http, gw.url, 3, headers={"Authorization": f"Bearer {A}"})
    for answer in answers:
        theirs = await http.get(f"{gw.url}/v1/responses/{answer['id']}", headers={"Authorization": f"Bearer {B}"})
        assert theirs.status_code == 404, theirs.text
        ask = ASK | {"input": "x", "previous_response_id": answer["id"]}
        stolen = await http.post(f"{gw.url}/v1/responses", json=ask, headers={"Authorization": f"Bearer {B}"})
        assert stolen.status_code == 400 and stolen.json()["error"]["code"] == "previous_response_not_found"
    ask = ASK | {"input": "x", "previous_response_id": answers[-1]["id"]}
    mine = await http.post(f"{gw.url}/v1/responses", json=ask, headers={"Authorization": f"Bearer {A}"})
    assert mine.status_code == 200, mine.text
