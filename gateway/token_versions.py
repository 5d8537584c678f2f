"""The weight version of each token a segment produced, from the labels engines put on their chunks.

Engines label what they sample with the weight version that sampled it: one label on a chunk
(`Chunk.weight_version`) or spans of labels (`Chunk.version_spans`), often only on a segment's last chunk (vLLM).
A segment is dispatched under the version its replica is known to run (`gateway.weights.version_labels`); these
helpers turn the labels into one version per token, and tell when a replica sampled under older weights than that,
or began a segment under newer ones.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from backends.base import Chunk, VersionSpan, spans_to_versions
from gateway.errors import InvalidRequest
from gateway.weights import parse_version

__all__ = ["newer_first_version", "stale_version", "token_versions"]


def stale_version(chunk: Chunk, dispatch_labels: Collection[str], dispatch_version: int) -> int | None:
    """The oldest version `chunk` labels its tokens with, where that is older than `dispatch_version` (the version
    the replica is known to run, labelled `dispatch_labels`); else None.

    A replica that crashed and restarted on its initial weights just after a health probe looks healthy until the
    next one; its labelled chunk gives it away."""
    spans, label = chunk.version_spans, chunk.weight_version
    if label is None and spans is None:
        return None  # the common case of a stream: a delta without labels (engines label the last chunk)
    current = dispatch_labels
    if (label is None or label in current) and (spans is None or all(s.version in current for s in spans)):
        return None  # the common case of a last chunk: the version the segment was dispatched under, throughout
    labels = [span.version for span in spans or ()]
    if label is not None:
        labels.append(label)
    known = [v for v in map(_version_or_none, labels) if v is not None]
    oldest = min(known, default=None)
    return oldest if oldest is not None and oldest < dispatch_version else None


def newer_first_version(
    chunk: Chunk, dispatch_labels: Collection[str], dispatch_version: int, *, first: bool
) -> int | None:
    """The version `chunk` says the segment's first token was sampled under, where that is newer than
    `dispatch_version` (labelled `dispatch_labels`); else None. `first`: `chunk` carries the segment's first tokens, so
    its label is theirs; otherwise only a span that starts at the segment's first token says it.

    A segment's request is salted for the version it was dispatched under: a first token under a newer one was
    sampled by weights this process had not heard of then, over prefix KV the engine may have cached under the old
    ones (`Generator` refuses it)."""
    spans = chunk.version_spans
    if spans and spans[0].start <= 0:
        label: str | None = spans[0].version
    elif first:
        label = chunk.weight_version
    else:
        return None
    if label is None or label in dispatch_labels:
        return None
    version = _version_or_none(label)
    return version if version is not None and version > dispatch_version else None


def token_versions(
    spans: Sequence[VersionSpan] | None, count: int, label: str | None, dispatch_label: str, dispatch_version: int
) -> list[int]:
    """The version of each of a segment's `count` tokens: from the engine's `spans`; where none covers a token, from
    the segment's `label` (`Chunk.weight_version`), else the label of `dispatch_version` it was dispatched under."""
    fallback = label or dispatch_label
    if count == 0:
        return []  # nothing to label (a label the segment carried is not parsed, as none is used)
    if not spans or (len(spans) == 1 and spans[0].start <= 0 and spans[0].end >= count):
        # The common case: one label throughout, most often the one the segment was dispatched under.
        label = spans[0].version if spans else fallback
        return [dispatch_version if label == dispatch_label else parse_version(label)] * count
    labels = spans_to_versions(spans, count, fallback)
    parsed = {label: parse_version(label) for label in set(labels)}  # a few labels, not a parse per token
    return [parsed[label] for label in labels]


def _version_or_none(label: str) -> int | None:
    try:
        return parse_version(label)
    except InvalidRequest:  # an engine label that is no gateway version: nothing to compare
        return None
