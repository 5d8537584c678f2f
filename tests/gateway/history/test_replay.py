"""What a replay of the conversation may change (`gateway.history.replayed`): `strict` forgives a reply's reasoning
and empty fields, `loose` also what is serialization and not meaning, each kind named; an edit is never a replay."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.history import Forgiven, ReplayMatch, replayed

CALL = {
    "id": "call00001",
    "type": "function",
    "function": {"name": "weather", "arguments": '{"city": "Paris", "n": 2}'},
}
CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "Be terse."},
    {"role": "user", "content": "Paris?"},
    {"role": "assistant", "content": "", "reasoning_content": "Look it up.", "tool_calls": [CALL]},
]
RESULT = {"role": "tool", "tool_call_id": "call00001", "content": "18 C"}


def replay(assistant: dict[str, Any] | None = None, *, result: dict[str, Any] = RESULT, **changed: Any) -> list[Any]:
    """The conversation as an agent sends it back, with `assistant` for the reply and `changed` messages by index."""
    messages = [dict(m) for m in CONVERSATION]
    if assistant is not None:
        messages[2] = assistant
    for index, message in changed.items():
        messages[int(index.removeprefix("m"))] = message
    return [*messages, result]


def call(arguments: str = '{"city": "Paris", "n": 2}', call_id: str = "call00001") -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": "weather", "arguments": arguments}}


def test_a_byte_equal_replay_adds_its_new_messages_and_forgives_nothing() -> None:
    found = replayed(CONVERSATION, replay(CONVERSATION[2]))
    assert found is not None and found.added == [RESULT] and found.forgiven == set()


@pytest.mark.parametrize("match", ["strict", "loose"])
def test_a_reply_without_its_reasoning_or_empty_fields_is_a_replay_in_both_modes(match: ReplayMatch) -> None:
    found = replayed(CONVERSATION, replay({"role": "assistant", "tool_calls": [CALL]}), match)
    assert found is not None and found.added == [RESULT] and found.forgiven == {Forgiven.REASONING}


SERIALIZED: list[tuple[Forgiven, list[Any]]] = [
    (Forgiven.ARGUMENTS, replay({"role": "assistant", "tool_calls": [call('{"n":2,"city":"Paris"}')]})),
    (
        Forgiven.ARGUMENTS,
        replay(
            {
                "role": "assistant",
                "tool_calls": [{**CALL, "function": {"name": "weather", "arguments": {"n": 2, "city": "Paris"}}}],
            }
        ),
    ),
    (Forgiven.WHITESPACE, replay(CONVERSATION[2], m0={"role": "system", "content": " Be  terse.\n"})),
    (
        Forgiven.CONTENT_PARTS,
        replay(CONVERSATION[2], m1={"role": "user", "content": [{"type": "text", "text": "Paris?"}]}),
    ),
]


@pytest.mark.parametrize(("kind", "messages"), SERIALIZED, ids=[f"{k}-{i}" for i, (k, _) in enumerate(SERIALIZED)])
def test_loose_forgives_serialization_and_names_it_strict_does_not(kind: Forgiven, messages: list[Any]) -> None:
    found = replayed(CONVERSATION, messages, "loose")
    assert found is not None and found.added == [RESULT]
    assert found.forgiven - {Forgiven.REASONING} == {kind}
    assert replayed(CONVERSATION, messages, "strict") is None


def test_a_re_minted_tool_call_id_is_forgiven_and_the_result_renamed_back() -> None:
    """The agent's own id on the call and on its result: the result added is renamed to the id the conversation
    holds (the model's, which templates like Kimi's and Mistral's write back)."""
    messages = replay(
        {"role": "assistant", "tool_calls": [call(call_id="agent-7")]},
        result={"role": "tool", "tool_call_id": "agent-7", "content": "18 C"},
    )
    found = replayed(CONVERSATION, messages)
    assert found is not None and found.added == [RESULT]
    assert found.forgiven == {Forgiven.REASONING, Forgiven.TOOL_CALL_ID}
    assert replayed(CONVERSATION, messages, "strict") is None


def test_one_re_minted_id_cannot_stand_for_two_calls() -> None:
    conversation = [*CONVERSATION[:2], {"role": "assistant", "tool_calls": [call(), call(call_id="call00002")]}]
    both_as_one = [*conversation[:2], {"role": "assistant", "tool_calls": [call(call_id="a"), call(call_id="a")]}]
    assert replayed(conversation, [*both_as_one, RESULT]) is None


EDITS: list[tuple[str, list[Any]]] = [
    ("other arguments", replay({"role": "assistant", "tool_calls": [call('{"city": "Rome", "n": 2}')]})),
    ("unparsable arguments", replay({"role": "assistant", "tool_calls": [call("{city: Paris}")]})),
    ("other words", replay(CONVERSATION[2], m0={"role": "system", "content": "Be brief."})),
    ("a call dropped", replay({"role": "assistant", "content": "18 C"})),
    ("other role", replay(CONVERSATION[2], m0={"role": "user", "content": "Be terse."})),
    (
        "an image part",
        replay(CONVERSATION[2], m1={"role": "user", "content": [{"type": "image_url", "image_url": {}}]}),
    ),
    ("a turn removed", [*CONVERSATION[1:], RESULT]),
]


@pytest.mark.parametrize(("edit", "messages"), EDITS, ids=[edit for edit, _ in EDITS])
def test_an_edit_is_no_replay_even_loose(edit: str, messages: list[Any]) -> None:
    assert replayed(CONVERSATION, messages, "loose") is None


def test_added_messages_must_not_include_a_reply() -> None:
    assert replayed(CONVERSATION, [*CONVERSATION, {"role": "assistant", "content": "Hm."}]) is None
    assert replayed(CONVERSATION, CONVERSATION) is None  # nothing added
