"""Agent API keys and the ids that stand for them (`server.api_keys`).

A key is a secret: everywhere but the bearer check it is named by its id: in the configuration (per-key settings
such as `sampling.keys`, and the per-key pools to come), in messages, and in the sessions it owns
(`SessionMeta.owner`), so nothing that is shown or stored can leak it. An entry of
`server.api_keys` is either the key alone, whose id is derived from it (`derived_key_id`: `key-` and 16 hex digits
of its SHA-256, which names no secret), or `{id: <name>, key: <secret>}`. Ids are unique, and so are keys; a key is
never echoed, neither by a repr nor by an error (`gateway.config.messages`).
"""

from __future__ import annotations

from collections import Counter
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, Field, SecretStr

from gateway.config.section import Section
from gateway.session.quotas import ANONYMOUS, key_id

__all__ = ["ANONYMOUS", "KEY_ID_PATTERN", "ApiKey", "ApiKeys", "derived_key_id"]

KEY_ID_PATTERN = r"^[A-Za-z0-9_.\-]{1,64}$"
"""A key id: it may reach log lines, metric labels and Redis values."""


def derived_key_id(secret: str) -> str:
    """The id of a key given alone: stable, and it names no secret (`gateway.session.quotas.key_id`)."""
    return key_id(secret)


def _non_empty(secret: SecretStr) -> SecretStr:
    if not secret.get_secret_value().strip():
        raise ValueError("an API key must not be empty")
    return secret


class ApiKey(Section):
    """One agent API key: the secret the agent sends, and the id that names it everywhere else."""

    id: str = Field(pattern=KEY_ID_PATTERN, description="The key's name in config, logs, metrics and stored sessions.")
    key: Annotated[SecretStr, AfterValidator(_non_empty)] = Field(description="The secret (never shown).")

    def secret(self) -> str:
        return self.key.get_secret_value()


def _entry(value: Any) -> Any:
    """A key given alone (a string) as the entry it stands for, its id derived."""
    if isinstance(value, str):
        return {"id": derived_key_id(value), "key": value}
    return value


def _distinct(keys: tuple[ApiKey, ...]) -> tuple[ApiKey, ...]:
    """Ids unique and not `anonymous` (the id of every caller of a gateway without keys), and no key given twice
    (said by the ids, never by the key)."""
    for name, count in Counter(k.id for k in keys).items():
        if count > 1:
            raise ValueError(f"the key id {name!r} is given {count} times")
    if any(k.id == ANONYMOUS for k in keys):
        raise ValueError(f"the key id {ANONYMOUS!r} is reserved for the callers of a gateway without keys")
    seen: dict[str, str] = {}
    for k in keys:
        other = seen.setdefault(k.secret(), k.id)
        if other != k.id:
            raise ValueError(f"the keys {other!r} and {k.id!r} are the same secret")
    return keys


ApiKeys = Annotated[tuple[Annotated[ApiKey, BeforeValidator(_entry)], ...], AfterValidator(_distinct)]
"""`server.api_keys`: each entry a key alone or `{id, key}`."""
