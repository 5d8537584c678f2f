"""Version labels: the strings engines carry for a gateway weight version, and back."""

from __future__ import annotations

import functools

from gateway.errors import InvalidRequest

INITIAL_LABELS = frozenset({"default", ""})
"""The labels of an engine that never had an update: version 0."""


def version_label(version: int) -> str:
    """The label engines carry for a gateway version."""
    return str(version)


@functools.lru_cache(maxsize=64)  # asked once per segment; a set made per call otherwise
def version_labels(version: int) -> frozenset[str]:
    """Every label engines may carry for a gateway version: its own and, for version 0, the engines' initial ones
    (an engine that never had an update labels its tokens "default")."""
    return _VERSION_0_LABELS if version == 0 else frozenset((version_label(version),))


_VERSION_0_LABELS = frozenset({version_label(0)}) | INITIAL_LABELS


@functools.lru_cache(maxsize=64)  # asked once per engine request
def cache_salt(version: int) -> str:
    """The prefix-cache partition key of requests served by `version` (vLLM `cache_salt`, SGLang `extra_key`):
    every process of a fleet derives the same one, so sessions share prefixes within a version and never across."""
    return f"rg-weights-{version}"


def parse_version(label: str) -> int:
    """A gateway version from an engine label; the engines' initial label ("default") is version 0."""
    if label in INITIAL_LABELS:
        return 0
    try:
        return int(label)
    except ValueError:
        raise InvalidRequest(f"engine weight version {label!r} is not an integer") from None


def newer(label: str, version: int) -> bool:
    """Whether the engine label `label` names a version after `version` (a label that is no version: False)."""
    try:
        return parse_version(label) > version
    except InvalidRequest:
        return False
