"""The gateway's HTTP/1.1 server protocol: uvicorn's httptools protocol, letting go of a connection the moment it is
lost, however it was lost.

uvicorn cancels a connection's keep-alive timer only when the connection closed cleanly: a client that resets it
(a killed agent, an abandoned socket) leaves the timer armed, and the timer holds the connection's protocol, its
last request cycle (scope, headers, events) and transport for `timeout_keep_alive` (30 s here). The protocol and
its cycle refer to each other, so when the timer lets go, the lot is garbage that only the cyclic collector frees.
"""

from __future__ import annotations

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = ["GatewayHttpProtocol"]


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
