"""The gateway's configuration: typed, frozen settings validated once at startup.

Sources, highest precedence first:

1. keyword overrides passed to `load_config(...)` (or `Settings(...)`),
2. `RG_*` environment variables: `RG_<SECTION>__<KEY>` (`RG_SERVER__PORT=9000`); lists and
   objects as JSON (`RG_REPLICAS='[{"url": "http://h:8001", "backend": "vllm"}]'`),
3. the YAML file given to `load_config` (`config.yaml` documents every key),
4. the defaults below, which equal the repository's `config.yaml`.

Every model is frozen (sequences are tuples) and rejects unknown keys, so a typo is an error that
names the key rather than a silently ignored setting. `load_config` turns any failure into one
`ConfigError` that lists every bad key as a dotted path and says where it can be set.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import parse_qsl, urlencode, urlsplit

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    YamlConfigSettingsSource,
)

from gateway.errors import ConfigError
from gateway.session.identity import Identity

logger = logging.getLogger(__name__)

ENV_PREFIX = "RG_"
ENV_NESTED_DELIMITER = "__"

#: The tiny tokenizer shipped inside the package (offline tests and the demo).
DEFAULT_TOKENIZER = Path(__file__).resolve().parent / "assets" / "tiny_tokenizer"

Backend = Literal["vllm", "sglang", "sim"]
Dialect = Literal["vllm", "sglang"]
RoutingPolicy = Literal["sticky", "least_loaded", "round_robin"]
RoutedExpertsPolicy = Literal["splice", "replace"]
PauseMode = Literal["abort", "keep", "wait"]


def _check_http_url(url: str) -> str:
    """Accept `http(s)://host[:port][/path]` and drop a trailing slash so paths join cleanly."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("must be an http:// or https:// URL with a host, e.g. http://127.0.0.1:8001")
    _ = parts.port  # raises ValueError for an out-of-range or non-numeric port
    return url.rstrip("/")


def _check_redis_url(url: str) -> str:
    if url and urlsplit(url).scheme not in ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster"):
        raise ValueError(
            'must be "" (embedded redis-server), a redis://, rediss:// or unix:// URL, or a Redis Cluster\'s '
            "redis+cluster://host:port[,host:port...] (rediss+cluster:// with TLS)"
        )
    return url


def without_credentials(url: str) -> str:
    """`url` fit to print or show: without a user, password or `password=` query parameter (redis-py reads both
    `redis://:secret@host` and `?password=secret`); otherwise exactly as given (a unix:// URL included)."""
    parts = urlsplit(url)
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    query = [(key, value) for key, value in pairs if key != "password"]
    if "@" not in parts.netloc and len(query) == len(pairs):
        return url
    netloc = parts.netloc.rpartition("@")[2]
    rest = parts.path + (f"?{urlencode(query)}" if query else "") + (f"#{parts.fragment}" if parts.fragment else "")
    return f"{parts.scheme}://{netloc}{rest}"


HttpUrlStr = Annotated[str, AfterValidator(_check_http_url)]
RedisUrlStr = Annotated[str, AfterValidator(_check_redis_url)]
Seconds = Annotated[float, Field(gt=0)]


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


DEFAULT_ADMIN_TOKEN = "change-me"


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


