"""Stored Responses API answers, and the conversation a request continues when it names one (`previous_response_id`).

A response of a named session records where its conversation is, not the messages: the session, the sample its turn
was recorded in, and how many messages of that sample's conversation (`Sample.conversation`, in Redis) were its
input and its reply. The sample holds them already, and an episode of n responses costs Redis O(n), not O(n²); a
later turn that extends the sample leaves those first messages as they were, so the count still finds them. A
response of a one-turn session (no session named) records its whole conversation instead: that session ends with
its turn, and the trainer deletes its keys once it took it.

A response belongs to the API key that created it (`owner`, as `SessionMeta.owner`): to another key it is not
there, neither to `GET` nor to `previous_response_id`, as another key's session is not (`check_owner`); without API
keys (no owner) responses are open to all.

The record also holds the answer (for `GET /v1/responses/{id}`), and whether the conversation's first message is the
request's `instructions`: a request that names a previous response gives its own instructions, which replace those
(OpenAI's `instructions` are not carried over from the previous response).

Each process keeps its latest stored responses with their conversations (`ResponseCache`): an agent's chained turn
that comes back to the process that answered the one before (sticky balancing, one gateway) starts without a Redis
read. A record never changes once stored, and the first messages of a sample's conversation neither, so a cached one
is the stored one; a chained turn on another process reads Redis as before.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.errors import Conflict, InvalidRequest, NotFound
from gateway.store.responses import ResponseKeys

__all__ = ["ResponseCache", "ResponseRecord", "ResponseRecords"]

Message = dict[str, Any]


@dataclass(frozen=True, slots=True)
class ResponseRecord:
    """What a stored response leaves (see the module docstring). `session_id` None: a one-turn session's, whose
    `conversation` is recorded whole; `owner`: the key id that created it (None: made without API keys, and records
    stored before owners were)."""

    answer: dict[str, Any]
    session_id: str | None
    sample: int
    messages: int
    instructions: bool
    conversation: list[Message] | None = None
    owner: str | None = None


class ResponseCache:
    """The responses this process stored last, each with its conversation (its input then its reply, its
    instructions included): at most `size` (least recently used out first), none kept longer than `ttl_s`, Redis's
    lifetime of the record. The records and messages are shared with their readers, who must not change them."""

    def __init__(self, size: int, ttl_s: float) -> None:
        self.size = size
        self.ttl_s = ttl_s
        self._entries: OrderedDict[str, tuple[float, ResponseRecord, list[Message]]] = OrderedDict()

    def put(self, response_id: str, record: ResponseRecord, conversation: list[Message]) -> None:
        if self.size <= 0:
            return
        self._entries[response_id] = (time.monotonic() + self.ttl_s, record, conversation)
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> tuple[ResponseRecord, list[Message]] | None:
        found = self._entries.get(response_id)
        if found is None:
            return None
        expires, record, conversation = found
        if time.monotonic() >= expires:
            del self._entries[response_id]
            return None
        self._entries.move_to_end(response_id)
        return record, conversation


class ResponseRecords:
    """Saves and finds stored responses (`ResponseKeys`), through this process's `ResponseCache`."""

    def __init__(self, keys: ResponseKeys, cache: ResponseCache) -> None:
        self._keys = keys
        self._cache = cache

    async def save(self, response_id: str, record: ResponseRecord, conversation: list[Message]) -> None:
        """Store `record`; `conversation` is the turn's input and reply as its sample records them."""
        await self._keys.save(response_id, orjson.dumps(record))  # orjson writes a dataclass (no deep copy)
        self._cache.put(response_id, record, conversation)

    async def get(self, response_id: str, owner: str | None) -> ResponseRecord:
        """The stored response, if the caller's key id `owner` may see it; `NotFound` if there is none (never stored,
        `store: false`, or expired) or another key created it: the same answer, so that a key learns nothing of
        another's ids."""
        cached = self._cache.get(response_id)
        record: ResponseRecord | None
        if cached is not None:
            record = cached[0]
        else:
            raw = await self._keys.load(response_id)
            record = ResponseRecord(**orjson.loads(raw)) if raw is not None else None
        if record is None or (record.owner is not None and record.owner != owner):
            raise NotFound(f"Response with id '{response_id}' not found.", param="response_id")
        return record

    async def previous(self, response_id: str, owner: str | None) -> ResponseRecord:
        """The response a request continues, as `get` finds it. Unknown: a 400 as OpenAI answers it
        (`previous_response_not_found`)."""
        try:
            return await self.get(response_id, owner)
        except NotFound:
            raise InvalidRequest(
                f"Previous response with id '{response_id}' not found.",
                param="previous_response_id",
                code="previous_response_not_found",
            ) from None

    async def conversation(self, response_id: str, record: ResponseRecord) -> list[Message]:
        """The response's conversation, its input then its reply, without its instructions."""
        cached = self._cache.get(response_id)
        if cached is not None:
            messages = cached[1]
        elif record.conversation is not None:
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
