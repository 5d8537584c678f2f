"""The client connection limits, enforced where bytes arrive, in a subclass of uvicorn's httptools protocol
(`server_protocol` under `fastpath:`).

The limits (config.yaml, `server`):

- `max_header_bytes`: a request head (request line and headers) longer than this is answered 431 and the
  connection closed. The parser is fed at most this many bytes of a head, so a huge header costs the event loop
  nothing more (without the limit the parser's accumulation grows with the square of the header's length).
- `header_timeout_s`: a connection must send a complete request head within this long of connecting, or of the
  first byte of its next request; otherwise it is closed (408 if part of a head came). Idle time between requests
  is uvicorn's keep-alive timeout.
- `body_timeout_s` and `min_body_rate_bytes_s`: a request body is answered 408 and its connection closed when no
  byte of it came for `body_timeout_s`, or when it came slower on average than `min_body_rate_bytes_s` past a grace
  of `body_timeout_s` (each byte buys `1 / min_body_rate_bytes_s` more: Apache's mod_reqtimeout `MinRate`). The
  gap alone is beaten by a byte every so often, the rate alone by a burst then silence; a whole-body deadline would
  cut large uploads on slow links. The body is timed from the end of its head, in raw bytes whatever its framing
  (a `Content-Length`, or chunks), on every route, read by the app or not (a body the app answered without reading
  is still timed; its connection is then closed without a second answer). Time the gateway holds the body back
  (uvicorn pauses reading while the app has not taken what came, or before its `100 Continue`) starts the clock
  again.
- `max_connections`: a connection past this closes the longest-idle connection (one that has sent nothing since
  it connected or since its last response, for at least `IDLE_GRACE_S`) and is served; when none is idle it is
  answered 503 at once and closed. So idle sockets can neither take the file descriptors the gateway needs for
  Redis and the replicas nor keep agents out; only requests under way (and heads still within
  `header_timeout_s`) fill the cap.
- `silent_timeout_near_cap_s`: a connection made with `ConnectionLimits.near_cap` connections open (itself
  included) must send its first byte within this long, not `header_timeout_s` (a client sends its request as soon as
  it has connected); and, that near the cap, a new connection or one cut so has every other that has been silent
  this long since it connected closed, in a sweep that judges a connection only once the loop has read its socket
  (`gateway.fastpath.silent_connections`: under load a request can sit unread longer than this). So a flood of
  silent connections holds about its rate times this many, not its rate times `header_timeout_s`.

A refused connection is closed the way HTTP servers close one whose client may still be sending (RFC 9112 §9.6,
"lingering close"): the answer, then the write side shut, then what the client still sends is read and dropped
until it closes or `LINGER_S` passes (`REFUSAL_LINGER_S` for a connection refused as it connects). Closing at
once would reset the connection, and a client still sending would see the reset instead of the answer.

And a lost connection is let go at once, however it was lost: uvicorn cancels a connection's keep-alive timer only
when the connection closed cleanly, so a client that resets it (a killed agent, an abandoned socket) leaves the
timer armed, holding the connection's protocol, its last request cycle (scope, headers, events) and transport for
`timeout_keep_alive` (30 s here); the protocol and its cycle refer to each other, so the lot is then garbage that
only the cyclic collector frees.

uvicorn has no public API for any of this: its `limit_concurrency` answers 503 only once a whole head has come (so
idle sockets past it still hold their file descriptors), and it has no head size, head time or body time limit on
httptools.
So the protocol class given to uvicorn's `http=` overrides asyncio's `Protocol` callbacks, httptools' parser
callbacks and `on_response_complete` (the callback uvicorn gives each response), each calling the parent's, and
reads uvicorn's attributes `transport`, `loop`, `server_state` (its connection set), `cycle` (whether a response is
under way; `CYCLE_NAMES` of it), `flow` (whether reading is paused), `pipeline` (requests queued behind a response)
and `timeout_keep_alive_task`: uvicorn is pinned in pyproject.toml, and
`tests/gateway/fastpath/test_taken.py` fails when they move. With the part off (`gateway.server.uvicorn_config`),
uvicorn's own httptools protocol serves with `limit_concurrency: server.max_connections` alone: no head or body
limits, a connection past the cap is answered 503 once its head came, and a reset connection is freed by the
collector.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import ClassVar

import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.connection_limits import ConnectionLimits
from gateway.fastpath.silent_connections import SilentConnections

__all__ = [
    "CYCLE_NAMES",
    "IDLE_GRACE_S",
    "LINGER_S",
    "REFUSAL_LINGER_S",
    "UVICORN_NAMES",
    "GatewayHttpProtocol",
    "LimitedHttpToolsProtocol",
    "protocol_class",
]

logger = logging.getLogger(__name__)

UVICORN_NAMES = ("transport", "loop", "server_state", "cycle", "flow", "pipeline", "timeout_keep_alive_task")
"""The attributes of uvicorn's protocol this part reads and writes (tests/gateway/fastpath/test_taken.py checks
that a connection's protocol still has them)."""