class ServerConfig(_Section):
    """The gateway's own HTTP listener and its credentials. The default admin token is refused on an interface
    other hosts reach (anyone could publish weights or remove replicas); on loopback it stays, for a first try."""

    host: str = Field("127.0.0.1", description="Interface to bind.")
    port: int = Field(8000, ge=0, le=65535, description="TCP port; 0 picks a free port (tests).")
    api_keys: tuple[str, ...] = Field(
        (), repr=False, description="Bearer keys accepted on agent routes; empty leaves them open."
    )
    admin_token: SecretStr = Field(SecretStr(DEFAULT_ADMIN_TOKEN), description="Bearer token for /admin routes.")
    metrics_token: SecretStr | None = Field(
        None, description="Bearer token for /metrics and /dashboard/state; None leaves them open."
    )
    max_body_bytes: int = Field(16 * 1024 * 1024, ge=1, description="Largest accepted request body, bytes.")
    max_messages: int = Field(1024, ge=1, description="Most messages in one chat completion request.")
    max_tokens_limit: int = Field(32768, ge=1, description="Largest max_tokens one request may ask for.")
    max_sessions_per_key: int = Field(
        0, ge=0, description="Sessions with a request in flight per API key (per process); 0 = no limit."
    )
    max_open_sessions_per_key: int = Field(
        0, ge=0, description="Sessions created and not finished per API key, across processes (Redis); 0 = no limit."
    )
    shutdown_timeout_s: Seconds = Field(
        30.0, description="On SIGTERM, how long in-flight requests may run before they are cut, seconds."
    )
    stream_buffer_bytes: int = Field(
        16 * 1024 * 1024, ge=1, description="Most bytes of a streamed answer queued for one client before it is cut."
    )
    slow_client_timeout_s: Seconds = Field(
        60.0, description="How long one send to a streaming client may make no progress before it is cut, seconds."
    )
    max_header_bytes: int = Field(
        64 * 1024, ge=1024, description="Largest request head (request line and headers), bytes; more is a 431."
    )
    header_timeout_s: Seconds = Field(
        10.0, description="A connection that has not sent a complete request head within this is closed, seconds."
    )
    max_connections: int | None = Field(
        None, ge=1, description="Client connections per process; then idle ones close, else 503; None: by fd limit."
    )

    @model_validator(mode="after")
    def _no_default_admin_token_beyond_loopback(self) -> ServerConfig:
        if self.admin_token.get_secret_value() == DEFAULT_ADMIN_TOKEN and not _loopback(self.host):
            raise ValueError(
                f"admin_token is the default {DEFAULT_ADMIN_TOKEN!r} while host {self.host!r} lets other hosts in: "
                "set server.admin_token (RG_SERVER__ADMIN_TOKEN) to a secret, or bind to 127.0.0.1"
            )
        return self


class RedisConfig(_Section):
    """Where sessions, samples and the trajectory stream live."""

    url: RedisUrlStr = Field("", repr=False, description='"" starts an embedded redis-server on a free port.')
    data_dir: Path | None = Field(None, description="Data/AOF folder of the embedded server; None = a temp dir.")
    socket_timeout_s: Seconds = Field(5.0, description="Connect and per-command timeout, seconds.")
    retry_budget_s: Seconds = Field(30.0, description="How long writes are retried before StoreError, seconds.")
    max_connections: int = Field(
        512, ge=1, description="Size of the Redis connection pool; when all are busy, commands wait for one."
    )


def _known_tool_parser(name: str) -> str:
    from gateway.parsers.registry import TOOL_PARSERS  # the parsers import the errors, not the config

    return _known(TOOL_PARSERS.names, name)


def _known_reasoning_parser(name: str | None) -> str | None:
    from gateway.parsers.registry import REASONING_PARSERS

    return None if name is None else _known(REASONING_PARSERS.names, name)


def _known(names: tuple[str, ...], name: str) -> str:
    if name != "auto" and name not in names:
        raise ValueError(f"unknown parser {name!r} (known: {', '.join((*names, 'auto'))})")
    return name


class ModelConfig(_Section):
    """The served model as the gateway sees it: tokenizer, chat template, reasoning and tool-call formats."""

    name: str = Field("tiny", min_length=1, description="Model name sent to the engines and shown to agents.")
    tokenizer: Path = Field(DEFAULT_TOKENIZER, description="Local tokenizer folder (read offline).")
    tool_parser: Annotated[str, AfterValidator(_known_tool_parser)] = Field(
        "hermes", description="Tool-call format parsed from completions (vLLM's names; auto: from the chat template)."
    )
    reasoning_parser: Annotated[str | None, AfterValidator(_known_reasoning_parser)] = Field(
        None, description="Reasoning format split from completions (vLLM's names; auto: from the chat template)."
    )
    max_model_len: int = Field(4096, ge=1, description="Context length: prompt + completion tokens.")
    encode_threads: int = Field(
        2, ge=0, le=64, description="Worker threads that tokenize long texts off the event loop (0: none)."
    )
    encode_thread_min_chars: int = Field(
        4096, ge=0, description="Texts of at least this many characters are tokenized in those threads."
    )


