"""The gateway's one exception tree.

```
GatewayError                      base of every error the gateway raises on purpose
├── ConfigError                   bad configuration; names the key (raised at start)
├── InvalidRequest                400: malformed or out-of-range input; names the field
├── Unauthorized                  401: missing credentials
├── Forbidden                     403: wrong credentials
├── NotFound                      404: unknown resource (replica, ...)
│   └── SessionNotFound           404: unknown session id
├── Conflict                      409: e.g. a weight version older than or equal to the current one
├── SampleStale                   410: the turn would extend a sample cut for staleness (code `sample_stale`)
├── Overloaded                    429: backpressure; carries `retry_after_s`
├── CutForStaleness               a segment in flight whose sample the budget passed ends "stale" (never answered)
├── EngineAhead                   a segment whose first token came from weights newer than its salt is redone (never
│                                  answered)
├── BackendError                  an engine replica misbehaved
│   ├── BackendUnavailable        503: connection refused/reset, replica down or paused-and-rejecting
│   │   └── ReplicaWentDown       503: the pool took the replica out while it generated (resumed elsewhere)
│   ├── BackendTimeout            504: connect/read/pool timeout
│   │   ├── DeadlinePassed        504: the request's own deadline passed (not retried, no replica blamed)
│   │   └── ReplicaStalled        504: a stream sent no token for generation.stall_timeout_s (resumed elsewhere)
│   ├── BackendProtocolError      502: the replica answered something the contract does not allow
│   ├── WeightsNotLoaded          502: the replica refused a weight load and kept the weights it had
│   └── BackendRejected           400: the replica refused the request itself (not retryable)
├── WeightsNotUpdated             502: a weight update loaded on no replica; the previous version still serves
├── StoreError                    503: Redis unreachable past the retry budget
│   └── WeightsNotRecorded        503: a weight update ran, but its record (`rg:weights`) did not reach Redis's
│                                      replicas (`redis.durable_replicas`) or Redis at all (code `weights_not_recorded`)
└── EngineLaunchError             a local engine server could not be started (backends/launcher.py)
    └── EngineNotInstalled        its python or model is missing (scripts/engines/setup.sh)
```

The `Backend*` branch and the `Engine*` branch are defined in `backends/errors.py` so that engine adapters (and
the engine launcher) depend on nothing in `gateway/`, and their root `GatewayError` in `common/errors.py`, below
both; they are re-exported here. Foreign errors (aiohttp, redis) are translated into this tree inside `backends/`
and `gateway/store/` only; nothing above those layers catches `aiohttp.*` or `redis.*`.
"""

from __future__ import annotations

from backends.errors import (
    BackendError,
    BackendProtocolError,
    BackendRejected,
    BackendTimeout,
    BackendUnavailable,
    EngineLaunchError,
    EngineNotInstalled,
    WeightsNotLoaded,
)
from common.errors import GatewayError


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


class NotFound(GatewayError):
    status_code = 404
    error_type = "not_found_error"


class SessionNotFound(NotFound):
    pass


class Conflict(GatewayError):
    status_code = 409
    error_type = "conflict_error"


class CutForStaleness(GatewayError):
    """A segment in flight whose sample's first token fell behind the staleness budget while it ran on through a
    weight update that kept it (a `keep` pause): the generator ends it with its tokens so far and finish reason
    "stale" (`Generator.cut_behind`). Handled there; no client ever gets it."""


class EngineAhead(GatewayError):
    """A segment's engine labelled its first token with a newer weight version than the one its request was
    dispatched and cache-salted for: this process had not heard of that update (a missed `serving` event, a start
    while Redis was away), and the engine may have reused prefix KV its old salt cached under the old weights. The
    generator drops the segment before any of its tokens is handed out, has the replica's weights checked and
    resumes it under the new salt (`Generator._engine_ahead`). Handled there; no client ever gets it."""

    def __init__(self, message: str, *, replica: str, version: int) -> None:
        super().__init__(message)
        self.replica = replica
        self.version = version


