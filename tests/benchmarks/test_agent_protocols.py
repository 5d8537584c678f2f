"""The load generator's answer checks of the agent protocols (`benchmarks.agent_protocols`), on answers shaped by the
official SDKs' own models (each body and event is validated by the SDK before it is sent through the check), so the
checks read the wire shapes the standards define, whole and streamed; and the wrong answers each check must refuse."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from benchmarks.agent_protocols import AGENT_APIS, AnswerError, read_answer, request_body, sse_events

TEXT = ("hi", " there", "!")
BUDGET = 3
USAGE = {
    "input_tokens": 5,
    "output_tokens": BUDGET,
    "total_tokens": 5 + BUDGET,
    "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
    "output_tokens_details": {"reasoning_tokens": 0},
}


def response(status: str = "incomplete", output_tokens: int = BUDGET) -> dict[str, Any]:
    body = {
        "id": "resp_1",
        "object": "response",
        "created_at": 1,
        "model": "tiny",
        "status": status,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "output": [
            {
                "type": "message",
                "id": "msg_1",
                "role": "assistant",
                "status": status,
                "content": [{"type": "output_text", "text": "".join(TEXT), "annotations": []}],
            }
        ],
        "parallel_tool_calls": False,
        "tool_choice": "auto",
        "tools": [],
        "usage": {**USAGE, "output_tokens": output_tokens},
    }
    return Response.model_validate(body).model_dump(mode="json")


def whole(api: str, output_tokens: int = BUDGET, ended: str = "budget") -> bytes:
    """A whole answer of `api`, checked by the SDK's model of it."""
    if api == "chat":
        reason = "length" if ended == "budget" else "stop"
        body: dict[str, Any] = {
            "id": "c",
            "object": "chat.completion",
            "created": 1,
            "model": "tiny",
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "".join(TEXT)}, "finish_reason": reason}
            ],
            "usage": {"prompt_tokens": 5, "completion_tokens": output_tokens, "total_tokens": 5 + output_tokens},
        }
        return ChatCompletion.model_validate(body).model_dump_json().encode()
    if api == "messages":
        body = {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "model": "tiny",
            "content": [{"type": "text", "text": "".join(TEXT)}],
            "stop_reason": "max_tokens" if ended == "budget" else "end_turn",
            "stop_sequence": None,
            "usage": {"input_tokens": 5, "output_tokens": output_tokens},
        }
        return Message.model_validate(body).model_dump_json().encode()
    return orjson.dumps(response("incomplete" if ended == "budget" else "completed", output_tokens))


