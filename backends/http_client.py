"""HTTP plumbing shared by the engine adapters (vLLM, SGLang): one pooled client per replica, JSON calls and SSE
streams whose failures surface as `BackendError`s, and a reader for a few Prometheus gauges.

Every function here translates httpx errors at the boundary (`translate_errors` / `raise_for_status`), so an
adapter never sees an `httpx` exception and never builds an error by hand.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Iterable, Mapping
from typing import Any

import httpx
import orjson
from prometheus_client.parser import text_string_to_metric_families

from backends.base import Load, ReplicaSpec, Timeouts, raise_for_status, translate_errors
from backends.errors import BackendError, BackendUnavailable

__all__ = [
    "HttpEngineBackend",
    "build_client",
    "control_timeout",
    "error_event_status",
    "parse_gauges",
    "probe",
    "request",
    "request_json",
    "sse_events",
]

# Idle keep-alive connections kept per replica: enough for a steady stream of short control calls and the
# generation fan-out without holding max_connections sockets open forever.


def build_client(spec: ReplicaSpec, transport: httpx.AsyncBaseTransport | None = None) -> httpx.AsyncClient:
    """The one pooled client of a replica. No I/O happens until the first request.

    `transport` replaces the network transport (tests use `httpx.MockTransport`); the pool limits then belong
    to that transport.
    """
    # httpcore walks every pooled connection on each request, so a large idle pool costs more than reconnecting
    # (measured with the benchmarks' direct-vs-gateway runs); keep a modest number of idle connections.
    limits = httpx.Limits(max_connections=spec.max_connections, max_keepalive_connections=min(64, spec.max_connections))
    return httpx.AsyncClient(base_url=spec.url, timeout=spec.timeouts.httpx(), limits=limits, transport=transport)


def control_timeout(timeouts: Timeouts) -> httpx.Timeout:
    """Timeouts of a short control call (health, pause, resume, version): the read gap is `control`, not `read`."""
    return httpx.Timeout(connect=timeouts.connect, read=timeouts.control, write=timeouts.write, pool=timeouts.pool)


def _ensure_open(client: httpx.AsyncClient, replica: str) -> None:
    # httpx raises a bare RuntimeError on a closed client; callers only know BackendError.
    if client.is_closed:
        raise BackendUnavailable(f"replica {replica}: the backend was closed", replica=replica)


async def request(
    client: httpx.AsyncClient,
    replica: str,
    method: str,
    path: str,
    *,
    json: Any = None,
    params: Mapping[str, str] | None = None,
    timeout: httpx.Timeout | None = None,
) -> httpx.Response:
    """One request/response call: the (2xx) response with its body read, or the matching `BackendError`."""
    _ensure_open(client, replica)
    with translate_errors(replica):
        content = None if json is None else orjson.dumps(json)
        headers = None if content is None else {"content-type": "application/json"}
        extra: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        response = await client.request(method, path, content=content, headers=headers, params=params, **extra)
        raise_for_status(replica, response.status_code, response.content)
        return response


async def request_json(
    client: httpx.AsyncClient,
    replica: str,
    method: str,
    path: str,
    *,
    json: Any = None,
    params: Mapping[str, str] | None = None,
    timeout: httpx.Timeout | None = None,
) -> Any:
    """`request`, then the decoded JSON body: None when empty (some engine versions answer control calls with a
    bare 200); undecodable JSON is a `BackendProtocolError`."""
    response = await request(client, replica, method, path, json=json, params=params, timeout=timeout)
    with translate_errors(replica):
        return orjson.loads(response.content) if response.content.strip() else None


async def probe(client: httpx.AsyncClient, replica: str, path: str, timeout: httpx.Timeout | None = None) -> bool:
    """True when `GET path` answers 200, False on any other status or failure; never raises."""
    try:
        await request(client, replica, "GET", path, timeout=timeout)
    except BackendError:
        return False
    return True


def error_event_status(payload: Any) -> tuple[int, str] | None:
    """(status, message) when a stream event is an in-band error instead of data.

    Engines that fail after the stream started can no longer change the HTTP status, so they send one event
    `{"error": {"message", "type", "code"}}` (vLLM, SGLang) or, in older vLLM, `{"object": "error", ...}`.
    """
    if not isinstance(payload, dict):
        return None
    error = payload.get("error")
    if isinstance(error, dict):
        details: dict[str, Any] = error
    elif payload.get("object") == "error":
        details = payload
    elif isinstance(error, str):
        details = {"message": error}
    else:
        return None
    code = details.get("code")
    status = code if isinstance(code, int) and 400 <= code < 600 else 500
    return status, str(details.get("message") or details.get("type") or "error event")


async def sse_events(
    client: httpx.AsyncClient, replica: str, path: str, json: Any, *, timeout: httpx.Timeout | None = None
) -> AsyncGenerator[Any, None]:
    """POST `json` and yield the decoded `data:` payloads of the server-sent-event answer until `[DONE]`.

    A non-2xx answer, an in-band error event, a transport failure or undecodable data raise the matching
    `BackendError`. Closing the iterator early (`aclose`, cancellation) closes the HTTP stream, which the
    engines take as a client disconnect and abort the request. The stream ending without `[DONE]` is not an
    error here: the caller decides from what it received (e.g. whether a finish reason arrived).

    Written by hand rather than with httpx-sse: the engines send single-line `data:` events only, and the
    ~15 lines here avoid a dependency on the hot path.
    """
    _ensure_open(client, replica)
    with translate_errors(replica):
        extra: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        request = client.build_request(
            "POST",
            path,
            content=orjson.dumps(json),
            headers={"content-type": "application/json", "accept": "text/event-stream"},
            **extra,
        )
        response = await client.send(request, stream=True)
        try:
            if response.status_code >= 300:
                raise_for_status(replica, response.status_code, await response.aread())
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, comments, `event:`/`id:` fields
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                payload = orjson.loads(data)
                error = error_event_status(payload)
                if error is not None:
                    raise_for_status(replica, error[0], error[1].encode())
                yield payload
        finally:
            await response.aclose()


def parse_gauges(text: str, names: Iterable[str]) -> dict[str, float]:
    """Values of the named Prometheus samples, summed over their label sets; names that are absent are left out.

    Only the lines of the wanted samples go through prometheus_client's parser: a real engine's /metrics is
    tens of kilobytes of histograms, and parsing all of it on every load probe costs milliseconds.
    """
    wanted = set(names)
    lines = [line for line in text.splitlines() if _sample_name(line) in wanted]
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families("\n".join(lines) + "\n"):
        for sample in family.samples:
            if sample.name in wanted:
                totals[sample.name] = totals.get(sample.name, 0.0) + float(sample.value)
    return totals


def _sample_name(line: str) -> str:
    if not line or line.startswith("#"):
        return ""
    end = len(line)
    for separator in ("{", " "):
        index = line.find(separator)
        if index != -1:
            end = min(end, index)
    return line[:end]


class HttpEngineBackend:
    """What every HTTP engine adapter shares: the replica's pooled client, health, load and closing.

    Subclasses name their engine's load gauges (`running_gauge`, `waiting_gauge`) and implement the rest of
    `EngineBackend`.
    """

    running_gauge: str
    waiting_gauge: str

    def __init__(self, spec: ReplicaSpec, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.spec = spec
        self.id = spec.id
        self.url = spec.url
        self._client = build_client(spec, transport)
        self._control = control_timeout(spec.timeouts)
        self._long = spec.timeouts.httpx()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(id={self.id!r}, url={self.url!r})"

    async def health(self) -> bool:
        """True when `GET /health` answers 200; never raises."""
        return await probe(self._client, self.id, "/health", timeout=self._control)

    async def load(self) -> Load:
        """Running and waiting requests from `/metrics`, summed over label sets (engines, models)."""
        response = await request(self._client, self.id, "GET", "/metrics", timeout=self._control)
        with translate_errors(self.id):
            gauges = parse_gauges(response.text, (self.running_gauge, self.waiting_gauge))
        running, waiting = gauges.get(self.running_gauge), gauges.get(self.waiting_gauge)
        return Load(
            running=None if running is None else int(running),
            waiting=None if waiting is None else int(waiting),
        )

    async def aclose(self) -> None:
        await self._client.aclose()
