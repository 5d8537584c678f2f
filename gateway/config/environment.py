"""The `RG_*` environment variables: a key's variable name, and what is said of the ones that cannot apply."""

from __future__ import annotations

import logging
import re
from collections.abc import Collection, Mapping, Sequence

from pydantic_settings import SettingsError

logger = logging.getLogger(__name__)

ENV_PREFIX = "RG_"
ENV_NESTED_DELIMITER = "__"


def env_var_name(loc: Sequence[str | int]) -> str:
    """The variable that sets `loc`; inside a list, the variable of the whole list (as JSON)."""
    names: list[str] = []
    for part in loc:
        if isinstance(part, int):
            break
        names.append(part)
    return ENV_PREFIX + ENV_NESTED_DELIMITER.join(names).upper()


def warn_unknown_env_vars(environ: Mapping[str, str], sections: Collection[str]) -> None:
    """Log each `RG_*` variable naming no section in `sections`."""
    # pydantic-settings only looks up variables it expects, so RG_SEVER__PORT would be ignored in
    # silence; a misspelled key inside a known section is already an error (extra="forbid").
    for name in sorted(environ):
        upper = name.upper()
        if upper.startswith(ENV_PREFIX):
            section = upper.removeprefix(ENV_PREFIX).split(ENV_NESTED_DELIMITER)[0].lower()
            if section not in sections:
                logger.warning("ignoring %s: no configuration section %r", name, section)


def env_parse_error(exc: SettingsError, environ: Mapping[str, str]) -> str:
    """Name the RG_* variables of the section pydantic-settings could not decode, and why."""
    match = re.search(r'field "(\w+)"', str(exc))
    prefix = env_var_name((match[1],)) if match else ENV_PREFIX
    names = sorted(name for name in environ if name.upper().startswith(prefix))
    reason = f": {exc.__cause__}" if exc.__cause__ else ""
    return (
        f"invalid configuration in {' or '.join(names) or 'the RG_* environment'}{reason} "
        "(lists and objects in RG_* variables must be JSON)"
    )
