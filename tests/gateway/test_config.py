from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel, SecretStr, ValidationError

import gateway.config as config_package
import gateway.config.loading as config_loading
from gateway.config import (
    DEFAULT_TOKENIZER,
    ReplicaConfig,
    Settings,
    dotted_key,
    env_var_name,
    load_config,
    without_credentials,
)
from gateway.config.redis import cluster_nodes
from gateway.config.server import DEFAULT_MAX_OPEN_SESSIONS, ServerConfig
from gateway.errors import ConfigError
from gateway.services import replica_spec
from tests import REPO

REPO_CONFIG = REPO / "config.yaml"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts with no RG_* variable, whatever the developer's shell exports."""
    for name in list(os.environ):
        if name.upper().startswith("RG_"):
            monkeypatch.delenv(name)


def write_yaml(tmp_path: Path, data: object) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def config_error(path: Path | None = None, /, **overrides: object) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, **overrides)
    return info.value.message


# --- the shipped config.yaml -------------------------------------------------------------------


def test_repo_config_equals_the_builtin_defaults() -> None:
    assert load_config(REPO_CONFIG) == Settings()


def test_repo_config_has_the_documented_values() -> None:
    settings = load_config(REPO_CONFIG)
    assert (settings.server.host, settings.server.port, settings.server.api_keys) == ("127.0.0.1", 8000, ())
    assert settings.server.admin_token.get_secret_value() == "change-me"
    assert settings.redis.url == ""
    assert settings.redis.data_dir is None
    assert (settings.model.name, settings.model.tool_parser, settings.model.max_model_len) == ("tiny", "hermes", 4096)
    assert settings.model.tokenizer == DEFAULT_TOKENIZER
    assert [(r.id, r.url, r.backend, r.dialect) for r in settings.replicas] == [
        ("127.0.0.1:8001", "http://127.0.0.1:8001", "sim", "vllm"),
        ("127.0.0.1:8002", "http://127.0.0.1:8002", "sim", "sglang"),
    ]
    assert settings.routing.policy == "sticky"
    assert settings.routing.balance_factor == 0.25
    assert settings.routing.health_interval_s == 2.0
    assert settings.routing.group_placement == "together" and settings.routing.load_bound == 32
    assert settings.generation.max_resumes == 32
    assert settings.generation.request_timeout_s == 600
    assert settings.generation.max_wait_s == 60
    assert settings.generation.routed_experts == "splice"
    assert (settings.weights.pause_mode, settings.weights.max_staleness) == ("abort", 4)
    assert settings.weights.update_timeout_s == 600
    assert (settings.store.prefix, settings.store.max_pending, settings.store.ttl_s) == ("rg:", 10000, 86400)
    assert settings.server.max_open_sessions_per_key == 20000


def test_open_sessions_are_bounded_by_default_above_the_capacity_target() -> None:
    """One process is sized for 10,000 open sessions (docs/reliability.md); without API keys they share the bound."""
    assert Settings().server.max_open_sessions_per_key == DEFAULT_MAX_OPEN_SESSIONS > 10_000
    for off in (0, None):
        assert not Settings(server={"max_open_sessions_per_key": off}).server.max_open_sessions_per_key
    with pytest.raises(ValidationError):
        Settings(server={"max_open_sessions_per_key": -1})


def test_a_server_open_to_anyone_is_named_only_beyond_loopback_without_keys_or_bound() -> None:
    beyond = {"host": "0.0.0.0", "admin_token": "s3cret"}
    warning = ServerConfig(**beyond, max_open_sessions_per_key=None).open_to_anyone()
    assert warning is not None
    assert "server.api_keys" in warning and "server.max_open_sessions_per_key" in warning and "'0.0.0.0'" in warning
    assert ServerConfig(**beyond, max_open_sessions_per_key=0, api_keys=["k"]).open_to_anyone() is None
    assert ServerConfig(**beyond).open_to_anyone() is None  # the default bound
    for host in ("127.0.0.1", "::1", "localhost"):
        assert ServerConfig(host=host, max_open_sessions_per_key=0).open_to_anyone() is None
    assert ServerConfig(host="gateway.internal", admin_token="s3cret", max_open_sessions_per_key=0).open_to_anyone()


