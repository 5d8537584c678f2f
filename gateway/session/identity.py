"""Which session a request belongs to (docs/architecture.md §1).

A turn names its session in one of five ways; the first one given wins:

1. the URL path: `/sessions/{session_id}/v1/...` (`base_url=http://gw/sessions/abc/v1`),
2. the `X-Session-ID` header,
3. `session_id` in the body,
4. the API key, with `sessions.identity: api_key`: the bearer token (or Anthropic's `x-api-key` header) is
   `<session>` when `server.api_keys` is empty, else `<api key>:<session>` (the part before the first `:` is the
   key checked against `server.api_keys` and is never stored; a key alone names no session),
5. `user` in the body.

None of them: a one-turn session. Whichever names it, a session id is 1 to 256 characters of `A-Z a-z 0-9 _ . : @ -`
other than `.` and `..` (`SESSION_ID_PATTERN`), else a 400 naming where it came from: ids reach log lines and Redis
keys, and a URL path segment `.` or `..` is resolved away by clients and browsers (`/sessions/{id}/v1`, the
dashboard's link), so such a session could not be reached.

A session named by the path or by the key of the form `grp-<group>-<index>` or
`grp-<group>-<index>of<size>` is member `<index>` of GRPO group `<group>`: its metadata gets `group_id`,
`group_index` (and `group_size`), as a `group: true` request records its members (`gateway.turns.runner`).
"""

from __future__ import annotations

import re
from typing import Literal

from gateway.errors import InvalidRequest

Identity = Literal["header", "api_key"]
"""`sessions.identity`: `header` (path, header, body, `user`) or `api_key` (the key names the session too)."""

KEY_FORMAT = "'<api key>:<session>'"

# Without a lookahead, which pydantic's regex engine and JSON Schema's do not share: an id starts with no dot, or
# with one dot and then no dot, or with two dots and then anything (`...` is no dot segment).
_SAFE, _NO_DOT = r"[A-Za-z0-9_.:@\-]", r"[A-Za-z0-9_:@\-]"
SESSION_ID_PATTERN = rf"^(?:{_NO_DOT}{_SAFE}{{0,255}}|\.{_NO_DOT}{_SAFE}{{0,254}}|\.\.{_SAFE}{{1,254}})$"
MAX_SESSION_ID = 256
_SESSION_ID = re.compile(SESSION_ID_PATTERN)
_SOURCES = ("session_id", "x-session-id", "session_id", "authorization", "user")  # where each candidate comes from

_GROUP_MEMBER = re.compile(r"grp-(?P<group>.+)-(?P<index>\d+)(?:of(?P<size>\d+))?")


def split_key(token: str, keys_configured: bool) -> tuple[str | None, str | None]:
    """The API key and the session name an agent's token carries (`api_key` identity): `(None, token)` when the
    gateway has no API keys; else `(key, session)` split at the first `:`, the session None if there is no `:`.
    An empty session after the `:` is a 400 naming the format."""
    if not keys_configured:
        return None, token
    key, colon, session = token.partition(":")
    if colon and not session:
        raise InvalidRequest(
            f"the API key names no session after ':'; with sessions.identity api_key the key is {KEY_FORMAT}",
            param="authorization",
        )
    return key, session or None


def session_id_from(
    path: str | None,
    header: str | None,
    body_session: str | None,
    key_session: str | None,
    user: str | None,
) -> str | None:
    """The request's session: the URL path, else `X-Session-ID`, else the body's `session_id`, else the API key's
    session (`api_key` identity), else `user`; None if none is given. One outside `SESSION_ID_PATTERN` is a 400."""
    for candidate, source in zip((path, header, body_session, key_session, user), _SOURCES, strict=True):
        if candidate:
            if not _SESSION_ID.match(candidate):
                raise InvalidRequest(
                    f"a session id is 1 to {MAX_SESSION_ID} characters of A-Z a-z 0-9 _ . : @ -, not . or .. (the "
                    f"{source} names {candidate[:64]!r})",
                    param=source,
                )
            return candidate
    return None


def group_member(session: str) -> dict[str, str] | None:
    """The group metadata a `grp-<group>-<index>[of<size>]` session name carries, else None."""
    found = _GROUP_MEMBER.fullmatch(session)
    if found is None:
        return None
    metadata = {"group_id": found["group"], "group_index": str(int(found["index"]))}
    if found["size"] is not None:
        size = int(found["size"])
        if not 0 <= int(found["index"]) < size:
            raise InvalidRequest(
                f"session {session!r}: group index {found['index']} is not below the group size {size}",
                param="session_id",
            )
        metadata["group_size"] = str(size)
    return metadata


def with_group(metadata: dict[str, str] | None, group: dict[str, str], session: str) -> dict[str, str]:
    """A request's metadata with the group metadata its session name carries; a key that disagrees is a 400."""
    merged = dict(metadata or {})
    for key, value in group.items():
        if merged.setdefault(key, value) != value:
            raise InvalidRequest(
                f"metadata.{key} = {merged[key]!r} disagrees with session {session!r}, which names {key} {value!r}",
                param="metadata",
            )
    return merged


__all__ = ["KEY_FORMAT", "Identity", "group_member", "session_id_from", "split_key", "with_group"]
