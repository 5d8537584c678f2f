"""Where a JSON object or array that streams in ends, for formats whose calls have no end marker (Llama's bare
JSON, Mistral's `[TOOL_CALLS]`): brackets counted outside strings, across feeds, each character looked at once."""

from __future__ import annotations

import re

__all__ = ["JsonSpan"]

_SIGNIFICANT = re.compile(r'[\\"{}\[\]]')  # all that can change the depth or the string state


class JsonSpan:
    """Finds the end of the JSON value that starts at `start` of a growing text (its first character `{` or `[`).

    Only brackets are counted: whether the value is valid JSON is for `json.loads` to say once it has ended.
    """

    def __init__(self, start: int) -> None:
        self.start = start
        self._at = start
        self._depth = 0
        self._in_string = False

    def end(self, text: str) -> int | None:
        """The index just past the value in `text` (the same text as before, maybe longer), or None while it has not
        ended."""
        at = self._at
        while (found := _SIGNIFICANT.search(text, at)) is not None:
            char, at = found.group(), found.end()
            if self._in_string:
                if char == "\\":
                    if at == len(text):  # the escaped character has not come yet
                        self._at = at - 1
                        return None
                    at += 1
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth <= 0:
                    self._at = at
                    return at
        self._at = len(text)
        return None