def _id_from_url(data: dict[str, Any]) -> str:
    url: str = data["url"]
    parts = urlsplit(url)
    return parts.netloc + parts.path.rstrip("/")


def _dialect_from_backend(data: dict[str, Any]) -> Dialect:
    return "sglang" if data["backend"] == "sglang" else "vllm"


class ReplicaFields(_Section):
    """What a replica is besides where: its engine, protocol and capabilities (`discovery.replica` is one)."""

    backend: Backend = Field(description="Engine kind: vllm | sglang | sim (the bundled simulator).")
    dialect: Dialect = Field(
        default_factory=_dialect_from_backend, description="Protocol; settable only for backend sim."
    )
    routed_experts_shape: tuple[Annotated[int, Field(ge=1)], Annotated[int, Field(ge=1)]] | None = Field(
        None, description="(layers, top_k) to decode SGLang's raw int32 routed experts."
    )
    routed_experts: bool = Field(
        False, description="The engine captures routed experts (started with --enable-return-routed-experts)."
    )
    routed_experts_input: bool = Field(
        False, description="The engine accepts routing replay input (the simulator's opt-in extension)."
    )
    scale_out: bool = Field(False, description="vLLM: /inference/v1/generate is enabled (--enable-scale-out).")
    keep_mode: Literal["retract", "in_place"] = Field(
        "retract", description="SGLang: the pause mode that implements the gateway's keep."
    )
    new_requests_while_paused: Literal["block", "reject", "unknown"] = Field(
        "unknown", description="How the engine treats new requests during an abort/wait pause."
    )

    @model_validator(mode="after")
    def _dialect_matches_backend(self) -> ReplicaFields:
        if self.backend != "sim" and self.dialect != self.backend:
            raise ValueError(f"dialect {self.dialect!r} contradicts backend {self.backend!r} (only sim takes one)")
        if self.routed_experts and self.dialect == "sglang" and self.routed_experts_shape is None:
            raise ValueError("routed_experts on an SGLang replica needs routed_experts_shape: [layers, top_k]")
        return self


class ReplicaConfig(ReplicaFields):
    """One engine replica. `dialect` is the wire protocol it speaks: its backend's, or the simulator's choice."""

    url: HttpUrlStr = Field(description="Base URL of the engine's HTTP server.")
    id: str = Field(default_factory=_id_from_url, min_length=1, description="Unique name; default host:port.")


def _unique_ids(replicas: tuple[ReplicaConfig, ...]) -> tuple[ReplicaConfig, ...]:
    seen: dict[str, int] = {}
    for index, replica in enumerate(replicas):
        if replica.id in seen:
            raise ValueError(f"duplicate replica id {replica.id!r} (replicas[{seen[replica.id]}] and [{index}])")
        seen[replica.id] = index
    return replicas


DEFAULT_REPLICAS = (
    ReplicaConfig(url="http://127.0.0.1:8001", backend="sim", dialect="vllm"),
    ReplicaConfig(url="http://127.0.0.1:8002", backend="sim", dialect="sglang"),
)


def _check_replicas_from(source: str | None) -> str | None:
    """`dns://name:port` or `file://path` (relative paths: to the working folder)."""
    if source is None:
        return None
    parts = urlsplit(source)
    if parts.scheme == "dns":
        if not parts.hostname or parts.port is None:
            raise ValueError("a dns:// source names a host and the engines' port, e.g. dns://engines.ns.svc:8000")
    elif parts.scheme == "file":
        if not (parts.netloc + parts.path):
            raise ValueError("a file:// source names a YAML file, e.g. file:///etc/rollout-gateway/replicas.yaml")
    else:
        raise ValueError("must be null, dns://name:port or file://path")
    return source


