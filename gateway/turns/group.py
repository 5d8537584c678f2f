"""A group (`group: true`, GRPO): the n choices of one request become n new sessions `<session>-<i>` (the session
named by the request, or a generated one, names only them: no session of that id is created), each holding one
sample of the shared prompt, with the request's metadata plus `group_id` (the metadata's, else the session id),
`group_size` n and `group_index` i. Each member is finished with its own reward and continued as a session of its
own; `TrajectoryConsumer(group_by="group_id")` delivers the n of them together. A member session that exists
already is a 409: a group's members are new (`SessionLifecycle.begin_group`).
"""

from __future__ import annotations

from typing import Any

from gateway.errors import InvalidRequest

__all__ = ["group_metadata"]


def group_metadata(metadata: dict[str, str], group_id: str, size: int) -> dict[str, Any]:
    """The metadata every member of a group gets (its `group_index` besides): the request's, with the group's id and
    size. A `group_size` or `group_index` in the request that says otherwise is refused."""
    if metadata.get("group_size", str(size)) != str(size):
        raise InvalidRequest(
            f"metadata.group_size {metadata['group_size']!r} disagrees with the group's n = {size}", param="metadata"
        )
    if "group_index" in metadata:
        raise InvalidRequest("metadata.group_index is set per member of a group; leave it out", param="metadata")
    return {**metadata, "group_id": group_id, "group_size": size}
