"""`Settings`, the whole configuration, and `load_config`, which builds it from its sources once at startup."""

from __future__ import annotations

import os
from collections.abc import Mapping
from contextvars import ContextVar
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    YamlConfigSettingsSource,
)

from gateway.config.environment import ENV_NESTED_DELIMITER, ENV_PREFIX, env_parse_error, warn_unknown_env_vars
from gateway.config.fastpath import FastPathConfig
from gateway.config.generation import GenerationConfig
from gateway.config.messages import dotted_key, format_validation_error
from gateway.config.model import ModelConfig
from gateway.config.pools import PoolConfig, Pools, pool_prefix
from gateway.config.redis import RedisConfig
from gateway.config.replicas import DEFAULT_REPLICAS, DiscoveryConfig, Replicas, ReplicasFrom
from gateway.config.routing import RoutingConfig
from gateway.config.sampling import SamplingConfig
from gateway.config.server import ServerConfig
from gateway.config.store import SessionsConfig, StoreConfig
from gateway.config.weights import WeightsConfig
from gateway.errors import ConfigError

S = TypeVar("S", bound=BaseModel)

# The YAML file of the `load_config` call in progress. pydantic-settings builds its sources in a
# classmethod that cannot see per-call arguments (pydantic-settings#259); a ContextVar scopes the
# path to one call, thread- and task-safely, and leaves `Settings` itself the returned class.
_yaml_file: ContextVar[Path | None] = ContextVar("gateway_config_yaml_file", default=None)

# Relative paths in a YAML file mean "next to that file" (as docker-compose does), so a config file
# works from any working directory. Paths from the environment stay relative to the cwd.
_FILE_RELATIVE_PATHS = (("model", "tokenizer"), ("redis", "data_dir"))


def _anchor_relative_paths(data: dict[str, Any], base: Path) -> dict[str, Any]:
    places = [(data.get(section), key) for section, key in _FILE_RELATIVE_PATHS]
    pools = data.get("pools")
    places += [(pool, "tokenizer") for pool in pools] if isinstance(pools, list) else []
    for values, key in places:
        if isinstance(values, dict) and isinstance(values.get(key), str) and values[key]:
            path = Path(values[key]).expanduser()
            values[key] = str(path if path.is_absolute() else base / path)
    return data


class _YamlFileSource(YamlConfigSettingsSource):
    """pydantic-settings' YAML source, with file-relative paths and errors that name the file."""

    def _read_file(self, file_path: Path | Traversable) -> dict[str, Any]:
        try:
            data = super()._read_file(file_path)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{file_path}: not valid YAML: {exc}") from exc
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{file_path}: cannot read: {exc}") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"{file_path}: the top level must map section names to settings")
        return _anchor_relative_paths(data, file_path.parent) if isinstance(file_path, Path) else data