class DiscoveryConfig(_Section):
    """How `replicas_from` is followed (docs/serving.md, replica discovery)."""

    interval_s: Seconds = Field(5.0, description="Period of re-resolving the name or re-reading the file, seconds.")
    nameserver: str | None = Field(
        None,
        pattern=r"^[^:\s]+:\d{1,5}$|^\[[0-9a-fA-F:.]+\]:\d{1,5}$",
        description="dns://: the DNS server to ask, host:port; null: the system's (/etc/resolv.conf).",
    )
    replica: ReplicaFields = Field(
        ReplicaFields(backend="vllm"),
        description="dns://: the fields of every discovered replica but its url (backend, dialect, routed_experts...).",
    )


class RoutingConfig(_Section):
    """Placement of sessions on replicas, and replica health (docs/architecture.md §6)."""

    policy: RoutingPolicy = Field("sticky", description="sticky (HRW + bounded load) | least_loaded | round_robin.")
    balance_factor: float = Field(0.25, ge=0, description="ε: skip replicas above (1+ε)×mean in-flight.")
    health_interval_s: Seconds = Field(2.0, description="Period of GET /health probes, seconds.")
    health_timeout_s: Seconds = Field(2.0, description="Timeout of one health probe, seconds.")
    failure_threshold: int = Field(3, ge=1, description="Consecutive failures that open the circuit.")
    circuit_open_s: Seconds = Field(10.0, description="How long an open circuit keeps a replica out, seconds.")


class GenerationConfig(_Section):
    """The generate-with-resume loop and its upstream HTTP client (docs/architecture.md §4)."""

    max_resumes: int = Field(32, ge=0, description="Re-issues of one request after aborts/failures.")
    request_timeout_s: Seconds = Field(600.0, description="Overall deadline of one request, seconds.")
    max_wait_s: float = Field(60.0, ge=0, description="Wait for a serving replica before 503, seconds.")
    routed_experts: RoutedExpertsPolicy = Field("splice", description="Merge of experts across resumes.")
    connect_timeout_s: Seconds = Field(5.0, description="TCP connect timeout to a replica, seconds.")
    read_timeout_s: Seconds = Field(
        600.0, description="Max gap between bytes from a replica (a whole answer: up to request_timeout_s), seconds."
    )
    stall_timeout_s: float = Field(
        60.0,
        ge=0,
        description="A stream silent this long after its first token: its replica failed, resume elsewhere; s, 0: off.",
    )
    write_timeout_s: Seconds = Field(30.0, description="Max time to send a request body, seconds.")
    pool_timeout_s: Seconds = Field(30.0, description="Max wait for a free pooled connection, seconds.")
    keepalive_expiry_s: Seconds = Field(
        4.0,
        description="An unused connection to a replica is closed after this, s; keep it under the engines' keep-alive.",
    )
    max_connections_per_replica: int = Field(1024, ge=1, description="Size of each replica's connection pool.")
    stream_pacing_s: float = Field(
        0.2, ge=0, le=1, description="Least time between two reads of an engine stream while many are open, s (0: off)."
    )
    stream_pacing_min_streams: int = Field(
        32, ge=1, description="Open streams of a replica from which its stream reads are paced."
    )

    @model_validator(mode="after")
    def _pacing_within_timeouts(self) -> GenerationConfig:
        if self.stream_pacing_s >= self.read_timeout_s:
            raise ValueError(
                f"stream_pacing_s ({self.stream_pacing_s:g}) must be shorter than read_timeout_s "
                f"({self.read_timeout_s:g}): a held stream would count as a silent replica"
            )
        if 0 < self.stall_timeout_s <= self.stream_pacing_s:
            raise ValueError(
                f"stall_timeout_s ({self.stall_timeout_s:g}) must be 0 (off) or longer than stream_pacing_s "
                f"({self.stream_pacing_s:g}): a held stream would count as a stalled replica"
            )
        return self


