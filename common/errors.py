"""The root of the gateway's exception tree (`gateway/errors.py` documents the whole tree).

It lives here, below both `gateway/` and `backends/`, so that the engine adapters' errors (`backends/errors.py`)
and the gateway's own derive from one root while `backends/` depends on nothing in `gateway/`.
"""

from __future__ import annotations


class GatewayError(Exception):
    """Root of every error the gateway raises on purpose. `status_code` and `error_type` shape the HTTP answer."""

    status_code: int = 500
    error_type: str = "internal_error"
    # Extra fields of the error object in the HTTP answer, beside message, type, param and code (None: none).
    details: dict[str, object] | None = None
    # The answer's Retry-After, seconds (None: none).
    retry_after_s: float | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


__all__ = ["GatewayError"]
