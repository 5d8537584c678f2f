"""Integers of request bodies, bounded to what the engines take: vLLM and SGLang read them into int64 (a seed) or
int32 (counts, top-k, token ids) fields, and JSON integers beyond those ranges failed on the way to the engine
instead of as a 400 naming the field."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

__all__ = ["INT32_MAX", "INT64_MAX", "INT64_MIN", "Count", "Seed", "TopK"]

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

Seed = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
"""A sampling seed: a signed 64-bit integer, as OpenAI's API and vLLM take it."""

Count = Annotated[int, Field(ge=0, le=INT32_MAX)]
"""A count of tokens (min_tokens, a budget): a non-negative 32-bit integer."""

TopK = Annotated[int, Field(ge=-1, le=INT32_MAX)]
"""top-k: -1 (or 0) for none, else a 32-bit count."""