class WeightsConfig(_Section):
    """Weight updates and versions (docs/architecture.md §5)."""

    pause_mode: PauseMode = Field("abort", description="abort | keep | wait; overridable per update.")
    max_staleness: int = Field(4, ge=0, description="Samples older than current - this are marked stale.")
    update_timeout_s: Seconds = Field(600.0, description="Deadline of pause → update → resume, seconds.")
    control_timeout_s: Seconds = Field(
        30.0, description="Timeout of one pause, resume, abort or version call to a replica, seconds."
    )
    member_ttl_s: Seconds = Field(
        10.0,
        description="A gateway process is on the weights bus this long after its heartbeat (every fifth of it); "
        "one coordinating an update is taken for dead after twice this without one, seconds.",
    )


class StoreConfig(_Section):
    """Redis layout and trajectory lifecycle (docs/architecture.md §8)."""

    prefix: str = Field("rg:", min_length=1, description="Prefix of every Redis key.")
    max_pending: int = Field(10000, ge=1, description="Unconsumed trajectories before new sessions get 429.")
    ttl_s: int = Field(86400, gt=0, description="Expiry of finished session data, seconds.")
    session_idle_ttl_s: int = Field(1800, gt=0, description="Idle time before a session is abandoned, seconds.")
    claim_idle_s: Seconds = Field(60.0, description="Pending time before a dead consumer's entry is reclaimed.")
    stream_partitions: int = Field(
        1, ge=1, le=1024, description="Partitions of the trajectory stream (spread over a Redis Cluster's masters)."
    )
    session_cache_size: int = Field(
        10000, ge=1, description="Sessions whose samples this process keeps between turns (LRU); others: from Redis."
    )
    session_cache_bytes: int = Field(
        256 * 1024 * 1024, ge=0, description="Estimated bytes of the sessions this process keeps (LRU beyond it)."
    )
    response_cache_size: int = Field(
        4096, ge=0, description="Stored Responses API answers this process keeps for chained turns (LRU; 0: none)."
    )


class SessionsConfig(_Section):
    """How agents name their sessions (docs/architecture.md §1, `gateway.session.identity`)."""

    identity: Identity = Field(
        "header", description="header (path, X-Session-ID, body) | api_key (the agent's API key names it too)."
    )


class FastPathConfig(_Section):
    """The fast path (`gateway/fastpath/`, docs/architecture.md): the gateway's own, shorter versions of library
    code on its hot routes. `enabled: false` runs the gateway on the libraries alone (same answers, more CPU); the
    other switches turn one part off each, for measuring it (`benchmarks/ab.py --set-b RG_FASTPATH__<PART>=false`)."""

    enabled: bool = Field(True, description="Off: every part below is off.")
    hot_routes: bool = Field(True, description="Hot routes served from the app's entry, past router and wrappers.")
    one_pass_routes: bool = Field(True, description="Hot routes' bodies read and validated in one pass.")
    redis_batching: bool = Field(True, description="Concurrent turns' Redis pipelines sent as one.")
    engine_client: bool = Field(True, description="Generation requests over the gateway's own HTTP/1.1 pool.")

    def on(self, part: str) -> bool:
        """Whether `part` (a switch's name) is on: its own switch and `enabled` both."""
        return self.enabled and bool(getattr(self, part))


# The YAML file of the `load_config` call in progress. pydantic-settings builds its sources in a
# classmethod that cannot see per-call arguments (pydantic-settings#259); a ContextVar scopes the
# path to one call, thread- and task-safely, and leaves `Settings` itself the returned class.
_yaml_file: ContextVar[Path | None] = ContextVar("gateway_config_yaml_file", default=None)

# Relative paths in a YAML file mean "next to that file" (as docker-compose does), so a config file
# works from any working directory. Paths from the environment stay relative to the cwd.
_FILE_RELATIVE_PATHS = (("model", "tokenizer"), ("redis", "data_dir"))


