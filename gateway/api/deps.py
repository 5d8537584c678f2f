"""Dependencies shared by routers: the services object and the auth checks."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Path, Request

from gateway.api.context import ApiServices
from gateway.auth import check_admin, check_agent, check_agent_key, check_metrics
from gateway.errors import Forbidden, InvalidRequest, NotFound, Unauthorized
from gateway.session.identity import SESSION_ID_PATTERN, group_member, session_id_from
from gateway.session.quotas import ANONYMOUS

# Dependencies are `async def` on purpose: FastAPI runs a plain `def` dependency in a worker thread, and that
# hop (two thread handoffs per request) cost more than the whole route on the short-request benchmark.


_AGENT_KEY = "rollout_gateway.agent_key"
"""Scope key of the key id `require_agent` found (the scope itself: `request.state` costs an object per request)."""

_KEY_SESSION = "rollout_gateway.key_session"
"""Scope key of the session the agent's token names (`sessions.identity: api_key`), None for a key alone; absent
when the request has no token."""


def _services(request: Request) -> ApiServices:
    found = services_of(request.scope["app"])
    if found is None:
        raise RuntimeError("the gateway's services are not running: its app's lifespan has not started them")
    return found


def services_of(app: object) -> ApiServices | None:
    """The services of a gateway app (`GatewayApp.services`) once its lifespan started them, else None."""
    found: ApiServices | None = getattr(app, "services", None)
    return found


async def services(request: Request) -> ApiServices:
    return _services(request)


async def require_admin(request: Request) -> None:
    """The admin token; and an admin path as sent, not percent-encoded (`/admin%2Fstatus`, `/%61dmin/status` decode
    to admin routes: a proxy that filters the raw path would let them through), else a 404 as for no route."""
    raw = request.scope.get("raw_path")
    if raw is not None and b"%" in raw.partition(b"?")[0]:
        raise NotFound("no such route (an admin path is never percent-encoded)")
    check_admin(request, _services(request).settings.server.admin_token.get_secret_value())


async def require_metrics(request: Request) -> None:
    """The metrics token (`server.metrics_token`) on `/metrics` and `/dashboard/state`, where one is configured."""
    token = _services(request).settings.server.metrics_token
    check_metrics(request, None if token is None else token.get_secret_value())


async def require_agent(request: Request) -> None:
    settings = _services(request).settings
    if settings.sessions.identity == "header":
        request.scope[_AGENT_KEY] = check_agent(request, settings.server.api_keys)
        return
    found = check_agent_key(request, settings.server.api_keys)
    if found is None:
        request.scope[_AGENT_KEY] = ANONYMOUS
    else:
        request.scope[_AGENT_KEY], request.scope[_KEY_SESSION] = found


async def session_in_path(
    session_id: Annotated[str, Path(pattern=SESSION_ID_PATTERN, description="The session the turn belongs to.")],
) -> None:
    """Declares and checks the `/sessions/{session_id}` prefix's `session_id` (the endpoints read it from the
    request: `turn_session`)."""


def turn_session(
    request: Request, body_session: str | None, user: str | None
) -> tuple[str | None, dict[str, str] | None]:
    """The session a turn request names (`gateway.session.identity.session_id_from`: the URL path, `X-Session-ID`,
    the body's `session_id`, the API key's session, `user`), and the group metadata of a `grp-` name given by the
    path or the key. With `sessions.identity: api_key` a request without a token is a 401."""
    scope = request.scope
    path: str | None = scope.get("path_params", {}).get("session_id")
    key_session: str | None = None
    if _KEY_SESSION in scope:
        key_session = scope[_KEY_SESSION]
    elif _services(request).settings.sessions.identity == "api_key":
        raise Unauthorized("sessions.identity is api_key: send 'Authorization: Bearer <session>'")
    session = session_id_from(path, request.headers.get("x-session-id"), body_session, key_session, user)
    if session is None or session not in (path, key_session):
        return session, None
    return session, group_member(session)


def agent_key(request: Request) -> str:
    """The key id `require_agent` found for this request."""
    found: str = request.scope[_AGENT_KEY]
    return found


def pool_for(svc: ApiServices, request: Request, model: str | None) -> ApiServices:
    """The pool that serves the request's `model` (`pools:`) for its API key: 404 for a model no pool serves (the
    served ones listed), 403 for a pool its key is not bound to, 400 for no model where there are several pools
    and for a teacher's model (it serves no agent)."""
    pool = svc.for_model(model, request.scope.get(_AGENT_KEY))
    if pool.role == "teacher":
        raise InvalidRequest(
            f"the model `{pool.settings.model.name}` is a teacher: it scores the samples of the policies that name "
            f"it and serves no agent (the agents' models: {', '.join(f'`{m}`' for m in svc.agent_models())})",
            param="model",
        )
    return pool


def usable(svc: ApiServices, request: Request, model: str) -> bool:
    """Whether the request's API key may use the pool of `model`."""
    try:
        svc.for_model(model, request.scope.get(_AGENT_KEY))
    except Forbidden:
        return False
    return True


def session_owner(request: Request) -> str | None:
    """The owner of the sessions this request creates, and the only one that may use them (`SessionMeta.owner`):
    its key id; None on a gateway without API keys."""
    key = agent_key(request)
    return None if key == ANONYMOUS else key


ServicesDep = Annotated[ApiServices, Depends(services)]
