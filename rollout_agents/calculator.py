"""A safe integer calculator: the `calculator` tool of the tool agent and the reference of `rollout_agents.tasks`.

Expressions are parsed with `ast` and only integer literals, unary minus/plus and binary `+ - *` (with
parentheses) are evaluated; everything else (names, calls, attributes, `**`, `/`, floats, strings) is refused
with `CalculatorError`. Nothing is ever handed to `eval`.
"""

from __future__ import annotations

import ast
import json
import operator
from collections.abc import Callable, Mapping
from typing import Any

MAX_EXPRESSION_CHARS = 200
MAX_MAGNITUDE = 10**30  # bounds the work a long chain of multiplications can cause

_BINARY: dict[type[ast.operator], Callable[[int, int], int]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
}
_UNARY: dict[type[ast.unaryop], Callable[[int], int]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}
OPS: dict[str, Callable[[int, int], int]] = {"+": operator.add, "-": operator.sub, "*": operator.mul}


class CalculatorError(ValueError):
    """The input is not something the calculator evaluates; the message says why (it is shown to the model)."""


def evaluate(expression: str) -> int:
    """The value of an integer expression over `+ - *` and parentheses."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError) as exc:  # ValueError: null bytes
        raise CalculatorError(f"not an arithmetic expression: {expression!r}") from exc
    return _eval(tree.body)


def _eval(node: ast.expr) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:  # `type is`: bool is an int subclass
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _bounded(_BINARY[type(node.op)](_eval(node.left), _eval(node.right)))
    raise CalculatorError(f"unsupported element {ast.unparse(node)!r}: only integers, + - * and parentheses")


def _bounded(value: int) -> int:
    if abs(value) > MAX_MAGNITUDE:
        raise CalculatorError("result too large")
    return value


def apply(a: int, op: str, b: int) -> int:
    """`a op b` for `op` in `+ - *` (the structured form of the tool)."""
    if op not in OPS:
        raise CalculatorError(f"op must be one of {' '.join(OPS)}, got {op!r}")
    return _bounded(OPS[op](_bounded(a), _bounded(b)))


def call(arguments: Mapping[str, Any]) -> int:
    """The tool's value for decoded arguments: `{"expression": str}` or `{"a": int, "b": int, "op": "+|-|*"}`."""
    expression = arguments.get("expression")
    if expression is not None:
        if not isinstance(expression, str):
            raise CalculatorError("expression must be a string")
        return evaluate(expression)
    a, b, op = arguments.get("a"), arguments.get("b"), arguments.get("op")
    if type(a) is not int or type(b) is not int or not isinstance(op, str):
        raise CalculatorError('give {"expression": "..."} or {"a": <int>, "b": <int>, "op": "+" | "-" | "*"}')
    return apply(a, op, b)


def run_tool(arguments_json: str) -> tuple[str, bool]:
    """Execute one `calculator` call from its raw JSON arguments: (tool message content, succeeded).

    Never raises on bad input: malformed JSON or arguments become an `error: ...` string for the model, so an
    episode goes on after a bad call.
    """
    try:
        arguments = json.loads(arguments_json)
    except (json.JSONDecodeError, TypeError) as exc:
        return f"error: arguments are not valid JSON ({exc})", False
    if not isinstance(arguments, dict):
        return "error: arguments must be a JSON object", False
    try:
        return str(call(arguments)), True
    except CalculatorError as exc:
        return f"error: {exc}", False