def events(api: str, output_tokens: int = BUDGET) -> list[bytes]:
    """A streamed answer of `api` as server-sent events, each event checked by the SDK's model of it."""
    if api == "chat":
        chunk = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "tiny"}
        out = [{**chunk, "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]} for text in TEXT]
        out.append({**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
        usage = {"prompt_tokens": 5, "completion_tokens": output_tokens, "total_tokens": 5 + output_tokens}
        out.append({**chunk, "choices": [], "usage": usage})
        for event in out:
            ChatCompletionChunk.model_validate(event)
        return [b"data: " + orjson.dumps(e) + b"\n\n" for e in out] + [b"data: [DONE]\n\n"]
    if api == "messages":
        start = orjson.loads(whole("messages"))
        start.update(content=[], stop_reason=None, usage={"input_tokens": 5, "output_tokens": 0})
        out = [
            {"type": "message_start", "message": start},
            {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
            *({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": t}} for t in TEXT),
            {"type": "content_block_stop", "index": 0},
            {
                "type": "message_delta",
                "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
                "usage": {"output_tokens": output_tokens},
            },
            {"type": "message_stop"},
        ]
        adapter: TypeAdapter[Any] = TypeAdapter(RawMessageStreamEvent)
        for event in out:
            adapter.validate_python(event)
        return [f"event: {e['type']}\n".encode() + b"data: " + orjson.dumps(e) + b"\n\n" for e in out]
    final = response(output_tokens=output_tokens)
    delta = {"item_id": "msg_1", "output_index": 0, "content_index": 0, "logprobs": []}
    out = [
        {"type": "response.created", "response": {**final, "status": "in_progress"}, "sequence_number": 0},
        *(
            {"type": "response.output_text.delta", **delta, "delta": t, "sequence_number": i + 1}
            for i, t in enumerate(TEXT)
        ),
        {"type": "response.incomplete", "response": final, "sequence_number": len(TEXT) + 1},
    ]
    adapter = TypeAdapter(ResponseStreamEvent)
    for event in out:
        adapter.validate_python(event)
    return [f"event: {e['type']}\n".encode() + b"data: " + orjson.dumps(e) + b"\n\n" for e in out]


def arrived(chunks: list[bytes]) -> list[tuple[float, bytes]]:
    """The stream as reads that split events (one read ends mid-event), each read at its own time."""
    raw = b"".join(chunks)
    cuts = [0, 7, len(raw) // 2, len(raw)]
    return [(float(i), raw[a:b]) for i, (a, b) in enumerate(zip(cuts, cuts[1:], strict=False))]


@pytest.mark.parametrize("api", AGENT_APIS)
def test_a_whole_answer_gives_its_tokens_and_text(api: str) -> None:
    reply = read_answer(api, 200, [(0.0, whole(api))], stream=False, budget=BUDGET)
    assert (reply.tokens, reply.first, reply.text) == (BUDGET, None, "hi there!")
    assert reply.response_id == ("resp_1" if api == "responses" else None)  # what a chained turn names next


@pytest.mark.parametrize("api", AGENT_APIS)
def test_a_streamed_answer_gives_its_tokens_text_and_first_text_time(api: str) -> None:
    reply = read_answer(api, 200, arrived(events(api)), stream=True, budget=BUDGET)
    assert (reply.tokens, reply.text) == (BUDGET, "hi there!")
    assert reply.response_id == ("resp_1" if api == "responses" else None)
    assert reply.first is not None and reply.first >= 1.0  # the first text is not in the first read (7 bytes)


@pytest.mark.parametrize("api", AGENT_APIS)
def test_wrong_answers_are_errors(api: str) -> None:
    with pytest.raises(AnswerError, match="asked 3 tokens, got 2"):
        read_answer(api, 200, [(0.0, whole(api, output_tokens=2))], stream=False, budget=BUDGET)
    with pytest.raises(AnswerError, match="asked 3 tokens, got 2"):
        read_answer(api, 200, arrived(events(api, output_tokens=2)), stream=True, budget=BUDGET)
    with pytest.raises(AnswerError, match="asked 3 tokens"):  # ended before its budget: not what was asked
        read_answer(api, 200, [(0.0, whole(api, ended="naturally"))], stream=False, budget=BUDGET)
    with pytest.raises(AnswerError, match="HTTP 400"):
        read_answer(api, 400, [(0.0, b'{"error": {"message": "bad"}}')], stream=False, budget=BUDGET)
    cut_short = events(api)[:-2]  # the stream stopped before its end (no usage, no reason)
    with pytest.raises(AnswerError, match="asked 3 tokens, got None"):
        read_answer(api, 200, arrived(cut_short), stream=True, budget=BUDGET)


@pytest.mark.parametrize(
    ("api", "event"),
    [
        ("chat", b'data: {"error": {"message": "engine failed"}}\n\n'),
        ("messages", b'event: error\ndata: {"type": "error", "error": {"type": "api_error", "message": "x"}}\n\n'),
        ("responses", b'event: error\ndata: {"type": "error", "code": "x", "message": "x", "sequence_number": 1}\n\n'),
    ],
)
def test_an_error_event_in_a_stream_is_an_error(api: str, event: bytes) -> None:
    with pytest.raises(AnswerError, match="error event"):
        read_answer(api, 200, arrived([*events(api)[:2], event]), stream=True, budget=BUDGET)


def test_each_turn_sends_the_whole_conversation_with_the_protocols_budget_field() -> None:
    conversation = [("user", "bench-2-0 hello"), ("assistant", "hi"), ("user", "more")]
    turns = [{"role": r, "content": t} for r, t in conversation]
    chat, messages, responses = (request_body(api, conversation, 7, stream=True) for api in AGENT_APIS)
    assert chat["messages"] == turns and chat["max_tokens"] == 7 and chat["stream_options"] == {"include_usage": True}
    assert messages["messages"] == turns and messages["max_tokens"] == 7 and "ignore_eos" not in messages
    assert responses["input"] == turns and responses["max_output_tokens"] == 7
    chained = request_body("responses", conversation, 7, stream=False, previous_response_id="resp_1")
    assert chained["input"] == turns[-1:] and chained["previous_response_id"] == "resp_1"
    with pytest.raises(ValueError, match="unknown agent api"):
        request_body("completions", conversation, 7, stream=False)


def test_events_are_read_across_reads_and_without_event_lines() -> None:
    raw = b': comment\n\ndata: {"a": 1}\n\nevent: x\ndata: {"b": 2}\n\ndata: [DONE]\n\n'
    assert [event for _, event in sse_events([(0.0, raw[:20]), (1.0, raw[20:])])] == [{"a": 1}, {"b": 2}]
