"""Per-API-key concurrency: how many sessions one key may have with a request in flight at once.

Counted in this process (a session's turns run one at a time here, see `SessionLocks.turn`); several
gateway processes each enforce the limit on their own share of the traffic (`server.max_sessions_per_key`). Not to
be confused with the bound on a key's *open* sessions, created and not finished, counted in Redis across processes
(`server.max_open_sessions_per_key`, `gateway.store.open_sessions`). Keys are identified by a
digest, never by the key itself, so nothing here can leak a secret into logs or errors.
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass, field

from gateway.errors import Overloaded

ANONYMOUS = "anonymous"


def key_id(token: str | None) -> str:
    """A stable, non-reversible name for an API key (or `anonymous` for open gateways)."""
    if token is None:
        return ANONYMOUS
    return "key-" + hashlib.sha256(token.encode()).hexdigest()[:16]


@dataclass
class SessionLease:
    """One request's hold on a session slot of its key; `release()` is idempotent."""

    quota: SessionQuota
    key: str
    session: str | int
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.quota._release(self.key, self.session)


@dataclass
class SessionQuota:
    """At most `limit` distinct sessions per key with a request in flight (0 = unlimited)."""

    limit: int
    # key -> session -> its requests in flight; a request without a session counts as one under a number of its own
    _held: dict[str, dict[str | int, int]] = field(default_factory=dict)
    _one_turn: itertools.count[int] = field(default_factory=itertools.count)

    def acquire(self, key: str, session: str | None) -> SessionLease:
        """Take a slot for `session` (a request without one is a session of its own); 429 past the limit."""
        slot: str | int = session or next(self._one_turn)
        sessions = self._held.get(key)
        if sessions is None:
            sessions = self._held[key] = {}
        if self.limit and slot not in sessions and len(sessions) >= self.limit:
            raise Overloaded(
                f"this API key already has {len(sessions)} sessions with a request in flight "
                f"(server.max_sessions_per_key = {self.limit}); retry when one finishes",
                code="too_many_concurrent_sessions",
            )
        sessions[slot] = sessions.get(slot, 0) + 1
        return SessionLease(self, key, slot)

    def in_flight(self, key: str | None = None) -> int:
        """Sessions of `key` (of every key when None) with a request in flight now."""
        if key is None:
            return sum(len(sessions) for sessions in self._held.values())
        return len(self._held.get(key, ()))

    def _release(self, key: str, session: str | int) -> None:
        sessions = self._held[key]
        left = sessions[session] - 1
        if left > 0:
            sessions[session] = left
        else:
            del sessions[session]
        if not sessions:
            del self._held[key]


__all__ = ["ANONYMOUS", "SessionLease", "SessionQuota", "key_id"]
