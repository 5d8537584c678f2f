"""A streaming response that always runs its cleanup, even when its body iterator never started."""

from __future__ import annotations

from collections.abc import AsyncIterable, Awaitable, Callable

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


class GuardedStreamingResponse(StreamingResponse):
    """`StreamingResponse` + `on_close`, awaited however the response ends.

    Starlette cancels the body task when the client disconnects; if that happens while the response head is
    being sent, the body generator has not started, so its own `finally` never runs. Cleanup that must happen
    (releasing a session's turn lock, recording the turn) therefore lives here, not only in the generator.
    """

    def __init__(self, content: AsyncIterable[bytes], on_close: Callable[[], Awaitable[None]], media_type: str) -> None:
        super().__init__(content, media_type=media_type)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.on_close()
