"""Session routes: create, inspect, finish (docs/architecture.md §1)."""

from __future__ import annotations

import contextlib
import uuid
from typing import Any

from fastapi import APIRouter, Depends, Path, Query, Request

from gateway.api.context import ApiServices
from gateway.api.deps import ServicesDep, agent_key, pool_for, require_agent, session_owner, usable
from gateway.api.openai.models import SessionCreate, SessionFinish
from gateway.errors import Conflict, InvalidRequest, SessionNotFound
from gateway.session.identity import SESSION_ID_PATTERN
from gateway.session.lifecycle import check_owner
from gateway.store.delivery import AWAITING_SCORES
from gateway.trajectory import SessionMeta

router = APIRouter(prefix="/v1/sessions", tags=["sessions"], dependencies=[Depends(require_agent)])

SessionId = Path(pattern=SESSION_ID_PATTERN)
PoolModel = Query(None, min_length=1, description="The session's pool (`pools:`); none: the pool that holds it.")


def _meta(meta: SessionMeta) -> dict[str, Any]:
    return {
        "id": meta.id,
        "object": "session",
        "status": meta.status,
        "metadata": meta.metadata,
        "reward": meta.reward,
        "rewards": meta.rewards,
        "sample_count": meta.sample_count,
        "created_at": meta.created_at,
        "finished_at": meta.finished_at,
    }


@router.post("", status_code=201)
async def create_session(body: SessionCreate, raw: Request, svc: ServicesDep) -> dict[str, Any]:
    """A new session of the caller's API key in the pool of `model` (an existing one of that key is answered as it
    is; another key's id is a 409)."""
    svc = pool_for(svc, raw, body.model)
    owner = session_owner(raw)
    session_id = body.session_id or uuid.uuid4().hex
    opened = svc.open_sessions
    claimed = opened.claimed(agent_key(raw), [session_id]) if opened is not None else contextlib.nullcontext()
    async with claimed:  # 429 past server.max_open_sessions_per_key; the slot given back if the session is not made
        meta = await svc.store.create_session(body.metadata, session_id, fresh=body.session_id is None, owner=owner)
    if meta.owner != owner:
        raise Conflict(f"session id {meta.id!r} is taken", param="session_id")
    return _meta(meta)


async def _own_session(svc: ApiServices, raw: Request, session_id: str) -> SessionMeta:
    """The session if the caller's key may see it (`check_owner`), else `SessionNotFound`."""
    meta = await svc.store.get_session(session_id)
    if meta is None:
        raise SessionNotFound(f"no session {session_id!r}", param="session_id")
    check_owner(meta, session_owner(raw))
    return meta


async def _session_pool(svc: ApiServices, raw: Request, session_id: str, model: str | None) -> ApiServices:
    """The pool of `model`; with none named, the only pool, else the first the caller's key may use that holds the
    session (a session id each of two pools holds: name the model)."""
    if model is not None or len(svc.agent_models()) == 1:
        return pool_for(svc, raw, model)
    for name in (name for name in svc.agent_models() if usable(svc, raw, name)):
        pool = pool_for(svc, raw, name)
        if await pool.store.get_session(session_id) is not None:
            return pool
    raise SessionNotFound(f"no session {session_id!r}", param="session_id")


@router.get("/{session_id}")
async def get_session(
    raw: Request, svc: ServicesDep, session_id: str = SessionId, model: str | None = PoolModel
) -> dict[str, Any]:
    svc = await _session_pool(svc, raw, session_id, model)
    meta = await _own_session(svc, raw, session_id)
    samples = await svc.store.load_samples(session_id)
    out = _meta(meta)
    out["samples"] = [
        {
            "index": i,
            "prompt_tokens": len(s.prompt_ids),
            "response_tokens": len(s.response_ids),
            "sampled_tokens": int(s.loss_mask.sum()),
            "num_turns": s.num_turns,
            "min_version": s.min_version,
            "max_version": s.max_version,
            "cancelled": s.cancelled,
            "num_resumes": s.num_resumes,
            "segments": [
                {"start": g.start, "end": g.end, "replica": g.replica, "version": g.version, "sampling": g.sampling}
                for g in s.segments
            ],
        }
        for i, s in enumerate(samples)
    ]
    return out


@router.post("/{session_id}/finish")
async def finish_session(
    body: SessionFinish,
    raw: Request,
    svc: ServicesDep,
    session_id: str = SessionId,
    model: str | None = PoolModel,
) -> dict[str, Any]:
    """`{reward?, rewards?, metadata?}`: `reward` is the session's, `rewards` one per sample (their count must be
    the session's sample count, else 400 and the session stays active). Idempotent: a finished session answers
    its entry again; other rewards than it was finished with are a 409. `delivered` false: the session had no
    sample and no group, and the trainer gets nothing (`stream_id` null), or `scoring` true: its policy's teacher
    scores it first, and the gateway delivers it then (`pools[i].teacher`)."""
    svc = await _session_pool(svc, raw, session_id, model)
    if session_owner(raw) is not None:  # a gateway with API keys: only the key that made the session finishes it
        await _own_session(svc, raw, session_id)
    stream_id = await svc.store.finish(session_id, body.reward, body.metadata, body.rewards)
    svc.turns.forget(session_id)  # no turn extends it any more: its samples leave this process's cache
    if svc.open_sessions is not None:
        await svc.open_sessions.release(agent_key(raw), session_id)  # its slot of the key's open sessions
    scoring = stream_id == AWAITING_SCORES
    delivered = bool(stream_id) and not scoring
    return {
        "id": session_id,
        "object": "session",
        "status": "finished",
        "stream_id": stream_id if delivered else None,
        "delivered": delivered,
        "scoring": scoring,
    }


@router.post("/{session_id}/score")
async def score_session(
    raw: Request, svc: ServicesDep, session_id: str = SessionId, model: str | None = PoolModel
) -> dict[str, Any]:
    """Score the session's samples by its policy's teacher now (`pools[i].teacher`), the agent waiting for it: each
    sample's scored tokens. A finished session waiting for its teacher is delivered (`stream_id`); an active one's
    scores are stored and scored again once it finishes (its samples may grow)."""
    svc = await _session_pool(svc, raw, session_id, model)
    if session_owner(raw) is not None:
        await _own_session(svc, raw, session_id)
    if svc.scoring is None:
        raise InvalidRequest(
            f"the model `{svc.settings.model.name}` has no teacher to score its samples (pools[i].teacher)",
            param="model",
        )
    return await svc.scoring.score_now(session_id)