def test_repo_config_documents_every_key() -> None:
    """config.yaml spells out every key, each under a comment (keys may share one comment block)."""
    data = yaml.safe_load(REPO_CONFIG.read_text())
    assert set(data) == set(Settings.model_fields)
    for section, value in data.items():
        if isinstance(getattr(Settings(), section), BaseModel):  # a section, not a top-level value
            assert set(value) == set(type(getattr(Settings(), section)).model_fields), section
    lines = REPO_CONFIG.read_text().splitlines()
    for key in ReplicaConfig.model_fields:
        assert any(line.startswith(f"#   {key} ") for line in lines), key
    for index, line in enumerate(lines):
        if is_key_line(line):
            above = index - 1
            while is_key_line(lines[above]):
                above -= 1
            assert lines[above].lstrip().startswith("#"), line


def is_key_line(line: str) -> bool:
    """A key inside a section (two-space indent), not a comment or a list item."""
    stripped = line.lstrip()
    return len(line) - len(stripped) == 2 and ":" in stripped and not stripped.startswith(("#", "-"))


def test_relative_paths_in_a_file_are_relative_to_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pools = [{"model": "a", "tokenizer": "tok-a"}, {"model": "b"}]
    path = write_yaml(tmp_path, {"model": {"tokenizer": "tok"}, "redis": {"data_dir": "~/redis-data"}, "pools": pools})
    monkeypatch.chdir("/")
    settings = load_config(path)
    assert settings.model.tokenizer == tmp_path / "tok"
    assert [p.model.tokenizer for p in settings.pool_settings()] == [tmp_path / "tok-a", tmp_path / "tok"]
    assert settings.redis.data_dir == Path("~/redis-data").expanduser()


def test_no_file_gives_the_defaults() -> None:
    assert load_config() == Settings()
    assert load_config().model.tokenizer == DEFAULT_TOKENIZER


