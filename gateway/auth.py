"""Bearer-token checks: the admin token for /admin/*, an optional metrics token for `/metrics` and the status page's
data, optional API keys for agent routes (with `sessions.identity:
api_key`, the agent's key may name its session too: `gateway.session.identity`). An agent route's check answers the
key's id (`gateway.config.api_keys`), which names the caller from there on; the key itself goes no further."""

from __future__ import annotations

import hmac

from fastapi import Request

from gateway.config.api_keys import ANONYMOUS, ApiKey
from gateway.errors import Forbidden, Unauthorized
from gateway.session.identity import KEY_FORMAT, split_key


def _bearer(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def _matches(token: str, allowed: tuple[str, ...]) -> bool:
    # Compare against every key in constant time, so timing reveals neither the key nor which one matched.
    found = False
    for key in allowed:
        found |= hmac.compare_digest(token.encode(), key.encode())
    return found


def _key_id(token: str, keys: tuple[ApiKey, ...]) -> str | None:
    """The id of the key `token` is, else None; every key compared in constant time, as `_matches` does."""
    found = None
    for key in keys:
        if hmac.compare_digest(token.encode(), key.secret().encode()):
            found = key.id
    return found


def check_admin(request: Request, admin_token: str) -> None:
    """401 without a bearer token, 403 with a wrong one."""
    token = _bearer(request)
    if token is None:
        raise Unauthorized("admin routes need 'Authorization: Bearer <admin token>'")
    if not _matches(token, (admin_token,)):
        raise Forbidden("wrong admin token")


def check_metrics(request: Request, metrics_token: str | None) -> None:
    """The observability routes are open when no metrics token is configured; otherwise 401 without a bearer token,
    403 with a wrong one (neither the admin token nor an API key opens them)."""
    if metrics_token is None:
        return
    token = _bearer(request)
    if token is None:
        raise Unauthorized("this route needs 'Authorization: Bearer <metrics token>' (server.metrics_token)")
    if not _matches(token, (metrics_token,)):
        raise Forbidden("wrong metrics token")


def check_agent(request: Request, api_keys: tuple[ApiKey, ...]) -> str:
    """Agent routes are open when no API keys are configured; otherwise a configured key is required, as a bearer
    token or Anthropic's `x-api-key` (`agent_token`). Returns the caller's key id (never the key) for per-key limits
    and settings (`anonymous` on an open gateway)."""
    if not api_keys:
        return ANONYMOUS
    token = agent_token(request)
    if token is None:
        raise Unauthorized("this gateway needs 'Authorization: Bearer <api key>' (or 'x-api-key: <api key>')")
    found = _key_id(token, api_keys)
    if found is None:
        raise Forbidden("unknown API key")
    return found


def agent_token(request: Request) -> str | None:
    """The agent's token: `Authorization: Bearer <token>`, else Anthropic's `x-api-key: <token>`."""
    return _bearer(request) or request.headers.get("x-api-key", "").strip() or None


def check_agent_key(request: Request, api_keys: tuple[ApiKey, ...]) -> tuple[str, str | None] | None:
    """`check_agent` for `sessions.identity: api_key`: the token is `<session>` when no API keys are configured,
    else `<api key>:<session>` (or a key alone). Returns the caller's key id and the session its token names, or
    None for a request without a token on a gateway without keys (the turn routes refuse it: `turn_session`)."""
    token = agent_token(request)
    if token is None:
        if not api_keys:
            return None
        raise Unauthorized(f"this gateway needs 'Authorization: Bearer <api key>' ({KEY_FORMAT} names a session)")
    key, session = split_key(token, bool(api_keys))
    if key is None:
        return ANONYMOUS, session
    found = _key_id(key, api_keys)
    if found is None:
        raise Forbidden("unknown API key")
    return found, session