CYCLE_NAMES = ("response_started", "response_complete", "waiting_for_100_continue", "disconnected", "message_event")
"""The attributes of uvicorn's request cycle this part reads and writes (checked by the same test)."""

LINGER_S = 2.0
"""How long a refused connection's remaining input is read and dropped before it is closed, seconds."""

REFUSAL_LINGER_S = 0.25
"""The same for a connection refused past the cap as it connects: its client has at most a request head on the
way, and a flood of them must give its file descriptors back soon."""

IDLE_GRACE_S = 1.0
"""How long a connection must have been idle before a new one past the cap may close it, seconds. Without it a
burst of new connections past the cap would close the burst's first ones before their requests were read."""


class GatewayHttpProtocol(HttpToolsProtocol):
    """`HttpToolsProtocol` whose lost connection always disarms its keep-alive timer and drops its last request
    cycle (see the module docstring)."""

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        if self.timeout_keep_alive_task is not None:  # uvicorn cancels it only when `exc` is None
            self.timeout_keep_alive_task.cancel()
            self.timeout_keep_alive_task = None
        # A request still running keeps its cycle through its own task; its answer is for nobody now (the cycle's
        # `disconnected` says so) and `on_response_complete` returns early on a closing transport.
        self.cycle = None  # type: ignore[assignment]


def _answer(status: int, reason: str, error_type: str, code: str, message: str) -> bytes:
    body = orjson.dumps({"error": {"message": message, "type": error_type, "param": None, "code": code}})
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


class _RateLimitedWarning:
    """Logs a refusal at most once per `period_s`, with how many there were since (a flood must not flood the log)."""

    def __init__(self, period_s: float = 10.0) -> None:
        self.period_s = period_s
        self.last = -period_s
        self.count = 0

    def __call__(self, what: str) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self.last >= self.period_s:
            logger.warning("refused client connections: %s (%d refusals since the last warning)", what, self.count)
            self.last, self.count = now, 0


_warn = _RateLimitedWarning()


