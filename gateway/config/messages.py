"""A failed validation as one message: a line per bad key, as a dotted path with where it can be set."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from gateway.config.environment import env_var_name

# Values under these keys are never echoed back in an error message.
_SECRET_KEYS = {("server", "admin_token"), ("server", "metrics_token"), ("server", "api_keys"), ("redis", "url")}


def format_validation_error(exc: ValidationError, file: Path | None = None) -> str:
    """One line per bad key: `dotted.key: what is wrong (got value) [where to set it]`."""
    # default_factory_not_called only echoes another error (the field a default is derived from).
    errors = [err for err in exc.errors() if err["type"] != "default_factory_not_called"]
    sources = f"keyword overrides > RG_* environment > {file or 'no file'} > defaults"
    lines = [f"invalid configuration, {len(errors)} error{'s' * (len(errors) != 1)} (sources: {sources}):"]
    lines += [f"  {_format_error_line(err['loc'], err['type'], err['msg'], err['input'], file)}" for err in errors]
    return "\n".join(lines)


def _format_error_line(loc: Sequence[str | int], kind: str, msg: str, value: Any, file: Path | None) -> str:
    message = "unknown key" if kind == "extra_forbidden" else msg.removeprefix("Value error, ")
    return f"{dotted_key(loc)}: {message}{_shown_value(loc, kind, value)} [{_where(loc, file)}]"


def dotted_key(loc: Sequence[str | int]) -> str:
    """`("replicas", 0, "backend")` → `replicas[0].backend`."""
    key = ""
    for part in loc:
        key += f"[{part}]" if isinstance(part, int) else f".{part}" if key else part
    return key or "(top level)"


def _shown_value(loc: Sequence[str | int], kind: str, value: Any) -> str:
    if kind == "missing" or isinstance(value, dict | list | tuple):
        return ""
    if tuple(loc[:2]) in _SECRET_KEYS:
        return " (got a hidden value)"
    shown = repr(value)
    return f" (got {shown if len(shown) <= 80 else shown[:77] + '...'})"


def _where(loc: Sequence[str | int], file: Path | None) -> str:
    if not loc:  # a rule across sections: the keys it names are in the message
        return f"set in {file} or RG_* env" if file else "set in a config file or RG_* env"
    env = f"env {env_var_name(loc)}"
    return f"set in {file} or {env}" if file else f"set in a config file or {env}"
