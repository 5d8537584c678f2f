"""The gateway's session routes for an episode runner: create (with backpressure) and finish.

Both calls name the session explicitly, which makes them idempotent on the gateway (creating an existing
active session returns it; finishing is idempotent), so retrying them is safe. Retries are bounded: 429
(backpressure: the trainer lags) and 503 honour `Retry-After`, capped at `max_wait_s`; connection errors
back off exponentially with jitter. Anything else raises `SessionError` at once.
"""

from __future__ import annotations

import asyncio
import email.utils
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

RETRY_STATUSES = frozenset({429, 503})


class SessionError(RuntimeError):
    """A session call failed for good (the gateway's error message, or why the retries ran out)."""

    def __init__(self, message: str, *, status_code: int | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Per call: at most `max_retries` retries, of which at most `max_transport_retries` after connection
    errors (an unreachable gateway fails fast; backpressure may last). Each wait is `Retry-After` (else
    exponential backoff with jitter), capped at `max_wait_s`."""

    max_retries: int = 30
    max_transport_retries: int = 5
    max_wait_s: float = 10.0
    base_wait_s: float = 0.25

    def wait_s(self, attempt: int, retry_after: float | None) -> float:
        if retry_after is not None:
            return min(max(retry_after, 0.0), self.max_wait_s)
        backoff = self.base_wait_s * 2.0 ** min(attempt, 32)
        return min(backoff * random.uniform(0.5, 1.0), self.max_wait_s)  # full jitter spreads retrying workers


def retry_after_s(value: str | None) -> float | None:
    """Seconds from a `Retry-After` header (delta-seconds or an HTTP date); None if absent or unreadable."""
    if not value:
        return None
    try:
        return float(value)
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return when.timestamp() - time.time()


class SessionsClient:
    """`POST /v1/sessions` and `POST /v1/sessions/{id}/finish` over one pooled `httpx.AsyncClient`.

    `on_retry(status_code)` is called before each retry wait (`None` for a connection error), so a runner can
    count backpressure.
    """

    def __init__(
        self,
        http: httpx.AsyncClient,
        *,
        policy: RetryPolicy | None = None,
        on_retry: Callable[[int | None], None] | None = None,
    ) -> None:
        self.http = http
        self.policy = policy or RetryPolicy()
        self.on_retry = on_retry

    async def create(self, session_id: str, metadata: dict[str, Any]) -> str:
        body = await self._post("/v1/sessions", {"session_id": session_id, "metadata": metadata})
        return str(body["id"])

    async def finish(self, session_id: str, reward: float | None, metadata: dict[str, Any] | None = None) -> None:
        payload: dict[str, Any] = {"reward": reward}
        if metadata is not None:
            payload["metadata"] = metadata
        await self._post(f"/v1/sessions/{session_id}/finish", payload)

    async def _post(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        attempt = transport_failures = 0
        while True:
            try:
                response = await self.http.post(path, json=payload)
            except httpx.TransportError as exc:
                status, retry_after, failure = None, None, f"{type(exc).__name__}: {exc}"
                transport_failures += 1
            else:
                if response.is_success:
                    body: dict[str, Any] = response.json()
                    return body
                status, failure = response.status_code, _error_message(response)
                if status not in RETRY_STATUSES:
                    raise SessionError(f"POST {path}: {status} {failure}", status_code=status)
                retry_after = retry_after_s(response.headers.get("retry-after"))
            if attempt >= self.policy.max_retries or transport_failures > self.policy.max_transport_retries:
                detail = failure if status is None else f"{status} {failure}"
                raise SessionError(f"POST {path}: gave up after {attempt} retries: {detail}", status_code=status)
            if self.on_retry is not None:
                self.on_retry(status)
            await asyncio.sleep(self.policy.wait_s(attempt, retry_after))
            attempt += 1


def _error_message(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:200]
