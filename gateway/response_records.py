"""Stored Responses API answers, and the conversation a request continues when it names one (`previous_response_id`).

A response of a named session records where its conversation is, not the messages: the session, the sample its turn
was recorded in, and how many messages of that sample's conversation (`Sample.conversation`, in Redis) were its
input and its reply. The sample holds them already, and an episode of n responses costs Redis O(n), not O(n²); a
later turn that extends the sample leaves those first messages as they were, so the count still finds them. A
response of a one-turn session (no session named) records its whole conversation instead: that session ends with
its turn, and the trainer deletes its keys once it took it.

The record also holds the answer (for `GET /v1/responses/{id}`), and whether the conversation's first message is the
request's `instructions`: a request that names a previous response gives its own instructions, which replace those
(OpenAI's `instructions` are not carried over from the previous response).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from gateway.errors import Conflict, InvalidRequest, NotFound
from gateway.store.responses import ResponseKeys

__all__ = ["ResponseRecord", "ResponseRecords"]

Message = dict[str, Any]


@dataclass(frozen=True, slots=True)
class ResponseRecord:
    """What a stored response leaves (see the module docstring). `session_id` None: a one-turn session's, whose
    `conversation` is recorded whole."""

    answer: dict[str, Any]
    session_id: str | None
    sample: int
    messages: int
    instructions: bool
    conversation: list[Message] | None = None


class ResponseRecords:
    """Saves and finds stored responses (`ResponseKeys`)."""

    def __init__(self, keys: ResponseKeys) -> None:
        self._keys = keys

    async def save(self, response_id: str, record: ResponseRecord) -> None:
        await self._keys.save(response_id, orjson.dumps(record))  # orjson writes a dataclass (no deep copy)

    async def get(self, response_id: str) -> ResponseRecord:
        """The stored response; `NotFound` if there is none (never stored, `store: false`, or expired)."""
        raw = await self._keys.load(response_id)
        if raw is None:
            raise NotFound(f"Response with id '{response_id}' not found.", param="response_id")
        return ResponseRecord(**orjson.loads(raw))

    async def previous(self, response_id: str) -> ResponseRecord:
        """The response a request continues. Unknown: a 400 as OpenAI answers it (`previous_response_not_found`)."""
        try:
            return await self.get(response_id)
        except NotFound:
            raise InvalidRequest(
                f"Previous response with id '{response_id}' not found.",
                param="previous_response_id",
                code="previous_response_not_found",
            ) from None

    async def conversation(self, response_id: str, record: ResponseRecord) -> list[Message]:
        """The response's conversation, its input then its reply, without its instructions."""
        if record.conversation is not None:
            messages = record.conversation
        else:
            assert record.session_id is not None  # a record has one or the other
            stored = await self._keys.conversation(record.session_id, record.sample)
            if stored is None or len(stored) < record.messages:
                raise Conflict(
                    f"the conversation of response '{response_id}' is no longer stored (its session "
                    f"{record.session_id} ended)",
                    param="previous_response_id",
                )
            messages = stored[: record.messages]
        return messages[1:] if record.instructions else messages
