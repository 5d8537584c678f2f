"""`SegmentWatch`: one engine request in flight on a replica, as its replica's pool and its stall timer see it.

A hung replica (a stopped process, a wedged engine) keeps its sockets open and sends nothing, so without a watch
its requests would wait out the read timeout (`generation.read_timeout_s`, 600 s by default). Two things end that
wait early; either raises, in the task reading the answer, an error the resume loop takes as it takes a broken
connection (the tokens so far are kept, the request resumes on another replica):

* the pool takes the replica out (its health probe fails, its circuit opens): `interrupt`, `ReplicaWentDown`;
* a streamed answer sends nothing for `stall_s` once its first chunk came: `ReplicaStalled`. A wait while the
  weights do not serve (an update holds the engines, `keep` mode included) is not timed, nor the time the reading
  task spends elsewhere (handing tokens to a caller that is behind);
* a streamed answer's first chunk does not come for `first_token_s` while its replica sent no token for any request
  either (`Replica.progressed_at`): `ReplicaStalled` too. A request merely queued behind others, or prefilled
  beside them, waits as long as the others move.

The watch cancels the reading task only while it waits for the engine (`reading`); while it is elsewhere, the next
wait (`next_chunk`) raises instead. A cancellation the watch sent is withdrawn (`Task.uncancel`) and becomes the
error, as `asyncio.timeout` does; one that came from elsewhere as well stays a cancellation. The stall timer is one
timer per segment, moved on only when it fires, as `backends.http_client`'s read-gap watch does.

A third ends a segment without blaming its replica: the staleness budget moved past the segment's sample while it
ran on through a `keep` update (`end`, with `CutForStaleness`; the generator compares `first_version`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from gateway.errors import GatewayError, ReplicaStalled, ReplicaWentDown
from gateway.routing.replica import Replica

__all__ = ["SegmentWatch"]


class SegmentWatch:
    """Watches one segment's engine request, read by the current task. `stall_s` 0: no stall timer (a whole answer
    brings its tokens at its end). `quiet_since()` is the monotonic time from which silence counts as a stall (the
    end of the last weight update), or None while the weights do not serve."""

    __slots__ = (
        "_awaiting_first",
        "_cancel_sent",
        "_first_token_s",
        "_handle",
        "_loop",
        "_quiet_since",
        "_replica",
        "_task",
        "error",
        "first_version",
        "reading",
        "replica",
        "stall_s",
        "started",
    )

    def __init__(
        self,
        replica: Replica,
        stall_s: float,
        quiet_since: Callable[[], float | None],
        first_version: int | None = None,
        first_token_s: float = 0.0,
    ) -> None:
        self._loop = asyncio.get_running_loop()
        task = asyncio.current_task(self._loop)
        assert task is not None, "a segment is read by a task"
        self._task = task
        self._replica = replica
        self.replica = replica.id
        self.stall_s = stall_s
        self._first_token_s = first_token_s
        self._awaiting_first = False
        self._quiet_since = quiet_since
        self.reading = False  # the task waits for the engine's next chunk
        self.started = 0.0  # monotonic time that wait began
        self.first_version = first_version  # the weight version of its sample's first token (staleness)
        self.error: GatewayError | None = None  # why the segment must end, once it must
        self._cancel_sent = False
        self._handle: asyncio.TimerHandle | None = None

    def first_chunk(self) -> None:
        """The task waits for the engine's first chunk: timed only against the replica's progress on every request
        (`first_token_s`; the engine may queue the request, or prefill it)."""
        if self.error is not None:
            raise self.error
        self.started = time.monotonic()
        self.reading = True
        if self._first_token_s:
            self._awaiting_first = True
            self._handle = self._loop.call_later(self._first_token_s, self._check_first)

    def next_chunk(self) -> None:
        """The task waits for the engine's next chunk: the stall timer runs from now."""
        if self.error is not None:
            raise self.error
        if self._awaiting_first:
            self._awaiting_first = False
            self._disarm()
        self.started = time.monotonic()
        self.reading = True
        if self._handle is None and self.stall_s:
            self._handle = self._loop.call_later(self.stall_s, self._check)

    def interrupt(self, reason: str) -> None:
        """The pool took the replica out: end the segment now (or at its next wait)."""
        self._end(
            ReplicaWentDown(f"replica {self.replica} was taken out ({reason}) while generating", replica=self.replica)
        )

    def end(self, error: GatewayError) -> None:
        """End the segment now (or at its next wait) with `error`, unless it is ending already."""
        self._end(error)

    def withdraw(self) -> GatewayError | None:
        """On a cancellation of the task: the error to raise instead when the watch sent it, withdrawn; None when it
        is (also) someone else's, which must go on."""
        if not self._cancel_sent:
            return None
        self._cancel_sent = False
        if self._task.uncancel() > 0:
            return None
        return self.error

    def close(self) -> None:
        """The segment ended. A cancellation the watch sent that a layer below turned into another error (a read
        timeout at the same moment) is withdrawn here."""
        self.reading = False
        self.error = None  # raised by now, if at all: its traceback holds the frame that holds this watch
        self._disarm()
        if self._cancel_sent:
            self._cancel_sent = False
            self._task.uncancel()

    def _disarm(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _check(self) -> None:
        self._handle = None
        if self.error is not None:
            return
        now = time.monotonic()
        since = self._quiet_since()
        if since is None or not self.reading:  # the weights do not serve, or the caller is behind: not a stall
            self._handle = self._loop.call_later(self.stall_s, self._check)
            return
        due = max(self.started, since) + self.stall_s
        if now < due:
            self._handle = self._loop.call_later(due - now, self._check)
            return
        self._end(
            ReplicaStalled(
                f"replica {self.replica} sent nothing for {self.stall_s:g} s (generation.stall_timeout_s)",
                replica=self.replica,
            )
        )

    def _check_first(self) -> None:
        self._handle = None
        if self.error is not None or not self._awaiting_first:
            return
        since = self._quiet_since()
        if since is None:  # the weights do not serve: an update holds the engines
            self._handle = self._loop.call_later(self._first_token_s, self._check_first)
            return
        now = time.monotonic()
        due = max(self.started, since, self._replica.progressed_at) + self._first_token_s
        if now < due:
            self._handle = self._loop.call_later(due - now, self._check_first)
            return
        self._end(
            ReplicaStalled(
                f"replica {self.replica} sent no first token for {self._first_token_s:g} s and no token for any other "
                "request meanwhile (generation.first_token_timeout_s)",
                replica=self.replica,
            )
        )

    def _end(self, error: GatewayError) -> None:
        if self.error is not None:
            return
        self.error = error
        self._disarm()
        if self.reading:
            self._cancel_sent = True
            self._task.cancel()
