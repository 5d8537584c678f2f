"""Paced stream reads: a replica's streams are read at most once per interval, so the events an engine sends one
token at a time reach the gateway, and go on to the caller, several to a socket read and to a write."""

from __future__ import annotations

import asyncio

__all__ = ["ReadPacer"]


class ReadPacer:
    """Holds the sockets of a replica's streams unread, after each read, until the next tick of one shared timer.

    An engine run without a stream interval sends one event per token on every stream. Read as it comes, each
    token costs the gateway a socket read, a pass through the layers above and a write to the caller, about what
    a compiled router spends on the whole token. A stream held for up to `interval_s` after each read takes, at
    its next read, every event that arrived meanwhile, and the layers above handle them as one delta: CPU per
    token falls with the events per read, at the price of up to `interval_s` more between tokens.

    Streams are held only while at least `min_streams` of the replica's are open: the CPU is worth saving when
    many streams run (an RL rollout), and a few interactive ones keep every token as it comes. A stream's first
    read is never held (the time to its first token stays the engine's), nor any read once its answer ended. A
    weight update suspends the holding (`suspend`, from the engine's pause to its resume), so that the partial
    answers of aborted requests come in at once and their continuations are ready for the resume. Only sockets
    being read are held: one that its client stopped for flow control (a reader behind) is left to the client.
    `interval_s` 0 holds nothing.
    """

    __slots__ = ("_handle", "_held", "_suspended", "holds", "interval_s", "min_streams", "streams")

    def __init__(self, interval_s: float = 0.0, min_streams: int = 1) -> None:
        if interval_s < 0 or min_streams < 1:
            raise ValueError(f"a pacer needs interval_s >= 0 and min_streams >= 1, not {interval_s}, {min_streams}")
        self.interval_s = interval_s
        self.min_streams = min_streams
        self.streams = 0  # open streams of the replica (`sse_batches` counts them)
        self.holds = 0  # reads held so far (the gateway's metrics read it at scrape)
        self._held: list[asyncio.Transport] = []
        self._handle: asyncio.TimerHandle | None = None
        self._suspended = not interval_s  # an interval of 0 holds nothing, ever

    @property
    def held(self) -> int:
        """How many sockets wait for the next tick."""
        return len(self._held)

    def hold(self, transport: asyncio.Transport | None) -> None:
        """Stop reading `transport` until the next tick (nothing while suspended, while fewer than `min_streams`
        are open, or if it is closing or not being read)."""
        if (
            self._suspended
            or self.streams < self.min_streams
            or transport is None
            or transport.is_closing()
            or not transport.is_reading()
        ):
            return
        transport.pause_reading()
        self.holds += 1
        self._held.append(transport)
        if self._handle is None:
            self._handle = asyncio.get_running_loop().call_later(self.interval_s, self._release)

    def suspend(self) -> None:
        """Read every held socket now, and hold none until `restore`."""
        self._suspended = True
        self._release()

    def restore(self) -> None:
        """Hold sockets again (after `suspend`; an interval of 0 still holds none)."""
        self._suspended = not self.interval_s

    def _release(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        held, self._held = self._held, []
        for transport in held:
            if not transport.is_closing():
                transport.resume_reading()
