"""Per-token weight-version labels from engine spans (`backends.base.spans_to_versions`); the labels that name a
gateway version (`gateway.weights.version_labels`) are tested in tests/gateway/test_weights.py."""

from __future__ import annotations

from backends.base import VersionSpan, spans_to_versions


def test_tokens_no_span_covers_get_the_fallback() -> None:
    assert spans_to_versions([], 3, "7") == ["7", "7", "7"]
    assert spans_to_versions([VersionSpan("8", 1, 2)], 4, "7") == ["7", "8", "7", "7"]


def test_a_later_span_wins_where_spans_overlap() -> None:
    spans = [VersionSpan("1", 0, 4), VersionSpan("2", 2, 6)]
    assert spans_to_versions(spans, 6, "0") == ["1", "1", "2", "2", "2", "2"]


def test_spans_are_clipped_to_the_tokens() -> None:
    spans = [VersionSpan("1", -3, 2), VersionSpan("2", 3, 99), VersionSpan("3", 5, 4), VersionSpan("4", 9, 12)]
    assert spans_to_versions(spans, 5, "0") == ["1", "1", "0", "2", "2"]
    assert spans_to_versions(spans, 0, "0") == []
