"""`AnyOf`: whether a text holds any of a fixed set of strings, in one pass over the text.

The chat path asks at every turn whether a conversation holds the text of an added token (`ConversationMatch`). One
substring search per token scans the whole conversation once per token: a Llama 3 tokenizer has 256 added tokens, so
a long conversation held the event loop for one pass per token, every turn (docs/benchmarks.md). A regular
expression built from the strings' trie (`<\\|(?:im_(?:end|start)\\|>|endoftext\\|>)`) scans it once: at each
position the engine follows one path down the trie, never one alternative per string.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

__all__ = ["AnyOf"]

_Trie = dict[str, "_Trie"]
_END = ""  # the key that marks the end of a string in a trie node (no string is empty)


class AnyOf:
    """The strings `needles` (empty ones ignored), searched for together."""

    __slots__ = ("_pattern",)

    def __init__(self, needles: Iterable[str]) -> None:
        trie: _Trie = {}
        for needle in needles:
            if not needle:
                continue
            node = trie
            for char in needle:
                node = node.setdefault(char, {})
            node[_END] = {}
        self._pattern = re.compile(_pattern(trie), re.DOTALL) if trie else None

    def in_value(self, value: object) -> bool:
        """Whether any string inside `value` (nested mappings, lists and tuples; keys too) holds one of them."""
        if self._pattern is None:
            return False
        if isinstance(value, str):
            return self._pattern.search(value) is not None
        if isinstance(value, Mapping):
            return any(self.in_value(k) or self.in_value(v) for k, v in value.items())
        if isinstance(value, list | tuple):
            return any(self.in_value(item) for item in value)
        return False


def _pattern(node: _Trie) -> str:
    """The expression that matches exactly the strings of the trie below `node`, or a prefix of them that is one: a
    string that ends here makes the longer ones through this node irrelevant to whether a text holds any."""
    if _END in node:
        return ""
    branches = [re.escape(char) + _pattern(child) for char, child in sorted(node.items())]
    return branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
