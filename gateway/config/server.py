"""`server:`: the gateway's own HTTP listener, its credentials and its limits."""

from __future__ import annotations

import ipaddress

from pydantic import Field, SecretStr, model_validator

from gateway.config.api_keys import ApiKeys
from gateway.config.section import Seconds, Section

DEFAULT_ADMIN_TOKEN = "change-me"
# Above the capacity target of one process (docs/reliability.md): a bound an open gateway has by default.
DEFAULT_MAX_OPEN_SESSIONS = 20_000


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


class ServerConfig(Section):
    """The gateway's own HTTP listener and its credentials. The default admin token is refused on an interface
    other hosts reach (anyone could publish weights or remove replicas); on loopback it stays, for a first try."""

    host: str = Field("127.0.0.1", description="Interface to bind.")
    port: int = Field(8000, ge=0, le=65535, description="TCP port; 0 picks a free port (tests).")
    api_keys: ApiKeys = Field(
        (),
        repr=False,
        description="Keys accepted on agent routes, each a key or {id, key} (`gateway.config.api_keys`); empty: open.",
    )
    admin_token: SecretStr = Field(SecretStr(DEFAULT_ADMIN_TOKEN), description="Bearer token for /admin routes.")
    metrics_token: SecretStr | None = Field(
        None, description="Bearer token for /metrics and /dashboard/state; None leaves them open."
    )
    max_body_bytes: int = Field(16 * 1024 * 1024, ge=1, description="Largest accepted request body, bytes.")
    max_messages: int = Field(1024, ge=1, description="Most messages in one chat completion request.")
    max_tokens_limit: int = Field(32768, ge=1, description="Largest max_tokens one request may ask for.")
    max_sessions_per_key: int = Field(
        0, ge=0, description="Sessions with a request in flight per API key (per process); 0 = no limit."
    )
    max_open_sessions_per_key: int | None = Field(
        DEFAULT_MAX_OPEN_SESSIONS,
        ge=0,
        description=(
            "Sessions created and not finished per API key, across processes (Redis); without API keys, of all "
            "sessions together. 0 or null: no limit."
        ),
    )
    shutdown_timeout_s: Seconds = Field(
        30.0, description="On SIGTERM, how long in-flight requests may run before they are cut, seconds."
    )
    stream_buffer_bytes: int = Field(
        16 * 1024 * 1024, ge=1, description="Most bytes of a streamed answer queued for one client before it is cut."
    )
    stream_buffer_budget_bytes: int = Field(
        256 * 1024 * 1024,
        ge=1,
        description="Most bytes of streamed answers queued for their clients in this process, all streams together; "
        "past it the streams holding the most are cut.",
    )
    slow_client_timeout_s: Seconds = Field(
        60.0, description="How long one send to a streaming client may make no progress before it is cut, seconds."
    )
    max_header_bytes: int = Field(
        64 * 1024, ge=1024, description="Largest request head (request line and headers), bytes; more is a 431."
    )
    header_timeout_s: Seconds = Field(
        10.0, description="A connection that has not sent a complete request head within this is closed, seconds."
    )
    body_timeout_s: Seconds = Field(
        30.0,
        description="A request body with no byte for this long is answered 408, seconds; also the rate floor's grace.",
    )
    min_body_rate_bytes_s: int = Field(
        1024, ge=0, description="A body must arrive this fast on average past body_timeout_s, or 408; 0: no floor."
    )
    silent_timeout_near_cap_s: Seconds = Field(
        0.5,
        description="With half of max_connections open, a connection that has sent nothing is closed after this.",
    )
    max_connections: int | None = Field(
        None, ge=1, description="Client connections per process; then idle ones close, else 503; None: by fd limit."
    )

    def open_to_anyone(self) -> str | None:
        """A warning where anyone who reaches the gateway may fill its Redis with sessions: it listens beyond
        loopback, with neither API keys nor a bound on open sessions. None otherwise."""
        if _loopback(self.host) or self.api_keys or self.max_open_sessions_per_key:
            return None
        return (
            f"host {self.host!r} lets other hosts in, with no server.api_keys and server.max_open_sessions_per_key "
            "off: anyone who reaches the gateway may create sessions without bound (their metadata kept in Redis). "
            f"Set server.api_keys, or server.max_open_sessions_per_key (default {DEFAULT_MAX_OPEN_SESSIONS})"
        )

    @model_validator(mode="after")
    def _no_default_admin_token_beyond_loopback(self) -> ServerConfig:
        if self.admin_token.get_secret_value() == DEFAULT_ADMIN_TOKEN and not _loopback(self.host):
            raise ValueError(
                f"admin_token is the default {DEFAULT_ADMIN_TOKEN!r} while host {self.host!r} lets other hosts in: "
                "set server.admin_token (RG_SERVER__ADMIN_TOKEN) to a secret, or bind to 127.0.0.1"
            )
        return self
