"""`fastpath:`: the switches of the fast path's parts (`gateway/fastpath/`)."""

from __future__ import annotations

from pydantic import Field

from gateway.config.section import Section


class FastPathConfig(Section):
    """The fast path (`gateway/fastpath/`, docs/architecture.md): the gateway's own versions of library code,
    shorter ones on its hot routes and those no public API offers. `enabled: false` runs the gateway on the
    libraries' public APIs alone (same answers, more CPU, weaker connection and slow-client limits); the other
    switches turn one part off each, for measuring it (`benchmarks/ab.py --set-b RG_FASTPATH__<PART>=false`)."""

    enabled: bool = Field(True, description="Off: every part below is off.")
    hot_routes: bool = Field(True, description="Hot routes served from the app's entry, past router and wrappers.")
    one_pass_routes: bool = Field(True, description="Hot routes' bodies read and validated in one pass.")
    redis_batching: bool = Field(True, description="Concurrent turns' Redis pipelines sent as one.")
    engine_client: bool = Field(True, description="Generation requests over the gateway's own HTTP/1.1 pool.")
    server_send: bool = Field(
        True, description="Streamed bodies sent past the middlewares; a slow client's connection aborted at once."
    )
    server_protocol: bool = Field(
        True,
        description="Connection limits where bytes arrive (431, 408, idle ones closed past the cap).",
    )

    def on(self, part: str) -> bool:
        """Whether `part` (a switch's name) is on: its own switch and `enabled` both."""
        return self.enabled and bool(getattr(self, part))
