"""The gateway's one exception tree.

```
GatewayError                      base of every error the gateway raises on purpose
├── ConfigError                   bad configuration; names the key (raised at start)
├── InvalidRequest                400: malformed or out-of-range input; names the field
├── Unauthorized                  401: missing credentials
├── Forbidden                     403: wrong credentials
├── SessionNotFound               404: unknown session id
├── Conflict                      409: e.g. a weight version older than or equal to the current one
├── Overloaded                    429: backpressure; carries `retry_after_s`
├── BackendError                  an engine replica misbehaved
│   ├── BackendUnavailable        503: connection refused/reset, replica down or paused-and-rejecting
│   ├── BackendTimeout            504: connect/read/pool timeout
│   └── BackendProtocolError      502: the replica answered something the contract does not allow
└── StoreError                    503: Redis unreachable past the retry budget
```

Foreign errors (httpx, redis) are translated into this tree inside `backends/` and `gateway/store.py`
only; nothing above those layers catches `httpx.*` or `redis.*`.
"""

from __future__ import annotations


class GatewayError(Exception):
    """Base class. `status_code` and `error_type` drive the OpenAI-style error response."""

    status_code: int = 500
    error_type: str = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class ConfigError(GatewayError):
    """The configuration is invalid. The message names the offending key."""

    error_type = "config_error"


class InvalidRequest(GatewayError):
    status_code = 400
    error_type = "invalid_request_error"


class Unauthorized(GatewayError):
    status_code = 401
    error_type = "authentication_error"


class Forbidden(GatewayError):
    status_code = 403
    error_type = "permission_error"


class SessionNotFound(GatewayError):
    status_code = 404
    error_type = "not_found_error"


class Conflict(GatewayError):
    status_code = 409
    error_type = "conflict_error"


class Overloaded(GatewayError):
    status_code = 429
    error_type = "rate_limit_error"

    def __init__(self, message: str, *, retry_after_s: float = 1.0, param: str | None = None) -> None:
        super().__init__(message, param=param)
        self.retry_after_s = retry_after_s


class BackendError(GatewayError):
    """An engine replica failed. `replica` names it when known."""

    status_code = 502
    error_type = "backend_error"

    def __init__(self, message: str, *, replica: str | None = None, code: str | None = None) -> None:
        super().__init__(message, code=code)
        self.replica = replica


class BackendUnavailable(BackendError):
    status_code = 503
    error_type = "service_unavailable"


class BackendTimeout(BackendError):
    status_code = 504
    error_type = "timeout_error"


class BackendProtocolError(BackendError):
    status_code = 502


class StoreError(GatewayError):
    status_code = 503
    error_type = "store_unavailable"


__all__ = [
    "BackendError",
    "BackendProtocolError",
    "BackendTimeout",
    "BackendUnavailable",
    "ConfigError",
    "Conflict",
    "Forbidden",
    "GatewayError",
    "InvalidRequest",
    "Overloaded",
    "SessionNotFound",
    "StoreError",
    "Unauthorized",
]
