"""Integers of request bodies: what counts as one, and the ranges the engines take.

An integer is a JSON number with no fractional part, as JSON Schema defines it and as the published schema's
`type: integer` says: `650644` and `650644.0` (or `6.50644e5`) are the same version. Request models are strict (no
`"3"`, no `true`, no `2.5` for an integer), and every integer field takes an integral float through one rule,
`integral`, converting it to the `int` it is; a test walks every request model and fails on an integer without it.
The rule refuses a float beyond 2**53 - 1 (JavaScript's `Number.MAX_SAFE_INTEGER`), although JSON Schema calls it an
integer: past it, neighbouring integers share one double (`9007199254740993.0` arrives as `9007199254740992.0`), so
the float no longer says which integer the client wrote, and a silently different seed is worse than a 400 asking
for the integer without a fraction. JSON Schema cannot say this; it matters for the one field whose range passes
2**53, `seed` (the others are 32-bit, or token ids bounded by the vocabulary). Below 2**53 every integer has its own
double, and a fraction too small for a double to hold (`1.00000000000000001`) is lost to any JSON parser that reads
doubles, validators of JSON Schema included: the gateway judges the number as parsed, as they do.

vLLM and SGLang read integers into int64 (a seed) or int32 (counts, top-k, token ids) fields, and JSON integers
beyond those ranges failed on the way to the engine instead of as a 400 naming the field: the aliases below carry
those ranges.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, GetCoreSchemaHandler, ValidationError
from pydantic_core import CoreSchema, core_schema

__all__ = [
    "INT32_MAX",
    "INT64_MAX",
    "INT64_MIN",
    "MAX_EXACT_INTEGER",
    "INTEGRAL",
    "Budget",
    "Count",
    "IntegralItems",
    "Seed",
    "TopK",
    "TopLogprobs",
    "integral",
]

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_EXACT_INTEGER = 2**53 - 1
"""The largest integer a float stands for alone (see the module docstring)."""


def integral(value: Any) -> Any:
    """An integral float within `MAX_EXACT_INTEGER` as its `int`; any other float a `ValueError` saying why; anything
    else as it is (the strict integer validation after it refuses a bool or a string)."""
    if type(value) is not float:
        return value
    if value.is_integer():
        if -MAX_EXACT_INTEGER <= value <= MAX_EXACT_INTEGER:
            return int(value)
        raise ValueError(
            f"Input should be an integer written without a fraction or an exponent: {value!r} is past 2**53, where "
            "a float stands for several integers"
        )
    if math.isfinite(value):
        raise ValueError("Input should be a valid integer, got a number with a fractional part")
    return value


INTEGRAL = BeforeValidator(integral)
"""The rule on a field: put last, after the bounds (`Annotated[int, Field(ge=0, le=20), INTEGRAL]`), so that pydantic
keeps them on the integer schema (a bound after a validator becomes a Python check, published as `ge`, not
`minimum`)."""


class IntegralItems:
    """Token-id lists take integral floats too, without a Python call per id on the hot path: a prompt of thousands
    of ids is validated in pydantic-core (`gateway.tokenization.token_ids`). Python objects (FastAPI's validation)
    go through as they are, and a list refused is validated again with its integral floats as integers, once. JSON
    (the fast lane's one-pass parse, `gateway.fastpath.one_pass_route`) keeps the plain schema: a float there fails
    the parse, and the lane hands the request to FastAPI, which takes this path; so `model_validate_json` alone
    refuses integral floats in token lists. Put last on a field (`Annotated[list[TokenId], Field(min_length=1),
    IntegralItems()]`), or around a union holding such a list, whose branches then keep their names in errors."""

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        plain = handler(source)
        retried = core_schema.no_info_wrap_validator_function(self.validate, plain)
        return core_schema.json_or_python_schema(json_schema=plain, python_schema=retried)

    @staticmethod
    def validate(value: Any, handler: core_schema.ValidatorFunctionWrapHandler) -> Any:
        """`value` validated as it is, and only where that fails once more with a list's integral floats as
        integers (any other item left for the validation to refuse by its index)."""
        try:
            return handler(value)
        except ValidationError:
            if type(value) is not list:
                raise
            return handler([_integral_or_same(item) for item in value])


def _integral_or_same(item: Any) -> Any:
    try:
        return integral(item)
    except ValueError:
        return item


Seed = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX), INTEGRAL]
"""A sampling seed: a signed 64-bit integer, as OpenAI's API and vLLM take it."""

Count = Annotated[int, Field(ge=0, le=INT32_MAX), INTEGRAL]
"""A count of tokens (min_tokens), or a token id the route does not check against the vocabulary: a non-negative
32-bit integer."""

Budget = Annotated[int, Field(ge=1, le=INT32_MAX), INTEGRAL]
"""A budget of tokens (max_tokens and its kin): a positive 32-bit integer."""

TopK = Annotated[int, Field(ge=-1, le=INT32_MAX), INTEGRAL]
"""top-k: -1 (or 0) for none, else a 32-bit count."""

TopLogprobs = Annotated[int, Field(ge=0, le=20), INTEGRAL]
"""How many alternatives' logprobs to send per token: 0 to 20, as OpenAI's API takes it."""
