"""HTTP plumbing shared by the engine adapters (vLLM, SGLang): one pooled client per replica, JSON calls and SSE
streams whose failures surface as `BackendError`s, and a reader for a few Prometheus gauges.

Generation requests go through `answer_batches`, which reads the answer streamed (`sse_batches`) or whole
(`post_for_whole_answer`), both over the replica's `GenerationTransport` (`backends.generation_transport`: aiohttp's,
or the gateway fast path's own pool); a stream is handed over in whatever the socket delivered, so a burst of engine
events costs one Python iteration instead of one per event. Control calls go through aiohttp (`request`). Every
function here translates client errors at the boundary (`translate_errors` / `raise_for_status`), so an adapter
never sees one.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncGenerator, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families

from backends.base import Load, ReplicaSpec, Timeouts, raise_for_status, translate_errors
from backends.errors import BackendError, BackendTimeout, BackendUnavailable
from backends.generation_transport import AiohttpTransport
from backends.read_pacing import ReadPacer

__all__ = [
    "HttpEngineBackend",
    "Reply",
    "ReplicaClient",
    "control_timeout",
    "probe_timeout",
    "error_event_status",
    "parse_gauges",
    "parse_gauges_by",
    "answer_batches",
    "post_for_whole_answer",
    "probe",
    "request",
    "request_json",
    "sse_batches",
]

_JSON_HEADERS = {"content-type": "application/json"}
_IDENTITY = {"accept-encoding": "identity"}  # no compressed answers (see `ReplicaClient.session`)


def control_timeout(timeouts: Timeouts) -> aiohttp.ClientTimeout:
    """Timeouts of a control call (pause, resume, abort, version): the read gap is `control`, not `read`."""
    return timeouts.client(read=timeouts.control)


def probe_timeout(timeouts: Timeouts) -> aiohttp.ClientTimeout:
    """Timeouts of a health or load probe: the read gap is `health`."""
    return timeouts.client(read=timeouts.health)


@dataclass(frozen=True, slots=True)
class Reply:
    """A complete answer: its status and body."""

    status: int
    content: bytes

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")


class ReplicaClient:
    """The pooled HTTP clients of a replica: a `GenerationTransport` for generation requests (streamed and whole) and
    aiohttp's for control calls; each keeps its connections alive and opens at most `spec.max_connections`. A path
    in the replica's URL prefixes every request's path.

    Neither makes a connection before its first use, so building a backend does no I/O and needs no loop; `aclose`
    closes both, after which every call raises `BackendUnavailable`, and so do the answers still being read (a
    stream of a replica removed from the pool fails at once instead of waiting out the read timeout).
    """

    def __init__(self, spec: ReplicaSpec) -> None:
        self._spec = spec
        self._session: aiohttp.ClientSession | None = None
        self._closed = False
        parts = urlsplit(spec.url)
        self._origin = f"{parts.scheme}://{parts.netloc}"
        self.prefix = parts.path.rstrip("/")  # prepended to every path (aiohttp's base_url would drop it)
        self.timeout = spec.timeouts.client()
        self.read_gap_s = spec.timeouts.read  # the longest silence of a stream's replica (`sse_batches`)
        self.pacer = ReadPacer(spec.stream_pacing.interval_s, spec.stream_pacing.min_streams)
        timeouts = spec.timeouts
        self.generation_pool = (spec.generation_transport or AiohttpTransport)(
            spec.url,
            spec.max_connections,
            connect_timeout_s=timeouts.connect,
            pool_timeout_s=timeouts.pool,
            read_timeout_s=timeouts.whole_answer or timeouts.read,
            idle_expiry_s=timeouts.keepalive,
        )

    @property
    def is_closed(self) -> bool:
        return self._closed

    def session(self) -> aiohttp.ClientSession:
        if self._closed:
            raise BackendUnavailable(f"replica {self._spec.id}: the backend was closed", replica=self._spec.id)
        if self._session is None:
            connector = aiohttp.TCPConnector(
                limit=self._spec.max_connections,
                limit_per_host=0,
                ttl_dns_cache=300,
                keepalive_timeout=self._spec.timeouts.keepalive,  # aiohttp's own default, 15 s, outlasts the engines'
            )
            # Bodies are read as they come, never decompressed: so the client asks for none (aiohttp would offer
            # gzip, and SGLang's /metrics, prometheus_client's ASGI app, takes the offer).
            self._session = aiohttp.ClientSession(
                base_url=self._origin,
                connector=connector,
                timeout=self.timeout,
                auto_decompress=False,
                headers=_IDENTITY,
                skip_auto_headers=("User-Agent",),
            )
        return self._session

    async def aclose(self) -> None:
        self._closed = True
        session, self._session = self._session, None
        self.pacer.suspend()
        await self.generation_pool.aclose()
        if session is not None:
            await session.close()


async def request(
    client: ReplicaClient,
    replica: str,
    method: str,
    path: str,
    *,
    json: Any = None,
    params: Mapping[str, str] | None = None,
    timeout: aiohttp.ClientTimeout | None = None,
    check: bool = True,
) -> Reply:
    """One request/response call: the answer with its body read, or the matching `BackendError` (any non-2xx
    status too, unless `check=False`). The JSON body is `json`."""
    session = client.session()
    with translate_errors(replica):
        data = None if json is None else orjson.dumps(json)
        headers = None if data is None else _JSON_HEADERS
        async with session.request(
            method, client.prefix + path, data=data, headers=headers, params=params, timeout=timeout or client.timeout
        ) as response:
            reply = Reply(response.status, await response.read())
    if check:
        raise_for_status(replica, reply.status, reply.content)
    return reply


async def request_json(
    client: ReplicaClient,
    replica: str,
    method: str,
    path: str,
    *,
    json: Any = None,
    params: Mapping[str, str] | None = None,
    timeout: aiohttp.ClientTimeout | None = None,
) -> Any:
    """`request`, then the decoded JSON body: None when empty (some engine versions answer control calls with a
    bare 200); undecodable JSON is a `BackendProtocolError`."""
    reply = await request(client, replica, method, path, json=json, params=params, timeout=timeout)
    with translate_errors(replica):
        return orjson.loads(reply.content) if reply.content.strip() else None


def answer_batches(
    client: ReplicaClient,
    replica: str,
    path: str,
    body: bytes,
    *,
    stream: bool,
    deadline: float | None = None,
    latest_only: Callable[[], bool] | None = None,
    first_event: Callable[[bytes], bytes] | None = None,
    headers: Mapping[str, str] | None = None,
) -> AsyncGenerator[list[Any], None]:
    """POST a generation request and yield its answer's decoded events in batches, read as it streams (`stream`:
    `sse_batches`) or whole (`post_for_whole_answer`: one batch of the one decoded answer, read in one go). The one
    place that reads an answer one way or the other: the adapters above handle both alike.

    `deadline` (loop time) bounds the request in both modes, on the transport's own timer: passing it raises
    `BackendTimeout`. `latest_only` applies to a stream only; `first_event` rewrites a whole answer's bytes too.
    `headers`: extra request headers (vLLM's data-parallel rank).

    `body` is let go of once it is sent, not held for the answer's length (a body that replays routed experts is
    hundreds of KB, and thousands of answers may be under way): a caller that keeps no reference of its own frees it
    then."""
    if stream:
        return sse_batches(client, replica, path, body, latest_only, first_event, deadline, headers=headers)
    return _whole_batch(client, replica, path, body, deadline, first_event, headers)


async def _whole_batch(
    client: ReplicaClient,
    replica: str,
    path: str,
    body: bytes,
    deadline: float | None,
    first_event: Callable[[bytes], bytes] | None,
    headers: Mapping[str, str] | None,
) -> AsyncGenerator[list[Any], None]:
    answer = post_for_whole_answer(client, replica, path, body, deadline, first_event=first_event, headers=headers)
    del body  # the request holds it until it is sent
    yield [await answer]


async def post_for_whole_answer(
    client: ReplicaClient,
    replica: str,
    path: str,
    body: bytes,
    deadline: float | None = None,
    *,
    first_event: Callable[[bytes], bytes] | None = None,
    headers: Mapping[str, str] | None = None,
) -> Any:
    """POST an encoded JSON `body` and decode the answer: a generation request that waits for its whole answer, over the
    replica's `GenerationTransport` (read timeout: `Timeouts.whole_answer`, else `read`; also `deadline`, a loop time,
    if given). `first_event`, if given, rewrites the answer's bytes before they are decoded (as `sse_batches` does a
    stream's first event); `headers`, if given, go with the request. Failures and non-2xx answers raise the matching
    `BackendError` (`BackendTimeout` for either limit); a cancelled caller closes the connection (the engine aborts)."""
    with translate_errors(replica):  # a closed client's pool refuses: `BackendUnavailable`
        reply = client.generation_pool.post(path, body, deadline, headers)
        del body  # the pool holds it until it is sent
        status, content = await reply
        raise_for_status(replica, status, content)
        if first_event is not None:
            content = first_event(content)
        return orjson.loads(content) if content.strip() else None


async def probe(client: ReplicaClient, replica: str, path: str, timeout: aiohttp.ClientTimeout | None = None) -> bool:
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


class _ReadGapWatch:
    """Fails a stream whose replica sends nothing for `gap_s` while it is being waited for (`Timeouts.read`), or whose
    `deadline` (loop time: the request's own) passed, at the cost of no timer per read. aiohttp's `sock_read` re-arms a
    timer at every socket read (a timer handle made and another cancelled per engine event, a visible share of the
    gateway's CPU per RL-shaped token, one event per token); this watch notes the time a wait began and re-arms its one
    timer only when that fires, at most once per `gap_s`.

    The gap's clock runs only while the stream is waited for (not while the consumer is behind), and from the request
    on, so it bounds the wait for the connection and the answer's head too; the deadline holds whatever the stream is
    doing, as an `asyncio.timeout_at` around its consumer would.
    On expiry it cancels the task reading the stream; `expired` tells that cancellation from any other.
    """

    __slots__ = ("_handle", "_loop", "_task", "deadline", "expired", "gap_s", "started", "waiting")

    def __init__(self, gap_s: float, deadline: float | None) -> None:
        self._loop = asyncio.get_running_loop()
        task = asyncio.current_task(self._loop)
        assert task is not None
        self._task = task
        self.gap_s = gap_s or math.inf  # 0: no read timeout, only the deadline
        self.deadline = math.inf if deadline is None else deadline
        self.started = self._loop.time()
        self.waiting = True
        self.expired = False
        self._handle = self._loop.call_at(min(self.started + self.gap_s, self.deadline), self._check)

    def wait(self) -> None:
        """A wait for the replica begins."""
        self.started = self._loop.time()
        self.waiting = True

    def _check(self) -> None:
        now = self._loop.time()
        due = min(self.started + self.gap_s if self.waiting else now + self.gap_s, self.deadline)
        if now < due:
            self._handle = self._loop.call_at(due, self._check)
            return
        self.expired = True
        self._task.cancel()

    def reason(self) -> str:
        """Why the watch expired, for the error's message."""
        if self._loop.time() >= self.deadline:
            return "the request's deadline passed"
        return f"nothing received for {self.gap_s:g} s (read timeout)"

    def uncancel(self) -> None:
        """Withdraw the cancellation of an expiry (the stream then fails with `BackendTimeout` instead)."""
        self._task.uncancel()

    def close(self) -> None:
        self._handle.cancel()


async def sse_batches(
    client: ReplicaClient,
    replica: str,
    path: str,
    body: bytes,
    latest_only: Callable[[], bool] | None = None,
    first_event: Callable[[bytes], bytes] | None = None,
    deadline: float | None = None,
    *,
    headers: Mapping[str, str] | None = None,
) -> AsyncGenerator[list[Any], None]:
    """POST `body` (encoded JSON, with extra `headers` if given) and yield the decoded `data:` payloads of the
    server-sent-event answer until `[DONE]`, in batches: all the complete events one socket read delivered (a busy
    gateway reads several at once, and the layers above handle them as one delta). While `latest_only()` is true, each
    batch holds only the last of those events (`decode_latest`): for a stream whose every event repeats all the ones
    before it. `first_event`, if given, rewrites the bytes that complete the first event (and hold what followed it in
    the same read) before they are decoded: what an engine sends once per stream and the caller never reads.

    A non-2xx answer, an in-band error event, a transport failure or undecodable data raise the matching
    `BackendError`, after the events that preceded it were yielded; so does a gap longer than the timeouts'
    `read` while the replica is waited for, or `deadline` (loop time) passing (`BackendTimeout`, see
    `_ReadGapWatch`). Closing the iterator early (`aclose`, cancellation) closes the connection, which the engines
    take as a client disconnect and abort the request. The stream ending without `[DONE]` is not an error here: the
    caller decides from what it received.

    Written by hand rather than with an SSE library: the engines send single-line `data:` events only.
    """
    watch = _ReadGapWatch(client.read_gap_s, deadline) if client.read_gap_s or deadline is not None else None
    pacer = client.pacer
    try:
        with translate_errors(replica):
            async with client.generation_pool.stream(path, body, headers) as answer:
                del body  # sent: not held for the answer's length
                if answer.status >= 300:
                    raise_for_status(replica, answer.status, await answer.read_all())
                events = _EventDecoder(latest_only, first_event)
                done = False
                with _StreamBody(pacer):
                    while True:
                        if watch is not None:
                            watch.wait()
                        data = await answer.read()
                        if watch is not None:
                            watch.waiting = False
                        if not data:
                            break  # the end of the body
                        if done:
                            continue  # read on to the end of the body (it ends after [DONE]): the connection is reused
                        batch, done, error = events.feed(data)
                        if batch:  # a read that completed no event is not held: the event's rest is on its way
                            if not done and error is None:
                                pacer.hold(answer.transport)
                            yield batch
                        if error is not None:
                            raise_for_status(replica, error[0], error[1].encode())
    except asyncio.CancelledError:
        if watch is None or not watch.expired:
            raise
        watch.uncancel()
        raise BackendTimeout(f"replica {replica}: {watch.reason()}", replica=replica) from None
    finally:
        if watch is not None:
            watch.close()


class _EventDecoder:
    """A stream's reads decoded into events (see `sse_batches`): the incomplete rest of each read is kept for the
    next; `first_event` rewrites the bytes that complete the first event's line, once."""

    __slots__ = ("first_event", "latest_only", "pending")

    def __init__(self, latest_only: Callable[[], bool] | None, first_event: Callable[[bytes], bytes] | None) -> None:
        self.latest_only = latest_only
        self.first_event = first_event
        self.pending = b""

    def feed(self, data: bytes) -> tuple[list[Any], bool, tuple[int, str] | None]:
        """The events `data` completed, whether `[DONE]` came, and an in-band error's status and message."""
        decode = decode_latest if self.latest_only is not None and self.latest_only() else _decode_events
        buffer = self.pending + data
        if self.first_event is not None and b"\n" in data:  # the first event's line is complete
            buffer, self.first_event = self.first_event(buffer), None
        self.pending, batch, done, error = decode(buffer)
        return batch, done, error


class _StreamBody:
    """While a stream's body is read: counted by the replica's pacer."""

    __slots__ = ("pacer",)

    def __init__(self, pacer: ReadPacer) -> None:
        self.pacer = pacer

    def __enter__(self) -> None:
        self.pacer.streams += 1

    def __exit__(self, *_: object) -> None:
        self.pacer.streams -= 1


def _decode_events(buffer: bytes) -> tuple[bytes, list[Any], bool, tuple[int, str] | None]:
    """The complete events at the start of `buffer`: (the incomplete rest, the decoded `data:` payloads up to
    `[DONE]` or an in-band error event, whether `[DONE]` came, that error's status and message)."""
    lines = buffer.split(b"\n")
    rest = lines.pop()
    batch: list[Any] = []
    for line in lines:
        if not line.startswith(b"data:"):
            continue  # blank separators, comments, `event:`/`id:` fields
        payload_bytes = line[5:].strip()
        if payload_bytes == b"[DONE]":
            return rest, batch, True, None
        payload = orjson.loads(payload_bytes)
        error = error_event_status(payload)
        if error is not None:
            return rest, batch, False, error
        batch.append(payload)
    return rest, batch, False, None


def decode_latest(buffer: bytes) -> tuple[bytes, list[Any], bool, tuple[int, str] | None]:
    """`_decode_events`, for a stream whose every event repeats all the ones before it (SGLang's cumulative
    default): of the complete events at the start of `buffer`, only the last is decoded, the others are skipped
    unparsed (their JSON grows with the output). Where any event could be an
    in-band error (its bytes hold `"error"`), or a skipped one the end (`[DONE]`), every event is decoded as usual:
    an error still comes after the events before it."""
    lines = buffer.split(b"\n")
    rest = lines.pop()
    data = [line for line in lines if line.startswith(b"data:")]
    done = bool(data) and data[-1][5:].strip() == b"[DONE]"
    events = data[:-1] if done else data
    if len(events) < 2 or any(b'"error"' in e for e in events) or any(b"[DONE]" in e for e in events[:-1]):
        return _decode_events(buffer)
    _, batch, ended, error = _decode_events(events[-1] + (b"\ndata: [DONE]\n" if done else b"\n"))
    return rest, batch, ended, error


def parse_gauges(text: str, names: Iterable[str], peaks: Iterable[str] = ()) -> dict[str, float]:
    """Values of the named Prometheus samples, summed over their label sets (those named in `peaks` too: their
    largest value instead, a share such as KV usage); names that are absent are left out.

    Only the lines of the wanted samples go through prometheus_client's parser: a real engine's /metrics is
    tens of kilobytes of histograms, and parsing all of it on every load probe costs milliseconds.
    """
    return parse_gauges_by(text, names, peaks).get(None, {})


def parse_gauges_by(
    text: str, names: Iterable[str], peaks: Iterable[str] = (), label: str | None = None
) -> dict[str | None, dict[str, float]]:
    """`parse_gauges` per value of `label` (an engine's data-parallel rank): each value's samples summed (or their
    peak) apart, keyed by the value (None: the samples without the label). Without `label`, every sample under None."""
    largest = set(peaks)
    wanted = set(names) | largest
    lines = [line for line in text.splitlines() if _sample_name(line) in wanted]
    groups: dict[str | None, dict[str, float]] = {}
    for family in text_string_to_metric_families("\n".join(lines) + "\n"):
        for sample in family.samples:
            name, value = sample.name, float(sample.value)
            if name not in wanted:
                continue
            totals = groups.setdefault(sample.labels.get(label) if label is not None else None, {})
            if name in largest:
                totals[name] = max(totals.get(name, value), value)
            else:
                totals[name] = totals.get(name, 0.0) + value
    return groups


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

    Subclasses name their engine's load gauges (`running_gauge`, `waiting_gauge`, `kv_usage_gauge`), the label that
    tells its data-parallel ranks' samples apart (`rank_label`), and implement the rest of `EngineBackend`.
    """

    running_gauge: str
    waiting_gauge: str
    kv_usage_gauge: str  # the share of the KV cache in use, 0 to 1
    cache_queries_counter: str  # prompt tokens the prefix cache was asked for (a counter, `_total` included)
    cache_hits_counter: str  # of them, those it had
    rank_label: str  # the label whose value is a sample's data-parallel rank

    def __init__(self, spec: ReplicaSpec) -> None:
        if spec.data_parallel_size < 1:
            raise ValueError(f"replica {spec.id}: data_parallel_size must be at least 1, not {spec.data_parallel_size}")
        self.spec = spec
        self.id = spec.id
        self.url = spec.url
        self.data_parallel_size = spec.data_parallel_size
        self._client = ReplicaClient(spec)
        self._control = control_timeout(spec.timeouts)
        self._probe = probe_timeout(spec.timeouts)
        self._long = spec.timeouts.client()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(id={self.id!r}, url={self.url!r})"

    @property
    def paced_reads(self) -> int:
        return self._client.pacer.holds

    async def health(self) -> bool:
        """True when `GET /health` answers 200; never raises. A failed probe is `lost_contact`."""
        ok = await probe(self._client, self.id, "/health", timeout=self._probe)
        if not ok:
            self.lost_contact()
        return ok

    def lost_contact(self) -> None:
        """The engine did not answer a health probe: it may be restarting, and what it held for the gateway gone (an
        adapter forgets its weight-transfer group)."""

    async def load(self) -> Load:
        """Running and waiting requests and the prefix cache's counters from `/metrics`, summed over label sets
        (engines, models), and the KV cache's usage (the fullest engine's); with several data-parallel ranks, each
        rank's too (`Load.ranks`, from the samples labelled with it)."""
        response = await request(self._client, self.id, "GET", "/metrics", timeout=self._probe)
        names = (self.running_gauge, self.waiting_gauge, self.cache_queries_counter, self.cache_hits_counter)
        peaks = (self.kv_usage_gauge,)
        ranks: dict[int, Load] = {}
        with translate_errors(self.id):
            text = response.text
            gauges = parse_gauges(text, names, peaks)
            if self.data_parallel_size > 1:
                for rank, values in parse_gauges_by(text, names, peaks, self.rank_label).items():
                    if rank is not None and rank.isdigit():
                        ranks[int(rank)] = self._load(values)
        return self._load(gauges, ranks)

    def _load(self, gauges: dict[str, float], ranks: dict[int, Load] | None = None) -> Load:
        running, waiting = gauges.get(self.running_gauge), gauges.get(self.waiting_gauge)
        return Load(
            running=None if running is None else int(running),
            waiting=None if waiting is None else int(waiting),
            prefix_cache_queries=gauges.get(self.cache_queries_counter),
            prefix_cache_hits=gauges.get(self.cache_hits_counter),
            kv_usage=gauges.get(self.kv_usage_gauge),
            ranks=ranks or {},
        )

    async def aclose(self) -> None:
        await self._client.aclose()