class SampleStale(GatewayError):
    """A turn would extend a sample beyond the staleness budget (docs/features.md, "Staleness budget"): its first
    token's version is older than the version served minus `weights.max_staleness`. The sample is kept, marked
    stale; the session ends here (finish it, or start another). 410, not 409: clients (the openai package among
    them) retry a 409, and no retry can make the sample fresh again."""

    status_code = 410
    error_type = "invalid_request_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = "sample_stale") -> None:
        super().__init__(message, param=param, code=code)


class Overloaded(GatewayError):
    status_code = 429
    error_type = "rate_limit_error"

    def __init__(
        self, message: str, *, retry_after_s: float = 1.0, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message, param=param, code=code)
        self.retry_after_s = retry_after_s


class DeadlinePassed(BackendTimeout):
    """The request's own deadline (`generation.request_timeout_s`) passed while a replica generated for it: the
    engine request is aborted, no replica is blamed, nothing is retried."""

    retryable = False


class ReplicaWentDown(BackendUnavailable):
    """The pool took the replica out (its health probe failed, its circuit opened) while a request generated on it:
    the request resumes on another replica at once, with its tokens so far. The pool knows already: nothing more is
    counted against the replica."""


class ReplicaStalled(BackendTimeout):
    """A streamed engine answer sent no token for `generation.stall_timeout_s` after its first one (a hung engine
    keeps its sockets open): a failure of its replica, counted; the request resumes on another one."""


class WeightsNotUpdated(GatewayError):
    """`POST /admin/weights` loaded the new version on no replica. The gateway's version is unchanged, and every
    replica that kept the previous weights serves on; `details` carries the report (`errors` per replica, `kept`,
    `stale`) into the error object of the answer."""

    status_code = 502
    error_type = "backend_error"

    def __init__(self, message: str, details: dict[str, object]) -> None:
        super().__init__(message, code="weights_not_updated")
        self.details = details


class WeightsUpdateTimedOut(WeightsNotUpdated):
    """`POST /admin/weights` did not end within `weights.update_timeout_s` (an engine that never answers its pause
    or its load): it ended where it stood, the replicas it had not brought to the new version held out as stale or
    kept on the previous weights, and every one serving again; `details` as `WeightsNotUpdated`'s."""

    status_code = 504

    def __init__(self, message: str, details: dict[str, object]) -> None:
        super().__init__(message, details)
        self.code = "weights_update_timed_out"


class StoreError(GatewayError):
    """Redis could not be reached or answered an error. `str(error)` (logs) says what failed and how; the HTTP
    answer only that the store is unavailable, with a Retry-After: the cause may name Redis's host and port."""

    status_code = 503
    error_type = "store_unavailable"
    retry_after_s: float | None = 1.0

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message, param=param, code=code)
        self.message = "the trajectory store (Redis) is unavailable; retry shortly"


class WeightsNotRecorded(StoreError):
    """A weight update (or out-of-band resume) ran and its version serves, but its record in `rg:weights` is not
    durable: Redis did not take it within the retries, or fewer replicas than `redis.durable_replicas` acknowledged
    it, so a failover could lose it (another process would then adopt, and a recovery restore, the version before).
    The answer says so without Redis's address; `details` carries the version and the replicas serving it."""

    def __init__(self, message: str, details: dict[str, object]) -> None:
        super().__init__(message, code="weights_not_recorded")
        self.message = message
        self.details = details


__all__ = [
    "BackendError",
    "BackendProtocolError",
    "BackendRejected",
    "BackendTimeout",
    "BackendUnavailable",
    "DeadlinePassed",
    "ConfigError",
    "Conflict",
    "CutForStaleness",
    "EngineAhead",
    "EngineLaunchError",
    "EngineNotInstalled",
    "Forbidden",
    "GatewayError",
    "InvalidRequest",
    "NotFound",
    "Overloaded",
    "ReplicaStalled",
    "ReplicaWentDown",
    "SampleStale",
    "SessionNotFound",
    "StoreError",
    "Unauthorized",
    "WeightsNotLoaded",
    "WeightsNotRecorded",
    "WeightsNotUpdated",
]
