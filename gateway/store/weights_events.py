"""The control events of the weights bus (`rg:control`), typed: parsed once where the bus reads them, written as the
same JSON objects as always, so that gateways of two releases (a rolling deploy) understand each other.

On the wire each is an object with `event` (its kind), the fields below, and `origin` (the sending process, added by
`WeightsBus.announce`). A field of the wrong type reads as absent; an event of an unknown kind is skipped.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Commit", "Drained", "Pausing", "Serving", "Subscribed", "WeightsEvent", "parse_event"]


@dataclass(frozen=True, slots=True)
class Pausing:
    """The update `token` begins: stop dispatching. `version` None: an out-of-band pause. In `wait` mode, each other
    process drains its own requests and reports it (`Drained`). Re-sent every heartbeat while drain reports are
    missing. `token` None: sent by a gateway older than update tokens. `transfer`: the pause of an in-memory transfer
    of that version, which any process may have committed (`Commit`). The same JSON is kept beside the update's lock
    (`Keys.weights_update`) for the processes that miss the event."""

    version: int | None
    mode: str
    token: str | None
    transfer: int | None = None  # the version an in-memory transfer under this lock commits (`version` stays None)

    def to_wire(self) -> dict[str, Any]:
        wire = {"event": "pausing", "version": self.version, "mode": self.mode, "token": self.token}
        return wire if self.transfer is None else wire | {"transfer": self.transfer}


@dataclass(frozen=True, slots=True)
class Serving:
    """An update (or a recovery) ended: the pool serves `version` (the previous one after a failed update), loaded
    from `source`; `updated` run it, `stale` are held out. `token`: the lock the update held (None from a gateway
    older than it), so that a process that relayed its commit knows its result."""

    version: int | None
    source: str | None = None
    status: str | None = None
    updated: tuple[str, ...] = ()
    stale: tuple[str, ...] = ()
    token: str | None = None

    def to_wire(self) -> dict[str, Any]:
        wire = {
            "event": "serving",
            "version": self.version,
            "source": self.source,
            "status": self.status,
            "updated": list(self.updated),
            "stale": list(self.stale),
        }
        return wire if self.token is None else wire | {"token": self.token}


@dataclass(frozen=True, slots=True)
class Commit:
    """`POST /admin/weights/{version}/commit` reached a process other than the one that holds the in-memory transfer
    of `version` under the lock `token`: that one commits it, and its `Serving` (with `token`) is the answer."""

    version: int
    token: str

    def to_wire(self) -> dict[str, Any]:
        return {"event": "commit", "version": self.version, "token": self.token}


@dataclass(frozen=True, slots=True)
class Drained:
    """A process's own requests are drained for the `wait` update `token`."""

    token: str

    def to_wire(self) -> dict[str, Any]:
        return {"event": "drained", "token": self.token}


@dataclass(frozen=True, slots=True)
class Subscribed:
    """Not on the wire: this process's subscription to the control channel is (again) in place. Events sent while it
    was not (before the first, during a Redis restart or failover) never reached it: what they said is read from
    `rg:weights` and its lock."""


WeightsEvent = Pausing | Serving | Drained | Commit


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _str(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _ids(value: object) -> tuple[str, ...]:
    return tuple(str(v) for v in value) if isinstance(value, list) else ()


def parse_event(raw: Mapping[str, Any]) -> WeightsEvent | None:
    """The event a wire object carries; None for a kind this release does not know (or a `drained` or `commit`
    without what it needs)."""
    kind = raw.get("event")
    if kind == "pausing":
        mode, token = _str(raw.get("mode")) or "abort", _str(raw.get("token"))
        return Pausing(_int(raw.get("version")), mode, token, _int(raw.get("transfer")))
    if kind == "serving":
        return Serving(
            _int(raw.get("version")),
            _str(raw.get("source")),
            _str(raw.get("status")),
            _ids(raw.get("updated")),
            _ids(raw.get("stale")),
            _str(raw.get("token")),
        )
    if kind == "commit":
        version, token = _int(raw.get("version")), _str(raw.get("token"))
        return Commit(version, token) if version is not None and token is not None else None
    if kind == "drained":
        token = _str(raw.get("token"))
        return Drained(token) if token is not None else None
    return None