def test_empty_file_gives_the_defaults(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing\n")
    assert load_config(path) == Settings()


# --- environment and precedence ----------------------------------------------------------------


def test_env_overrides_a_nested_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RG_SERVER__PORT", "9000")
    monkeypatch.setenv("RG_REDIS__URL", "redis://localhost:6379/0")
    monkeypatch.setenv("RG_SERVER__API_KEYS", '["k1", "k2"]')
    settings = load_config(REPO_CONFIG)
    assert settings.server.port == 9000
    assert settings.server.host == "127.0.0.1"  # the rest of the section still comes from the file
    assert settings.redis.url == "redis://localhost:6379/0"
    assert [key.secret() for key in settings.server.api_keys] == ["k1", "k2"]


def test_the_keepalive_expiry_reaches_each_replicas_clients(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = load_config(REPO_CONFIG)
    assert replica_spec(settings.replicas[0], settings).timeouts.keepalive == 4.0  # under the engines' 5 s
    monkeypatch.setenv("RG_GENERATION__KEEPALIVE_EXPIRY_S", "2.5")
    settings = load_config(REPO_CONFIG)
    assert replica_spec(settings.replicas[0], settings).timeouts.keepalive == 2.5


def test_env_replicas_as_json(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(
        "RG_REPLICAS",
        '[{"url": "http://10.0.0.5:8000/", "backend": "vllm"},'
        ' {"url": "http://10.0.0.6:30000", "backend": "sglang", "id": "sg", "routed_experts_shape": [48, 8]}]',
    )
    replicas = load_config(REPO_CONFIG).replicas
    assert [(r.id, r.url, r.backend, r.dialect) for r in replicas] == [
        ("10.0.0.5:8000", "http://10.0.0.5:8000", "vllm", "vllm"),
        ("sg", "http://10.0.0.6:30000", "sglang", "sglang"),
    ]
    assert replicas[1].routed_experts_shape == (48, 8)


def test_env_beats_file_and_overrides_beat_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_yaml(
        tmp_path,
        {"server": {"port": 7000, "host": "0.0.0.0", "admin_token": "s3cret"}, "weights": {"max_staleness": 1}},
    )
    monkeypatch.setenv("RG_SERVER__PORT", "7001")
    monkeypatch.setenv("RG_WEIGHTS__MAX_STALENESS", "2")
    settings = load_config(path, weights={"max_staleness": 3})
    assert (settings.server.port, settings.server.host) == (7001, "0.0.0.0")
    assert settings.weights.max_staleness == 3


def test_env_names_are_case_insensitive(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("rg_routing__policy", "round_robin")
    assert load_config().routing.policy == "round_robin"


def test_admin_token_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RG_SERVER__ADMIN_TOKEN", "s3cret")
    assert load_config(REPO_CONFIG).server.admin_token == SecretStr("s3cret")


def test_null_in_env_clears_an_optional_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_yaml(tmp_path, {"redis": {"data_dir": "/var/lib/rg"}})
    monkeypatch.setenv("RG_REDIS__DATA_DIR", "null")
    assert load_config(path).redis.data_dir is None


def test_unknown_env_section_is_logged(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("RG_SEVER__PORT", "1")
    with caplog.at_level(logging.WARNING, logger="gateway.config"):
        settings = load_config()
    assert settings.server.port == 8000
    assert "RG_SEVER__PORT" in caplog.text


def test_malformed_env_json_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RG_REPLICAS", "[{not json")
    monkeypatch.setenv("RG_SERVER__PORT", "1")
    message = config_error()
    assert message.startswith("invalid configuration in RG_REPLICAS: Expecting property name")
    assert "must be JSON" in message


def test_malformed_nested_env_json_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RG_SERVER__API_KEYS", "[k1")
    monkeypatch.setenv("RG_SERVER__PORT", "1")
    assert "RG_SERVER__API_KEYS or RG_SERVER__PORT" in config_error()


# --- validation errors name the key ------------------------------------------------------------


def test_port_out_of_range(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, {"server": {"port": 70000}})
    message = config_error(path)
    assert "server.port: Input should be less than or equal to 65535 (got 70000)" in message
    assert f"[set in {path} or env RG_SERVER__PORT]" in message


def test_port_out_of_range_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RG_SERVER__PORT", "70000")
    message = config_error(REPO_CONFIG)
    assert "server.port: Input should be less than or equal to 65535 (got '70000')" in message
    assert "RG_SERVER__PORT" in message


def test_unknown_backend(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, {"replicas": [{"url": "http://h:1", "backend": "tgi"}]})
    message = config_error(path)
    assert "replicas[0].backend: Input should be 'vllm', 'sglang' or 'sim' (got 'tgi')" in message
    assert "RG_REPLICAS" in message
    assert "default_factory" not in message  # the derived dialect's echo of the same error is dropped


def test_negative_max_resumes(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, {"generation": {"max_resumes": -1}})
    message = config_error(path)
    assert "generation.max_resumes: Input should be greater than or equal to 0 (got -1)" in message
    assert "RG_GENERATION__MAX_RESUMES" in message


def test_unknown_key(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, {"server": {"prot": 8001}})
    assert "server.prot: unknown key (got 8001)" in config_error(path)


def test_unknown_key_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RG_SERVER__PROT", "8001")
    assert "server.prot: unknown key" in config_error()


def test_unknown_section(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, {"sever": {"port": 1}})
    assert "sever: unknown key" in config_error(path)


def test_duplicate_replica_ids(tmp_path: Path) -> None:
    path = write_yaml(
        tmp_path,
        {
            "replicas": [
                {"url": "http://h:1", "backend": "sim"},
                {"url": "http://h:2", "backend": "sim", "id": "h:1"},
            ]
        },
    )
    message = config_error(path)
    assert "replicas: duplicate replica id 'h:1' (replicas[0] and [1])" in message


def test_same_url_twice_is_a_duplicate_id() -> None:
    message = config_error(replicas=[{"url": "http://h:1", "backend": "sim"}, {"url": "http://h:1/", "backend": "sim"}])
    assert "duplicate replica id 'h:1'" in message


def test_every_bad_key_is_listed(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, {"server": {"port": -1}, "routing": {"policy": "random", "balance_factor": -1}})
    message = config_error(path)
    assert message.startswith("invalid configuration, 3 errors")
    for key in ("server.port", "routing.policy", "routing.balance_factor"):
        assert f"\n  {key}: " in message


@pytest.mark.parametrize(
    ("replica", "expected"),
    [
        ({"url": "ftp://h:1", "backend": "sim"}, "replicas[0].url: must be an http:// or https:// URL"),
        ({"url": "http://h:99999", "backend": "sim"}, "replicas[0].url: Port out of range"),
        ({"url": "http://h:1"}, "replicas[0].backend: Field required"),
        ({"url": "http://h:1", "backend": "vllm", "dialect": "sglang"}, "replicas[0]: dialect 'sglang' contradicts"),
        (
            {"url": "http://h:1", "backend": "sim", "routed_experts_shape": [0, 8]},
            "replicas[0].routed_experts_shape[0]: Input should be greater",
        ),
        (
            {"url": "http://h:1", "backend": "vllm", "data_parallel_size": 0},
            "replicas[0].data_parallel_size: Input should be greater than or equal to 1 (got 0)",
        ),
    ],
)
def test_bad_replica(replica: dict[str, object], expected: str) -> None:
    assert expected in config_error(replicas=[replica])


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"redis": {"url": "http://r:6379"}}, "redis.url"),
        ({"routing": {"health_interval_s": 0}}, "routing.health_interval_s"),
        ({"routing": {"policy": "prefix"}}, "routing.policy"),
        ({"routing": {"group_placement": "split"}}, "routing.group_placement"),
        ({"routing": {"load_bound": -1}}, "routing.load_bound"),
        ({"routing": {"kv_usage_limit": 0}}, "routing.kv_usage_limit"),
        ({"routing": {"kv_usage_limit": 1.5}}, "routing.kv_usage_limit"),
        ({"routing": {"load_interval_s": 0}}, "routing.load_interval_s"),
        ({"routing": {"prefix_block_tokens": 0}}, "routing.prefix_block_tokens"),
        ({"routing": {"prefix_max_blocks": 0}}, "routing.prefix_max_blocks"),
        ({"weights": {"pause_mode": "drop"}}, "weights.pause_mode"),
        ({"weights": {"update_timeout_s": -1}}, "weights.update_timeout_s"),
        ({"store": {"max_pending": 0}}, "store.max_pending"),
        ({"store": {"prefix": ""}}, "store.prefix"),
        ({"generation": {"routed_experts": "merge"}}, "generation.routed_experts"),
        ({"generation": {"stream_pacing_s": 1.5}}, "generation.stream_pacing_s"),
        ({"generation": {"keepalive_expiry_s": 0}}, "generation.keepalive_expiry_s"),
        ({"generation": {"stream_pacing_min_streams": 0}}, "generation.stream_pacing_min_streams"),
        ({"generation": {"stream_pacing_s": 0.5, "read_timeout_s": 0.5}}, "generation"),
        ({"redis": {"durable_replicas": -1}}, "redis.durable_replicas"),
        ({"redis": {"wait_timeout_ms": 0}}, "redis.wait_timeout_ms"),
        ({"redis": {"wait_timeout_ms": 5000, "socket_timeout_s": 5}}, "redis"),
        ({"model": {"tool_parser": "no-such-format"}}, "model.tool_parser"),
    ],
)
def test_bad_values_name_their_key(overrides: dict[str, object], key: str) -> None:
    assert f"\n  {key}: " in config_error(**overrides)


def test_a_short_socket_timeout_alone_shortens_the_wait_rather_than_refusing_the_config() -> None:
    """WAIT must answer within the socket timeout; set neither WAIT setting and a short socket timeout is a valid
    configuration whose WAIT timeout is half of it (set either, and a WAIT timeout past it is a config error)."""
    short = Settings(redis={"socket_timeout_s": 0.5})
    assert short.redis.wait_timeout_effective_ms == 250
    assert Settings().redis.wait_timeout_effective_ms == 1000
    assert Settings(redis={"socket_timeout_s": 0.5, "durable_replicas": 0}).redis.wait_timeout_effective_ms == 1000
    assert "\n  redis: " in config_error(redis={"socket_timeout_s": 0.5, "durable_replicas": 1})


def test_secret_values_are_not_echoed_in_errors(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, {"server": {"admin_token": 123456789}, "redis": {"url": "http://:hunter2pw@r"}})
    message = config_error(path)
    assert "server.admin_token" in message and "redis.url" in message
    assert "123456789" not in message and "hunter2pw" not in message


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    message = config_error(missing)
    assert str(missing) in message
    assert "not found" in message


def test_malformed_yaml_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("server: {port: [\n")
    assert str(path) in config_error(path)


def test_undecodable_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes("model: {name: caf\u00e9}\n".encode("latin-1"))
    assert f"{path}: cannot read" in config_error(path)


def test_top_level_must_be_a_mapping(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, ["server"])
    assert str(path) in config_error(path)


def test_helpers() -> None:
    assert dotted_key(("replicas", 2, "routed_experts_shape", 0)) == "replicas[2].routed_experts_shape[0]"
    assert dotted_key(()) == "(top level)"
    assert env_var_name(("generation", "max_wait_s")) == "RG_GENERATION__MAX_WAIT_S"
    assert env_var_name(("replicas", 0, "url")) == "RG_REPLICAS"


def test_long_values_are_shortened() -> None:
    message = config_error(model={"max_model_len": "x" * 500})
    assert "x" * 70 + "..." in message
    assert "x" * 100 not in message


# --- immutability and secrecy ------------------------------------------------------------------


def test_settings_are_frozen() -> None:
    settings = load_config(REPO_CONFIG)
    with pytest.raises(ValidationError, match="frozen"):
        settings.server.port = 1  # type: ignore[misc]
    with pytest.raises(ValidationError, match="frozen"):
        settings.server = settings.server  # type: ignore[misc]
    with pytest.raises(AttributeError):
        settings.replicas.append(settings.replicas[0])  # type: ignore[attr-defined]
    assert hash(settings) == hash(load_config(REPO_CONFIG))


def test_admin_token_is_never_printed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RG_SERVER__ADMIN_TOKEN", "tok-7f3a9")
    monkeypatch.setenv("RG_SERVER__API_KEYS", '["key-1b2c"]')
    settings = load_config(REPO_CONFIG)
    for text in (repr(settings), str(settings), repr(settings.server), settings.model_dump_json()):
        assert "tok-7f3a9" not in text
    assert "key-1b2c" not in repr(settings)
    assert settings.server.admin_token.get_secret_value() == "tok-7f3a9"


def test_public_names_are_exported() -> None:
    for name in config_package.__all__:
        assert hasattr(config_package, name), name


def test_load_config_does_not_leak_its_file_into_later_loads(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, {"server": {"port": 1234}})
    assert load_config(path).server.port == 1234
    assert Settings().server.port == 8000
    assert config_loading._yaml_file.get() is None


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:secret@10.0.0.5:6379/0", "redis://10.0.0.5:6379/0"),
        ("redis://trainer:secret@redis:6379/1", "redis://redis:6379/1"),
        ("rediss://default:secret@[::1]:6380/0?ssl_cert_reqs=none", "rediss://[::1]:6380/0?ssl_cert_reqs=none"),
        ("redis://redis:6379/0?password=secret&db=2", "redis://redis:6379/0?db=2"),
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("unix:///tmp/rg%20redis/redis.sock?db=0", "unix:///tmp/rg%20redis/redis.sock?db=0"),  # as it is
        ("unix://:secret@/tmp/redis.sock?db=0", "unix:///tmp/redis.sock?db=0"),
        ("unix:///tmp/redis.sock?db=0&password=secret", "unix:///tmp/redis.sock?db=0"),
    ],
)
def test_a_redis_url_is_shown_without_credentials(url: str, shown: str) -> None:
    assert without_credentials(url) == shown


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("redis+cluster://", "node 1 of 1 has no host"),
        ("redis+cluster://:hunter2pw@", "node 1 of 1 has no host"),
        ("redis+cluster://a:7000,", "node 2 of 2 has no host"),
        ("redis+cluster://h:notaport", "port of Redis Cluster node 1 of 1 is not a number"),
        ("rediss+cluster://a:7000,b:70000", "port of Redis Cluster node 2 of 2 is not a number"),
        ("redis+cluster://a:0", "port of Redis Cluster node 1 of 1 is not a number"),
        ("redis+cluster://trainer:hunter2pw", "port of Redis Cluster node 1 of 1"),  # no @: the password is no port
    ],
)
def test_a_cluster_url_without_a_node_is_refused_naming_the_key(url: str, says: str) -> None:
    """Issue 52 §9: `redis+cluster://` with no host was taken and retried `:6379` forever, and a port that is none
    killed the start with a bare ValueError. The key is named, the password never shown."""
    message = config_error(redis={"url": url})
    assert "\n  redis.url: " in message and says in message and "hunter2pw" not in message


@pytest.mark.parametrize(
    ("url", "nodes"),
    [
        ("redis+cluster://a:7000,b:7001", [("a", 7000), ("b", 7001)]),
        ("redis+cluster://:p%40ss@redis", [("redis", 6379)]),
        ("rediss+cluster://[::1]:7000,[fe80::1]", [("::1", 7000), ("fe80::1", 6379)]),
    ],
)
def test_a_cluster_url_lists_its_startup_nodes(url: str, nodes: list[tuple[str, int]]) -> None:
    assert load_config(redis={"url": url}).redis.url == url
    assert cluster_nodes(url) == nodes


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "gateway.internal"])
def test_the_default_admin_token_is_refused_beyond_loopback(host: str) -> None:
    """Issue 38 §8: `change-me` opened /admin to every host that reached the gateway, with no warning."""
    with pytest.raises(
        ConfigError, match=r"admin_token is the default 'change-me' while host .* set server\.admin_token"
    ):
        load_config(server={"host": host})
    assert load_config(server={"host": host, "admin_token": "s3cret"}).server.host == host


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_the_default_admin_token_stays_on_loopback(host: str) -> None:
    assert load_config(server={"host": host}).server.admin_token.get_secret_value() == "change-me"
