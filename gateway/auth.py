"""Bearer-token checks: the admin token for /admin/*, optional API keys for agent routes."""

from __future__ import annotations

import hmac

from fastapi import Request

from gateway.errors import Forbidden, Unauthorized
from gateway.quotas import ANONYMOUS, key_id


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


def check_admin(request: Request, admin_token: str) -> None:
    """401 without a bearer token, 403 with a wrong one."""
    token = _bearer(request)
    if token is None:
        raise Unauthorized("admin routes need 'Authorization: Bearer <admin token>'")
    if not _matches(token, (admin_token,)):
        raise Forbidden("wrong admin token")


def check_agent(request: Request, api_keys: tuple[str, ...]) -> str:
    """Agent routes are open when no API keys are configured; otherwise a configured key is required.
    Returns the caller's key id (a digest, never the key) for per-key limits."""
    if not api_keys:
        return ANONYMOUS
    token = _bearer(request)
    if token is None:
        raise Unauthorized("this gateway needs 'Authorization: Bearer <api key>'")
    if not _matches(token, api_keys):
        raise Forbidden("unknown API key")
    return key_id(token)
