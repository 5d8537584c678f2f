"""Errors raised by engine adapters (the backend branch of the gateway's exception tree) and by the engine
launcher (`backends/launcher.py`).

They live here (not in `gateway/`) so that `backends/` depends on nothing in `gateway/`; `gateway/errors.py`
re-exports them and documents the whole tree. Their root, `GatewayError`, is in `common/errors.py`.
"""

from __future__ import annotations

from pathlib import Path

from common.errors import GatewayError


class BackendError(GatewayError):
    """An engine replica failed. `replica` names it; `retryable` says whether resuming elsewhere can help."""

    status_code = 502
    error_type = "backend_error"
    retryable = True

    def __init__(self, message: str, *, replica: str | None = None, code: str | None = None) -> None:
        super().__init__(message, code=code)
        self.replica = replica


class BackendUnavailable(BackendError):
    """Connection refused/reset, replica down, or paused and rejecting new requests (503)."""

    status_code = 503
    error_type = "service_unavailable"


class BackendTimeout(BackendError):
    """Connect, read or pool timeout."""

    status_code = 504
    error_type = "timeout_error"


class BackendProtocolError(BackendError):
    """The replica answered something its contract does not allow (bad JSON, missing field, wrong shape)."""

    status_code = 502


class WeightsNotLoaded(BackendError):
    """The engine answered that a weight load failed, and kept the weights it had: SGLang's
    `/update_weights_from_disk` rolls back to them; vLLM's `reload_weights` fails before it touches them when the
    checkpoint cannot be read (a missing path). Raised only on such an answer: after a timeout or a lost connection
    nobody knows which weights the engine holds, and the error stays a plain `BackendTimeout`/`BackendUnavailable`."""

    retryable = False


class BackendRejected(BackendError):
    """The replica refused the request itself (4xx): resending it elsewhere will not help."""

    status_code = 400
    error_type = "invalid_request_error"
    retryable = False


class EngineLaunchError(GatewayError):
    """A local engine server (`backends/launcher.py`) could not be started: it exited during startup or was not
    healthy in time. `log` is the file with its output, where it ran at all."""

    error_type = "engine_launch_error"

    def __init__(self, message: str, *, log: Path | None = None) -> None:
        super().__init__(message)
        self.log = log


class EngineNotInstalled(EngineLaunchError):
    """The engine's python or the model to serve is missing; the message says where it was looked for and that
    `scripts/engines/setup.sh` prepares both."""


__all__ = [
    "BackendError",
    "BackendProtocolError",
    "BackendRejected",
    "BackendTimeout",
    "BackendUnavailable",
    "EngineLaunchError",
    "EngineNotInstalled",
    "WeightsNotLoaded",
]
