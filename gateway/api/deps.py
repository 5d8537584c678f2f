"""Dependencies shared by routers: the services object and the auth checks."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from gateway.auth import check_admin, check_agent
from gateway.services import Services

# Dependencies are `async def` on purpose: FastAPI runs a plain `def` dependency in a worker thread, and that
# hop (two thread handoffs per request) cost more than the whole route on the short-request benchmark.


_AGENT_KEY = "rollout_gateway.agent_key"
"""Scope key of the key id `require_agent` found (the scope itself: `request.state` costs an object per request)."""


def _services(request: Request) -> Services:
    found = services_of(request.scope["app"])
    if found is None:
        raise RuntimeError("the gateway's services are not running: its app's lifespan has not started them")
    return found


def services_of(app: object) -> Services | None:
    """The services of a gateway app (`GatewayApp.services`) once its lifespan started them, else None."""
    found: Services | None = getattr(app, "services", None)
    return found


async def services(request: Request) -> Services:
    return _services(request)


async def require_admin(request: Request) -> None:
    check_admin(request, _services(request).settings.server.admin_token.get_secret_value())


async def require_agent(request: Request) -> None:
    request.scope[_AGENT_KEY] = check_agent(request, _services(request).settings.server.api_keys)


def agent_key(request: Request) -> str:
    """The key id `require_agent` found for this request."""
    found: str = request.scope[_AGENT_KEY]
    return found


ServicesDep = Annotated[Services, Depends(services)]
