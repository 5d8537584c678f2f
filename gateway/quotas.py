"""Per-API-key concurrency: how many sessions one key may have with a request in flight at once.

Counted in this process (a session's turns run one at a time here, see `SessionManager.lock`); several
gateway processes each enforce the limit on their own share of the traffic. Keys are identified by a
digest, never by the key itself, so nothing here can leak a secret into logs or errors.
"""

from __future__ import annotations

import hashlib
import secrets
from collections import Counter
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
    session: str
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.quota._release(self.key, self.session)


@dataclass
class SessionQuota:
    """At most `limit` distinct sessions per key with a request in flight (0 = unlimited)."""

    limit: int
    _held: dict[str, Counter[str]] = field(default_factory=dict)

    def acquire(self, key: str, session: str | None) -> SessionLease:
        """Take a slot for `session` (a request without one is a session of its own); 429 past the limit."""
        session = session or f"one-turn-{secrets.token_hex(16)}"
        sessions = self._held.setdefault(key, Counter())
        if self.limit and session not in sessions and len(sessions) >= self.limit:
            raise Overloaded(
                f"this API key already has {len(sessions)} sessions with a request in flight "
                f"(server.max_sessions_per_key = {self.limit}); retry when one finishes",
                code="too_many_concurrent_sessions",
            )
        sessions[session] += 1
        return SessionLease(self, key, session)

    def in_flight(self, key: str | None = None) -> int:
        """Sessions of `key` (of every key when None) with a request in flight now."""
        if key is None:
            return sum(len(sessions) for sessions in self._held.values())
        return len(self._held.get(key, ()))

    def _release(self, key: str, session: str) -> None:
        sessions = self._held[key]
        sessions[session] -= 1
        if sessions[session] <= 0:
            del sessions[session]
        if not sessions:
            del self._held[key]


__all__ = ["ANONYMOUS", "SessionLease", "SessionQuota", "key_id"]
