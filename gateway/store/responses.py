"""The Responses API's keys: a stored response (`rg:response:{id}`), and the chat conversation of one sample as the
next turn of a response chain reads it (`gateway.session.response_records`)."""

from __future__ import annotations

from redis.asyncio.client import Pipeline

from gateway.errors import StoreError
from gateway.store.core import StoreCore
from gateway.store.keys import call, text
from gateway.trajectory import CHUNKED, chunk_field, stored_conversation

__all__ = ["ResponseKeys"]

_CONVERSATION = CHUNKED[-1]
_ATTEMPTS = 4  # a sample is written at each of its turn's segment boundaries: a read may meet one, rarely more


class ResponseKeys:
    """Writes and reads a stored response, and a sample's conversation without its arrays."""

    def __init__(self, core: StoreCore) -> None:
        self._core = core

    @property
    def ttl_s(self) -> int:
        """How long a stored response lives: `session_idle_ttl_s + ttl_s` (the longest a session it belongs to
        stays active)."""
        return self._core.active_ttl_s

    async def save(self, response_id: str, payload: bytes) -> None:
        """Store a response for `ttl_s`."""
        key, ttl = self._core.keys.response(response_id), self.ttl_s

        def build(pipe: Pipeline) -> None:
            pipe.set(key, payload, ex=ttl)

        await self._core.batched(build, "save response")  # with the other turns' writes of the moment

    async def load(self, response_id: str) -> bytes | None:
        found = await call(self._core.client.get(self._core.keys.response(response_id)), "read response")
        return found.encode() if isinstance(found, str) else found

    async def conversation(self, session_id: str, index: int) -> list[dict[str, object]] | None:
        """Sample `index`'s stored conversation (None: no such sample, or none stored), read field by field: a
        sample's hash also holds its token arrays and routed experts, which the conversation does not need. Every
        write of a sample changes its `chunk_ends`, so a read whose two halves saw the same one saw one version."""
        key = self._core.keys.sample(session_id, index)
        client = self._core.client
        for _ in range(_ATTEMPTS):
            ends, first = await call(client.hmget(key, ["chunk_ends", _CONVERSATION]), "read conversation")
            if first is None:
                return None
            fields: dict[bytes | str, bytes | str] = {_CONVERSATION: first}
            if ends is None:
                return stored_conversation(fields)
            fields["chunk_ends"] = ends
            names = [chunk_field(_CONVERSATION, k) for k in range(1, len(text(ends).split(",")))]
            again, *more = await call(client.hmget(key, ["chunk_ends", *names]), "read conversation")
            if again == ends:
                fields.update((name, value) for name, value in zip(names, more, strict=True) if value is not None)
                return stored_conversation(fields)
        raise StoreError(f"redis: sample {index} of session {session_id} changed under {_ATTEMPTS} reads in a row")