class Settings(BaseSettings):
    """The whole configuration. Build it with `load_config`; pass it (or a section) explicitly."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter=ENV_NESTED_DELIMITER,
        env_parse_none_str="null",
        case_sensitive=False,
        frozen=True,
        extra="forbid",
    )

    server: ServerConfig = ServerConfig()
    redis: RedisConfig = RedisConfig()
    model: ModelConfig = ModelConfig()
    replicas: Replicas = Field(
        DEFAULT_REPLICAS, description="Engine replicas at startup (more via POST /admin/replicas)."
    )
    replicas_from: ReplicasFrom = Field(
        None, description="More replicas, followed at run time: dns://name:port | file://path | null."
    )
    discovery: DiscoveryConfig = DiscoveryConfig()
    pools: Pools = Field(
        (), description="Several served models, each its own pool (docs/serving.md); empty: model + replicas."
    )
    routing: RoutingConfig = RoutingConfig()
    generation: GenerationConfig = GenerationConfig()
    weights: WeightsConfig = WeightsConfig()
    store: StoreConfig = StoreConfig()
    sessions: SessionsConfig = SessionsConfig()
    fastpath: FastPathConfig = FastPathConfig()
    sampling: SamplingConfig = SamplingConfig()

    @model_validator(mode="after")
    def _sampling_fits_the_server(self) -> Settings:
        known = {key.id for key in self.server.api_keys}
        unknown = sorted(set(self.sampling.keys) - known)
        if unknown:
            configured = ", ".join(sorted(known)) or "none"
            raise ValueError(
                f"sampling.keys names {', '.join(map(repr, unknown))}, which server.api_keys does not (its key ids: "
                f"{configured}; a key given alone has the id key-<16 hex of its sha256>)"
            )
        limit = self.server.max_tokens_limit
        policies = {"sampling.default": self.sampling.default} | {
            f"sampling.keys.{key}": policy for key, policy in self.sampling.keys.items()
        }
        for where, policy in policies.items():
            bound = policy.budget_bound
            if bound is not None and bound > limit:
                raise ValueError(f"{where} lets max_tokens reach {bound}, above server.max_tokens_limit {limit}")
        self._check_pools(known)
        return self

    def _check_pools(self, key_ids: set[str]) -> None:
        given = [
            name for name in ("replicas", "replicas_from") if getattr(self, name) and name in self.model_fields_set
        ]
        if self.pools and given:
            raise ValueError(f"with pools, {' and '.join(given)} belong inside each pool (pools[i].replicas...)")
        for index, pool in enumerate(self.pools):
            unknown = sorted(set(pool.keys) - key_ids)
            if unknown:
                raise ValueError(
                    f"pools[{index}].keys names {', '.join(map(repr, unknown))}, which server.api_keys does not"
                )
        self.pool_settings()  # each pool's sections merged and validated, a LoRA policy's pause mode checked

    def pool_settings(self) -> tuple[Settings, ...]:
        """The settings of each pool, as if it were the gateway's one model (`gateway.config.pools`): the
        top-level settings without `pools:` when there are none."""
        if not self.pools:
            return (_keeping_for_adapters(self, "weights.pause_mode"),)
        return tuple(
            _keeping_for_adapters(self._one_pool(index, pool), f"pools[{index}] ({pool.model!r}): weights.pause_mode")
            for index, pool in enumerate(self.pools)
        )

    def _one_pool(self, index: int, pool: PoolConfig) -> Settings:
        model: dict[str, object] = {"name": pool.model, "base_model": pool.base_model}
        model |= {"tokenizer": pool.tokenizer} if pool.tokenizer is not None else {}
        return self.model_copy(
            update={
                "pools": (),
                "model": self.model.model_copy(update=model),
                "replicas": pool.replicas,
                "replicas_from": pool.replicas_from,
                "weights": _pool_section(index, "weights", self.weights, pool.weights),
                "routing": _pool_section(index, "routing", self.routing, pool.routing),
                "generation": _pool_section(index, "generation", self.generation, pool.generation),
                "store": self.store.model_copy(update={"prefix": pool_prefix(self.store.prefix, pool.model)}),
            }
        )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Highest first; defaults come last on their own. No .env file and no secrets dir.
        return init_settings, env_settings, _YamlFileSource(settings_cls, yaml_file=_yaml_file.get())


def _keeping_for_adapters(settings: Settings, where: str) -> Settings:
    """`settings` with `weights.pause_mode: keep` where its model is a LoRA adapter: its versions load without a
    pause (`backends.lora`). Another mode set (at `where`) is an error."""
    weights = settings.weights
    if settings.model.base_model is None or weights.pause_mode == "keep":
        return settings
    if "pause_mode" in weights.model_fields_set:
        raise ValueError(f"{where} is {weights.pause_mode!r}, but a LoRA adapter's versions load without a pause: keep")
    return settings.model_copy(update={"weights": weights.model_copy(update={"pause_mode": "keep"})})


def _pool_section(index: int, name: str, section: S, overrides: Mapping[str, Any]) -> S:
    """The top-level `section` (`name`) with pool `index`'s own keys of it, validated as the section is."""
    if not overrides:
        return section
    try:
        return type(section).model_validate(section.model_dump(exclude_unset=True) | dict(overrides))
    except ValidationError as exc:
        problems = "; ".join(f"{dotted_key(e['loc'])}: {e['msg']}" for e in exc.errors())
        raise ValueError(f"pools[{index}].{name}: {problems}") from None


def load_config(path: str | Path | None = None, **overrides: Any) -> Settings:
    """Read `path` (if given), apply `RG_*` variables and `overrides`, validate once.

    Raises `ConfigError` for a missing or unreadable file, malformed YAML or environment JSON, and
    for every invalid or unknown key (all of them, each as a dotted path with where to set it).
    """
    file = _existing_file(path) if path is not None else None
    warn_unknown_env_vars(os.environ, Settings.model_fields.keys())
    token = _yaml_file.set(file)
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, file)) from exc
    except SettingsError as exc:  # e.g. RG_REPLICAS is not valid JSON
        raise ConfigError(env_parse_error(exc, os.environ)) from exc
    finally:
        _yaml_file.reset(token)


def _existing_file(path: str | Path) -> Path:
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise ConfigError(f"config file not found: {path} (resolved to {file})")
    return file
