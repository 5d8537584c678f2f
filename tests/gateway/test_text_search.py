"""`AnyOf` finds what one substring search per string finds, on overlapping, nested and regex-special strings."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.text_search import AnyOf

# A small alphabet, so that strings overlap, nest and share prefixes; regex metacharacters and newlines included.
SMALL = st.text(st.sampled_from("<|>ab.*\\\n("), max_size=6)


@settings(max_examples=400, deadline=None)
@given(needles=st.lists(SMALL, max_size=8), text=st.text(st.sampled_from("<|>ab.*\\\n(x"), max_size=40))
def test_a_text_holds_one_of_them_exactly_when_a_search_for_each_finds_it(needles: list[str], text: str) -> None:
    assert AnyOf(needles).in_value(text) == any(needle and needle in text for needle in needles)


@settings(max_examples=200, deadline=None)
@given(needles=st.lists(SMALL, max_size=5), texts=st.lists(SMALL, max_size=4))
def test_nested_values_are_searched_keys_included(needles: list[str], texts: list[str]) -> None:
    value: Any = [{"role": "user", "content": texts}, ({t: 1 for t in texts}, 3, None)]
    assert AnyOf(needles).in_value(value) == any(n and n in t for n in needles for t in texts)


def test_the_added_tokens_of_a_large_vocabulary() -> None:
    tokens = ["<|begin_of_text|>", "<|eot_id|>", *(f"<|reserved_special_token_{i}|>" for i in range(250))]
    finder = AnyOf(tokens)
    assert finder.in_value("say <|reserved_special_token_249|> now")
    assert finder.in_value("x<|eot_id|>")
    assert not finder.in_value("<|reserved_special_token_250|> <|eot_id| <|reserved_special_token_|>")
    assert not AnyOf([]).in_value("anything") and not AnyOf([""]).in_value(["anything"])