def _anchor_relative_paths(data: dict[str, Any], base: Path) -> dict[str, Any]:
    for section, key in _FILE_RELATIVE_PATHS:
        values = data.get(section)
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
    replicas: Annotated[tuple[ReplicaConfig, ...], AfterValidator(_unique_ids)] = Field(
        DEFAULT_REPLICAS, description="Engine replicas at startup (more via POST /admin/replicas)."
    )
    replicas_from: Annotated[str | None, AfterValidator(_check_replicas_from)] = Field(
        None, description="More replicas, followed at run time: dns://name:port | file://path | null."
    )
    discovery: DiscoveryConfig = DiscoveryConfig()
    routing: RoutingConfig = RoutingConfig()
    generation: GenerationConfig = GenerationConfig()
    weights: WeightsConfig = WeightsConfig()
    store: StoreConfig = StoreConfig()
    sessions: SessionsConfig = SessionsConfig()
    fastpath: FastPathConfig = FastPathConfig()

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


def load_config(path: str | Path | None = None, **overrides: Any) -> Settings:
    """Read `path` (if given), apply `RG_*` variables and `overrides`, validate once.

    Raises `ConfigError` for a missing or unreadable file, malformed YAML or environment JSON, and
    for every invalid or unknown key (all of them, each as a dotted path with where to set it).
    """
    file = _existing_file(path) if path is not None else None
    _warn_unknown_env_vars(os.environ)
    token = _yaml_file.set(file)
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, file)) from exc
    except SettingsError as exc:  # e.g. RG_REPLICAS is not valid JSON
        raise ConfigError(_env_parse_error(exc, os.environ)) from exc
    finally:
        _yaml_file.reset(token)


def _existing_file(path: str | Path) -> Path:
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise ConfigError(f"config file not found: {path} (resolved to {file})")
    return file


def _warn_unknown_env_vars(environ: Mapping[str, str]) -> None:
    # pydantic-settings only looks up variables it expects, so RG_SEVER__PORT would be ignored in
    # silence; a misspelled key inside a known section is already an error (extra="forbid").
    sections = Settings.model_fields.keys()
    for name in sorted(environ):
        upper = name.upper()
        if upper.startswith(ENV_PREFIX):
            section = upper.removeprefix(ENV_PREFIX).split(ENV_NESTED_DELIMITER)[0].lower()
            if section not in sections:
                logger.warning("ignoring %s: no configuration section %r", name, section)


def _env_parse_error(exc: SettingsError, environ: Mapping[str, str]) -> str:
    """Name the RG_* variables of the section pydantic-settings could not decode, and why."""
    match = re.search(r'field "(\w+)"', str(exc))
    prefix = env_var_name((match[1],)) if match else ENV_PREFIX
    names = sorted(name for name in environ if name.upper().startswith(prefix))
    reason = f": {exc.__cause__}" if exc.__cause__ else ""
    return (
        f"invalid configuration in {' or '.join(names) or 'the RG_* environment'}{reason} "
        "(lists and objects in RG_* variables must be JSON)"
    )


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


def env_var_name(loc: Sequence[str | int]) -> str:
    """The variable that sets `loc`; inside a list, the variable of the whole list (as JSON)."""
    names: list[str] = []
    for part in loc:
        if isinstance(part, int):
            break
        names.append(part)
    return ENV_PREFIX + ENV_NESTED_DELIMITER.join(names).upper()


def _where(loc: Sequence[str | int], file: Path | None) -> str:
    env = f"env {env_var_name(loc)}"
    return f"set in {file} or {env}" if file else f"set in a config file or {env}"


__all__ = [
    "DEFAULT_REPLICAS",
    "DEFAULT_TOKENIZER",
    "ENV_NESTED_DELIMITER",
    "ENV_PREFIX",
    "Backend",
    "Dialect",
    "FastPathConfig",
    "GenerationConfig",
    "ModelConfig",
    "PauseMode",
    "RedisConfig",
    "ReplicaConfig",
    "RoutedExpertsPolicy",
    "RoutingConfig",
    "RoutingPolicy",
    "ServerConfig",
    "SessionsConfig",
    "Settings",
    "StoreConfig",
    "WeightsConfig",
    "dotted_key",
    "env_var_name",
    "format_validation_error",
    "load_config",
]
