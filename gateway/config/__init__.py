"""The gateway's configuration: typed, frozen settings validated once at startup.

Sources, highest precedence first:

1. keyword overrides passed to `load_config(...)` (or `Settings(...)`),
2. `RG_*` environment variables: `RG_<SECTION>__<KEY>` (`RG_SERVER__PORT=9000`); lists and
   objects as JSON (`RG_REPLICAS='[{"url": "http://h:8001", "backend": "vllm"}]'`),
3. the YAML file given to `load_config` (`config.yaml` documents every key),
4. the defaults of the sections, which equal the repository's `config.yaml`.

Every model is frozen (sequences are tuples) and rejects unknown keys, so a typo is an error that
names the key rather than a silently ignored setting. `load_config` turns any failure into one
`ConfigError` that lists every bad key as a dotted path and says where it can be set.

One module per section (`server` with `api_keys`, `redis`, `model`, `replicas` with `discovery`, `routing`,
`generation`, `weights`, `store` with `sessions`, `fastpath`, `sampling`); `loading` assembles them into `Settings`
and reads the sources; `environment` and `messages` name the keys in what goes wrong.
"""

from __future__ import annotations

from gateway.config.api_keys import ApiKey, derived_key_id
from gateway.config.environment import ENV_NESTED_DELIMITER, ENV_PREFIX, env_var_name
from gateway.config.fastpath import FastPathConfig
from gateway.config.generation import GenerationConfig, RoutedExpertsPolicy
from gateway.config.loading import Settings, load_config
from gateway.config.messages import dotted_key, format_validation_error
from gateway.config.model import DEFAULT_TOKENIZER, ModelConfig
from gateway.config.redis import RedisConfig, without_credentials
from gateway.config.replicas import DEFAULT_REPLICAS, Backend, Dialect, DiscoveryConfig, ReplicaConfig, ReplicaFields
from gateway.config.routing import RoutingConfig, RoutingPolicy
from gateway.config.sampling import Pin, SamplingConfig, SamplingPolicy
from gateway.config.server import ServerConfig
from gateway.config.store import SessionsConfig, StoreConfig
from gateway.config.weights import PauseMode, WeightsConfig

__all__ = [
    "DEFAULT_REPLICAS",
    "DEFAULT_TOKENIZER",
    "ApiKey",
    "ENV_NESTED_DELIMITER",
    "ENV_PREFIX",
    "Backend",
    "Dialect",
    "DiscoveryConfig",
    "FastPathConfig",
    "GenerationConfig",
    "ModelConfig",
    "PauseMode",
    "Pin",
    "RedisConfig",
    "ReplicaConfig",
    "ReplicaFields",
    "RoutedExpertsPolicy",
    "RoutingConfig",
    "RoutingPolicy",
    "SamplingConfig",
    "SamplingPolicy",
    "ServerConfig",
    "SessionsConfig",
    "Settings",
    "StoreConfig",
    "WeightsConfig",
    "derived_key_id",
    "dotted_key",
    "env_var_name",
    "format_validation_error",
    "load_config",
    "without_credentials",
]
