"""Stored Responses API answers, and the conversation a request continues when it names one (`previous_response_id`).

A response of a named session records where its conversation is, not the messages: the session, the sample its turn
was recorded in, and how many messages of that sample's conversation (`Sample.conversation`, in Redis) were its
input and its reply. The sample holds them already, and an episode of n responses costs Redis O(n), not O(n²); a
later turn that extends the sample leaves those first messages as they were, so the count still finds them.

A response of a one-turn session (no session named) records messages itself, since that session ends with its turn
and the trainer deletes its keys once it took it; but each only once (issue 52 §12: a chain of 70 one-turn
responses stored 1,665 KiB, each record the whole conversation so far). The first of a chain records its
conversation whole; one that continues another (`previous_response_id`) records the response it continues
(`previous`) and only its own messages, its input and its reply. Its conversation is the chain's, read back link by
link (`conversation`) until a record whose conversation is whole, or one this process has cached. A chain is as long
as its messages allow, so the walk is bounded by `server.max_messages`; a link that expired (each record lives
`ResponseKeys.ttl_s` from its own write, so a chain can be continued that long after its first response) is a 409
naming it. A record stored before records were linked holds its conversation whole, and reads as a chain's first.

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
    `conversation` is recorded, whole or, with `previous` (the response it continues), its own messages only;
    `instructions`: whether the conversation it points at starts with its instructions (never so for its own
    messages); `owner`: the key id that created it (None: made without API keys, and records stored before owners
    were)."""

    answer: dict[str, Any]
    session_id: str | None
    sample: int
    messages: int
    instructions: bool
    conversation: list[Message] | None = None
    owner: str | None = None
    previous: str | None = None


class ResponseCache:
    """The responses this process stored last, each with its conversation as a request continuing it starts from
    (the whole chain's messages, without its instructions): at most `size` (least recently used out first), none
    kept longer than `ttl_s`, Redis's lifetime of the record. The records and messages are shared with their
    readers, who must not change them."""

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


def response_not_found(response_id: str) -> NotFound:
    """The one answer for a response the caller may not read: never stored, expired, another key's or elsewhere."""
    return NotFound(f"Response with id '{response_id}' not found.", param="response_id")


class ResponseRecords:
    """Saves and finds stored responses (`ResponseKeys`), through this process's `ResponseCache`. `max_links`: the
    longest chain of one-turn responses a walk follows (`server.max_messages`: each response adds a message at
    least, and a longer conversation is refused before it is stored)."""

    def __init__(self, keys: ResponseKeys, cache: ResponseCache, max_links: int) -> None:
        self._keys = keys
        self._cache = cache
        self._max_links = max_links

    async def save(self, response_id: str, record: ResponseRecord, conversation: list[Message]) -> None:
        """Store `record`; `conversation` is what a request continuing it starts from: the chain's messages, its
        input and its reply, without its instructions (`conversation` reads it back)."""
        await self._keys.save(response_id, orjson.dumps(record))  # orjson writes a dataclass (no deep copy)
        self._cache.put(response_id, record, conversation)

    async def get(self, response_id: str, owner: str | None) -> ResponseRecord:
        """The stored response, if the caller's key id `owner` may see it; `NotFound` if there is none (never stored,
        `store: false`, or expired) or another key created it: the same answer, so that a key learns nothing of
        another's ids."""
        record = await self._find(response_id)
        if record is None or (record.owner is not None and record.owner != owner):
            raise response_not_found(response_id)
        return record

    async def _find(self, response_id: str) -> ResponseRecord | None:
        cached = self._cache.get(response_id)
        if cached is not None:
            return cached[0]
        raw = await self._keys.load(response_id)
        return ResponseRecord(**orjson.loads(raw)) if raw is not None else None

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
        """The response's conversation, its input then its reply, without its instructions: for a one-turn
        response that continues another, the chain's, its links read one by one up to a record whose conversation
        is whole or a response in this process's cache."""
        asked = response_id
        own: list[list[Message]] = []  # the messages of each linked response walked, the latest first
        for _ in range(self._max_links):
            cached = self._cache.get(response_id)
            if cached is not None:
                start = cached[1]
                break
            if record.previous is None:
                start = await self._whole(response_id, record)
                break
            own.append(record.conversation or [])
            response_id, record = record.previous, await self._link(asked, record.previous)
        else:
            raise Conflict(
                f"the conversation of response '{asked}' continues more than {self._max_links} responses "
                "(server.max_messages)",
                param="previous_response_id",
            )
        return [*start, *(message for messages in reversed(own) for message in messages)]

    async def _link(self, later: str, response_id: str) -> ResponseRecord:
        """The response `later` continues, which must still be stored."""
        record = await self._find(response_id)
        if record is None:
            raise Conflict(
                f"the conversation of response '{later}' is no longer stored (response '{response_id}', which it "
                "continues, expired)",
                param="previous_response_id",
            )
        return record

    async def _whole(self, response_id: str, record: ResponseRecord) -> list[Message]:
        """The conversation of a record that holds it whole, or points at its sample's."""
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
