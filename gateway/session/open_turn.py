"""`OpenTurn`: a turn of a session between its beginning and its end, the one owner of what it holds.

`SessionLifecycle.begin` (or `begin_group`) returns one, holding the caller's session slot (`SessionLease`) and the
session locks; the turn, once prepared and its session created, is handed to it (`adopt`). Closing it (`aclose`, or
leaving `async with`) ends the turn exactly once, however the request ended: an adopted turn is recorded and saved,
shielded from cancellation (`SessionLifecycle.record`); a turn refused before that stores nothing; then every lock
and lease is released, the last taken first. `closed_on_error` closes it if the block it guards raises, for the
steps between beginning a turn and handing it over.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any, Protocol, Self

from gateway.generation import GenerationState
from gateway.session.samples import Turn
from gateway.trajectory import SessionMeta

__all__ = ["ClosedOnError", "OpenTurn", "RecordedTurn", "TurnCloser"]

Reply = tuple[Turn, GenerationState, dict[str, Any] | None]


class RecordedTurn(Protocol):
    """What a turn records when it closes (`gateway.turns.prepared.PreparedTurn`)."""

    def replies(self) -> Iterable[Reply]:
        """Per choice: its turn, its generation, and the reply its sample keeps as conversation (None: none)."""
        ...


class TurnCloser(Protocol):
    """How an open turn ends (`SessionLifecycle`)."""

    async def record(self, turn: OpenTurn, recorded: RecordedTurn) -> None: ...

    def refused(self, turn: OpenTurn) -> None: ...


class OpenTurn:
    """A turn begun and not yet closed (see the module docstring). `session_id`: the session named (or made up) for
    the request, a group's base name for a group; `one_turn`: a session made up for this turn alone, finished with
    it; `meta`: the session as stored when the turn began (None: none yet); `owner`: the caller's key id."""

    def __init__(
        self, closer: TurnCloser, session_id: str, *, one_turn: bool = False, owner: str | None = None
    ) -> None:
        self.session_id = session_id
        self.one_turn = one_turn
        self.owner = owner
        self.meta: SessionMeta | None = None
        self.closed = False
        self._closer = closer
        self._held: list[Callable[[], Any]] = []
        self._turn: RecordedTurn | None = None

    def hold(self, release: Callable[[], Any]) -> None:
        """Release something when the turn closes (a lock, a lease), before what was held before it. A release is
        a plain call that cannot fail (a lock's release, a counter given back)."""
        self._held.append(release)

    def adopt(self, turn: RecordedTurn) -> None:
        """The prepared turn, its session created: closing records it."""
        self._turn = turn

    async def aclose(self) -> None:
        """End the turn once: record the adopted turn (else nothing is stored), then release what it holds."""
        if self.closed:
            return
        self.closed = True
        # Let go of the prepared turn as it is recorded: it holds this handle, and the pair would otherwise wait for
        # the cyclic garbage collector with every token list of the turn.
        recorded, self._turn = self._turn, None
        try:
            if recorded is None:
                self._closer.refused(self)
            else:
                await self._closer.record(self, recorded)
        finally:
            # A list, not an ExitStack: its bookkeeping cost more than the turn's two releases on every request.
            for release in reversed(self._held):
                release()
            self._held.clear()

    def closed_on_error(self) -> ClosedOnError:
        """Close the turn if the block raises (refused: nothing stored, everything released); else leave it open."""
        return ClosedOnError(self)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        await self.aclose()


class ClosedOnError:
    """`OpenTurn.closed_on_error`'s guard: closes the turn if its block raises (a cancellation included). A class,
    not a generator-based context manager: it runs twice on every turn's way in, where the generator's machinery
    cost more than the rest of the step."""

    __slots__ = ("_turn",)

    def __init__(self, turn: OpenTurn) -> None:
        self._turn = turn

    async def __aenter__(self) -> OpenTurn:
        return self._turn

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if kind is not None:
            await self._turn.aclose()