class LimitedHttpToolsProtocol(GatewayHttpProtocol):
    """uvicorn's httptools protocol with the limits of `limits`; use `protocol_class` to set them."""

    limits: ClassVar[ConnectionLimits]
    idle: ClassVar[dict[LimitedHttpToolsProtocol, float]]
    """This server's idle connections and since when (loop time), longest idle first."""
    silent: ClassVar[SilentConnections]
    """Those of them that have sent nothing since they connected (`gateway.fastpath.silent_connections`)."""
    dropped: ClassVar[set[LimitedHttpToolsProtocol]]
    """Connections this server closed that the loop has not reported lost yet (uvicorn still counts them)."""
    too_large: ClassVar[bytes]
    too_many: ClassVar[bytes]
    timed_out: ClassVar[bytes]
    body_timed_out: ClassVar[bytes]

    # Per-connection state beside the parent's, set in connection_made (uvicorn makes one protocol per connection).
    _reading_head: bool
    _head_bytes: int
    _heads: int
    _head_timer: asyncio.TimerHandle | None
    _head_deadline: float
    _body_timer: asyncio.TimerHandle | None
    _body_since: float
    """When the body's clock started (loop time)."""
    _body_last: float
    """When bytes of it last came."""
    _body_bytes: int
    """How many came since the clock started."""
    _body_held: bool
    """Whether the gateway held the body back since the clock started."""
    _linger: asyncio.TimerHandle | None
    _refused: bool

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._reading_head, self._head_bytes, self._heads, self._refused = True, 0, 0, False
        self._head_timer = self._body_timer = self._linger = None
        now = self.loop.time()
        limits = self.limits
        near_cap = self._near_cap()
        if near_cap:
            self.silent.sweep_soon(self.loop)  # not now: those silent may be unread yet
        if len(self.server_state.connections) - len(self.dropped) > limits.max_connections:
            longest_idle = next(iter(self.idle), None)
            if longest_idle is None or now - self.idle[longest_idle] < IDLE_GRACE_S:
                _warn(f"more than server.max_connections={limits.max_connections} busy (503)")
                self._refuse(self.too_many, REFUSAL_LINGER_S)
                return
            longest_idle.drop()  # it has nothing unanswered and sent nothing since: a plain close
        self.idle[self] = now
        self.silent.add(self, now)
        self._head_deadline = now + limits.header_timeout_s
        wait_s = min(limits.header_timeout_s, limits.silent_timeout_near_cap_s) if near_cap else limits.header_timeout_s
        self._head_timer = self.loop.call_later(wait_s, self._head_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        self.idle.pop(self, None)
        self.silent.discard(self)
        self.dropped.discard(self)
        self._cancel_timers()
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # lingering: dropped unread
        if self._reading_head:
            self._head_received(data)
        else:
            self._body_bytes += len(data)
            self._body_last = self.loop.time()
            super().data_received(data)
            if self.flow.read_paused:  # the app has not taken what came: the client waits for the gateway
                self._body_held = True
        if not (self._reading_head or self._refused or self._body_timer or self.transport.is_closing()):
            self._arm_body_timer()  # a body is on its way

    def _head_received(self, data: bytes) -> None:
        if not self._head_bytes:
            self.idle.pop(self, None)  # a request begins
            self.silent.discard(self)
        room = self.limits.max_header_bytes - self._head_bytes
        if len(data) <= room:
            self._head_bytes += len(data)
            super().data_received(data)
        else:
            # The parser gets no more of a head than the limit: feed up to it, and the rest only if that ended it
            # (the rest then starts a body or the next request, under the same rule).
            heads = self._heads
            self._head_bytes += room
            super().data_received(data[:room])
            if self.transport.is_closing():
                return
            if self._heads == heads:
                _warn(f"a request head longer than server.max_header_bytes={self.limits.max_header_bytes} (431)")
                self._refuse(self.too_large)
                return
            self.data_received(data[room:])
            return
        if self._reading_head and self._head_timer is None and not self._responding():
            # The next request on a kept-alive connection came in part: its head must be complete in time too.
            # (A head pipelined behind a response still being sent waits for it; uvicorn's keep-alive timeout
            # bounds it from there.)
            self._head_deadline = self.loop.time() + self.limits.header_timeout_s
            self._head_timer = self.loop.call_at(self._head_deadline, self._head_timed_out)

    # httptools parser callbacks

    def on_headers_complete(self) -> None:
        self._reading_head = False
        self._heads += 1
        self._cancel_head_timer()
        self._body_since = self._body_last = self.loop.time()  # a body's clock starts (its timer once one comes)
        self._body_bytes = 0
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._reading_head, self._head_bytes = True, 0
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    # The callback uvicorn's response cycle calls when a response is sent

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._reading_head and not self._head_bytes and not self._responding() and not self.transport.is_closing():
            self.idle[self] = self.loop.time()  # nothing of a next request yet

    # ---

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        now = self.loop.time()
        if not self._head_bytes:  # it never said anything: nobody to answer
            if self._near_cap():
                self.silent.sweep_soon(self.loop)  # and others silent as long
            self.drop()
        elif now < self._head_deadline:  # it spoke within the first byte's time near the cap
            self._head_timer = self.loop.call_at(self._head_deadline, self._head_timed_out)
        else:
            _warn(f"a request head not complete within server.header_timeout_s={self.limits.header_timeout_s} (408)")
            self._refuse(self.timed_out)

    def _arm_body_timer(self) -> None:
        self._body_held = self._holding_body()
        self._body_timer = self.loop.call_at(self._body_since + self.limits.body_timeout_s, self._body_timed_out)

    def _holding_body(self) -> bool:
        """Whether the gateway holds the body back: reading paused, or the `100 Continue` it waits for not sent."""
        return self.flow.read_paused or (self.cycle is not None and self.cycle.waiting_for_100_continue)

    def _body_timed_out(self) -> None:
        self._body_timer = None
        if self._reading_head or self.transport.is_closing() or self.transport.get_protocol() is not self:
            return  # complete, closed, or upgraded to another protocol
        if self._body_held or self._holding_body():
            # The client may have waited for the gateway meanwhile: its clock starts again.
            self._body_since = self._body_last = self.loop.time()
            self._body_bytes = 0
            self._arm_body_timer()
            return
        limits = self.limits
        deadline = self._body_last + limits.body_timeout_s
        if limits.min_body_rate_bytes_s:
            floor = self._body_since + limits.body_timeout_s + self._body_bytes / limits.min_body_rate_bytes_s
            deadline = min(deadline, floor)
        if self.loop.time() < deadline:
            self._body_timer = self.loop.call_at(deadline, self._body_timed_out)
            return
        _warn(
            f"a request body slower than server.min_body_rate_bytes_s={limits.min_body_rate_bytes_s} or silent for "
            f"server.body_timeout_s={limits.body_timeout_s:g} (408)"
        )
        cycle = self.cycle
        if cycle.response_started or self.pipeline:
            # Answered already (the app did not wait for the body), or another request's response under way.
            self._refused = True
            self.transport.close()
            return
        cycle.disconnected = True  # the app's read of the body ends now, and nothing it sends goes out
        cycle.message_event.set()
        self._answer(self.body_timed_out, LINGER_S)

    def _near_cap(self) -> bool:
        return len(self.server_state.connections) - len(self.dropped) >= self.limits.near_cap

    def drop(self) -> None:
        """Closes this connection without a word (it has nothing unanswered)."""
        self.idle.pop(self, None)
        self.silent.discard(self)
        if not self.transport.is_closing():
            self.dropped.add(self)
            self.transport.close()

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _cancel_timers(self) -> None:
        self._cancel_head_timer()
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _responding(self) -> bool:
        """Whether a response is being sent on this connection (a request pipelined behind it is waiting)."""
        return self.cycle is not None and not self.cycle.response_complete

    def _refuse(self, answer: bytes, linger_s: float = LINGER_S) -> None:
        if self._responding():
            # An answer now would land inside the response under way: a client that pipelined a request past a
            # limit gets the connection closed instead.
            self._refused = True
            self._cancel_timers()
            self.transport.close()
            return
        self._answer(answer, linger_s)

    def _answer(self, answer: bytes, linger_s: float) -> None:
        """Answers `answer`, then closes the connection after a lingering close (the module docstring)."""
        self._refused = True
        self._cancel_timers()
        self.transport.write(answer)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        # The client's EOF closes the transport (the parent's eof_received); this bounds a client that never sends it.
        self._linger = self.loop.call_later(linger_s, self.transport.close)


def _body_timeout_message(limits: ConnectionLimits) -> str:
    paused = f"no byte of the request body came for {limits.body_timeout_s:g} s (server.body_timeout_s)"
    if not limits.min_body_rate_bytes_s:
        return paused
    return (
        f"{paused}, or it came slower than {limits.min_body_rate_bytes_s} bytes/s after its first "
        f"{limits.body_timeout_s:g} s (server.min_body_rate_bytes_s)"
    )


def protocol_class(limits: ConnectionLimits) -> type[LimitedHttpToolsProtocol]:
    """A protocol class for uvicorn's `http=` that enforces `limits` (a class per server: uvicorn makes the
    protocol itself, with no room for arguments of ours)."""
    attributes = {
        "limits": limits,
        "idle": {},
        "silent": SilentConnections(limits.silent_timeout_near_cap_s),
        "dropped": set(),
        "too_large": _answer(
            431,
            "Request Header Fields Too Large",
            "invalid_request_error",
            "request_header_fields_too_large",
            f"the request line and headers exceed {limits.max_header_bytes} bytes (server.max_header_bytes)",
        ),
        "too_many": _answer(
            503,
            "Service Unavailable",
            "service_unavailable",
            "too_many_connections",
            f"the gateway has {limits.max_connections} client connections busy (server.max_connections); retry",
        ),
        "timed_out": _answer(
            408,
            "Request Timeout",
            "invalid_request_error",
            "request_header_timeout",
            f"the request head was not complete within {limits.header_timeout_s:g} s (server.header_timeout_s)",
        ),
        "body_timed_out": _answer(
            408,
            "Request Timeout",
            "invalid_request_error",
            "request_body_timeout",
            _body_timeout_message(limits),
        ),
    }
    return type("LimitedHttpToolsProtocol", (LimitedHttpToolsProtocol,), attributes)
