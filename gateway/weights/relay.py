"""A commit relayed on the weights bus: `POST /admin/weights/{version}/commit` reached a gateway process other than
the one holding the in-memory transfer of `version` (a load balancer in front of the fleet picks any).

The lock the transfer holds names its version (`Pausing.transfer`). The process that got the commit sends `commit`
with the lock's token; the holder commits (`Transfers.commit_asked`) and its `serving` event, naming the token, is the
answer. Sent again every heartbeat while the lock still names the token (the holder's subscription may have been
down: it commits once). An answer missed the same way is read from `rg:weights` once the lock is let go.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import cast, get_args

from backends.base import PauseMode
from gateway.errors import StoreError, WeightsNotUpdated, WeightsUpdateTimedOut
from gateway.store import Commit, Serving, WeightsBus, WeightsRecord
from gateway.weights.report import UpdateReport

__all__ = ["CommitRelay"]


class CommitRelay:
    """This process's commits of transfers other processes hold, and their answers as they come."""

    def __init__(self, bus: WeightsBus, heartbeat_s: float, timeout_s: float) -> None:
        self.bus = bus
        self.heartbeat_s = heartbeat_s
        self.timeout_s = timeout_s
        self._waiting: dict[str, asyncio.Future[Serving]] = {}

    def serving_seen(self, event: Serving) -> None:
        """A `serving` event arrived: the answer of a commit relayed here, where it names one's lock."""
        waiting = self._waiting.get(event.token) if event.token is not None else None
        if waiting is not None and not waiting.done():
            waiting.set_result(event)

    async def commit(self, version: int) -> UpdateReport | None:
        """The report of the transfer of `version` another process holds, committed there (a failed one raised as
        the holder's answer would be); None where no process holds one."""
        update = await self.bus.update_under_way()
        if update is None or update.transfer != version or update.token is None:
            return None
        return _report(version, update.mode, await self._result(version, update.token))

    async def _result(self, version: int, token: str) -> Serving:
        result: asyncio.Future[Serving] = asyncio.get_running_loop().create_future()
        self._waiting[token] = result
        deadline = time.monotonic() + self.timeout_s
        try:
            while True:
                with contextlib.suppress(StoreError):  # Redis away: again a heartbeat later
                    await self.bus.announce(Commit(version, token))
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.heartbeat_s):
                        return await asyncio.shield(result)
                with contextlib.suppress(StoreError):
                    if await self.bus.holder() != token:  # it ended, and its `serving` did not reach this process
                        return _as_result(await self.bus.read(), version, token)
                if time.monotonic() > deadline:
                    raise WeightsUpdateTimedOut(
                        f"the in-memory transfer of version {version}, held by another gateway process, was not "
                        f"committed within weights.update_timeout_s = {self.timeout_s:g} s",
                        {"requested_version": version},
                    )
        finally:
            self._waiting.pop(token, None)


def _as_result(record: WeightsRecord | None, version: int, token: str) -> Serving:
    """The answer as `rg:weights` records it: the transfer's version, or the previous one where it failed."""
    if record is None or record.version != version:
        previous = record.version if record is not None else None
        return Serving(previous, status="failed", stale=record.stale if record else (), token=token)
    status = "partial" if record.stale else "updated"
    return Serving(version, record.source, status, record.updated, record.stale, token)


def _report(version: int, mode: str, result: Serving) -> UpdateReport:
    """The holder's answer, as this process answers it: the report, or the holder's failure raised."""
    if result.status == "failed" or result.version != version:
        serving = f"version {result.version} serves" if result.version is not None else "no version is recorded"
        raise WeightsNotUpdated(
            f"the in-memory transfer of version {version}, committed by the gateway process that holds it, loaded "
            f"on no replica; {serving} (stale: {list(result.stale)}; that process's log names each replica's error)",
            {"version": result.version, "requested_version": version, "status": "failed", "stale": list(result.stale)},
        )
    pause_mode = cast(PauseMode, mode if mode in get_args(PauseMode) else "abort")
    return UpdateReport(version, pause_mode, updated=list(result.updated), stale=list(result.stale))
