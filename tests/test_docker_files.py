"""docker/: the compose file, the Dockerfile and the Grafana dashboard, checked statically.

No Docker engine runs where these tests run, so nothing is built or started: the files are parsed and checked
against each other and against the project (the config the gateway mounts loads with `load_config`, the image's
entrypoint is a console script of pyproject.toml, the dashboard only queries metrics gateway/metrics.py exports).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import tomllib
from collections.abc import Iterator, Mapping
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from gateway.config import load_config
from tests import REPO

ROOT = REPO
DOCKER = ROOT / "docker"
COMPOSE = DOCKER / "compose.yaml"
DOCKERFILE = DOCKER / "Dockerfile"
DASHBOARD = DOCKER / "grafana" / "rollout-gateway.json"
HAPROXY_CONFIG = DOCKER / "haproxy" / "haproxy.cfg"

CONFIG_TARGET = "/etc/rollout-gateway/config.yaml"
CORE_SERVICES = {"redis", "gateway", "vllm-0", "vllm-1"}
GATEWAYS = {"gateway": "vllm", "gateway-sglang": "sglang"}
ENGINE_IMAGES = {"vllm": "vllm/vllm-openai", "sglang": "lmsysorg/sglang"}

# The metric names of gateway/metrics.py (a contract: the dashboard is built against them).
METRICS = {
    "rollout_gateway_requests_total",
    "rollout_gateway_tokens_total",
    "rollout_gateway_in_flight",
    "rollout_gateway_replica_healthy",
    "rollout_gateway_resumes_total",
    "rollout_gateway_preemptions_total",
    "rollout_gateway_resume_latency_seconds",
    "rollout_gateway_weight_version",
    "rollout_gateway_weight_update_seconds",
    "rollout_gateway_store_pending",
    "rollout_gateway_affinity_ratio",
}
HISTOGRAMS = {"rollout_gateway_resume_latency_seconds", "rollout_gateway_weight_update_seconds"}


# ---------------------------------------------------------------------------------------------------------------
# Helpers: compose's variable interpolation, its volume syntax, Dockerfile instructions, PromQL metric names.
# ---------------------------------------------------------------------------------------------------------------

_VARIABLE = re.compile(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}")


def interpolate(value: str, env: Mapping[str, str] | None = None) -> str:
    """Compose's `${VAR}`, `${VAR:-default}`, `${VAR-default}`, `${VAR:?error}` with `env` (default: empty)."""
    env = env or {}

    def substitute(match: re.Match[str]) -> str:
        name, op, arg = match["name"], match["op"], match["arg"]
        value = env.get(name)
        if op in (":-", ":?") and not value or op in ("-", "?") and value is None:
            if op.endswith("?"):
                raise KeyError(f"{name} is required: {arg}")
            return arg or ""
        return value or ""

    return _VARIABLE.sub(substitute, value.replace("$$", "\0")).replace("\0", "$")


@cache
def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict)
    return data


def services() -> dict[str, dict[str, Any]]:
    result: dict[str, dict[str, Any]] = compose()["services"]
    return result


def profile_of(service: Mapping[str, Any]) -> tuple[str, ...]:
    return tuple(service.get("profiles", ()))


def engine_kind(service: Mapping[str, Any]) -> str | None:
    image = str(service.get("image", ""))
    return next((kind for kind, prefix in ENGINE_IMAGES.items() if image.startswith(prefix + ":")), None)


def engines() -> dict[str, dict[str, Any]]:
    return {name: svc for name, svc in services().items() if engine_kind(svc)}


def volume_mounts(service: Mapping[str, Any]) -> Iterator[tuple[str, str, bool]]:
    """(source, target, read_only) of every mount, short or long syntax; sources interpolated with defaults."""
    for entry in service.get("volumes", ()):
        if isinstance(entry, str):
            parts = interpolate(entry).split(":")
            yield parts[0], parts[1], len(parts) > 2 and "ro" in parts[2].split(",")
        else:
            yield interpolate(str(entry.get("source", ""))), entry["target"], bool(entry.get("read_only"))


def mounted_config(service: Mapping[str, Any]) -> Path:
    """The file of docker/ that a gateway service mounts as the image's config."""
    sources = {target: source for source, target, _ro in volume_mounts(service)}
    return (DOCKER / sources[CONFIG_TARGET]).resolve()


def is_bind(source: str) -> bool:
    return source.startswith((".", "/", "~"))


def environment(service: Mapping[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {key: str(value) for key, value in env.items()}


def command(service: Mapping[str, Any]) -> list[str]:
    def words(part: Any) -> list[str]:
        return shlex.split(part) if isinstance(part, str) else [str(word) for word in part or ()]

    return [interpolate(word) for word in words(service.get("entrypoint")) + words(service.get("command"))]


def flag(service: Mapping[str, Any], name: str) -> str:
    """The value of `--name=value` or `--name value` in a service's entrypoint + command."""
    words = command(service)
    for i, word in enumerate(words):
        if word.startswith(f"{name}="):
            return word.split("=", 1)[1]
        if word == name:
            return words[i + 1]
    raise AssertionError(f"no {name} in {words}")


def engine_port(service: Mapping[str, Any]) -> str:
    return flag(service, "--port")


def engine_model(service: Mapping[str, Any]) -> str:
    words = command(service)
    return words[2] if engine_kind(service) == "vllm" else flag(service, "--model-path")


def healthcheck_words(service: Mapping[str, Any]) -> list[str]:
    test = service["healthcheck"]["test"]
    return shlex.split(test) if isinstance(test, str) else [str(word) for word in test]


def depends_on(service: Mapping[str, Any]) -> dict[str, str]:
    deps = service.get("depends_on", {})
    if isinstance(deps, list):
        return dict.fromkeys(deps, "service_started")
    return {name: spec.get("condition", "service_started") for name, spec in deps.items()}


def gpu_device_ids(service: Mapping[str, Any]) -> list[str]:
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    ids: list[str] = []
    for device in devices:
        assert "gpu" in device["capabilities"], device
        assert "count" not in device, "device_ids pins one GPU per replica; count would take any"
        ids += [interpolate(str(i)) for i in device["device_ids"]]
    return ids


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with comments dropped and continuation lines joined."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for line in DOCKERFILE.read_text().splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        pending += " " + stripped[:-1] if stripped.endswith("\\") else " " + stripped
        if not stripped.endswith("\\"):
            keyword, _, args = pending.strip().partition(" ")
            instructions.append((keyword.upper(), args.strip()))
            pending = ""
    return instructions


def final_stage() -> list[tuple[str, str]]:
    instructions = dockerfile_instructions()
    last_from = max(i for i, (keyword, _) in enumerate(instructions) if keyword == "FROM")
    return instructions[last_from:]


def exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(word, str) for word in value), args
    return value


_PROMQL_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_PROMQL_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_PROMQL_KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "inf", "nan"}
_IDENTIFIER = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def promql_metric_names(expr: str) -> set[str]:
    """Every metric name an expression selects: identifiers that are not functions, keywords, labels or durations."""
    text = _PROMQL_STRING.sub('""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # range and subquery durations
    text = _PROMQL_GROUPING.sub(" ", text)
    text = re.sub(r"\$\{?\w+\}?", " ", text)  # Grafana variables outside ranges
    text = re.sub(r"\b\d+(?:\.\d+)?(?:e[+-]?\d+)?\b", " ", text)  # numbers
    names = set()
    for match in _IDENTIFIER.finditer(text):
        rest = text[match.end() :].lstrip()
        if rest.startswith("(") or match[0].lower() in _PROMQL_KEYWORDS:
            continue  # a function call or a keyword
        names.add(match[0])
    return names


def base_metric(name: str) -> str:
    for suffix in ("_bucket", "_sum", "_count"):
        if name.endswith(suffix) and name.removesuffix(suffix) in HISTOGRAMS:
            return name.removesuffix(suffix)
    return name


@cache
def dashboard() -> dict[str, Any]:
    data = json.loads(DASHBOARD.read_text())
    assert isinstance(data, dict)
    return data


def all_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from all_panels(panel.get("panels", []))


def test_helpers_parse_what_they_claim() -> None:
    assert interpolate("${A:-x}-${B-y}-${C}-$$HOME", {"C": "c"}) == "x-y-c-$HOME"
    assert interpolate("${A:-x}", {"A": ""}) == "x" and interpolate("${A-x}", {"A": ""}) == ""
    with pytest.raises(KeyError):
        interpolate("${TOKEN:?set it}")
    expr = (
        'histogram_quantile(0.95, sum by (le) (rate(m_bucket{job=~"$j",x="a b"}[$__rate_interval]))) / n or vector(1)'
    )
    assert promql_metric_names(expr) == {"m_bucket", "n"}


# ---------------------------------------------------------------------------------------------------------------
# compose.yaml
# ---------------------------------------------------------------------------------------------------------------


def test_core_services_have_no_profile_and_sglang_only_its_own() -> None:
    svcs = services()
    assert CORE_SERVICES <= svcs.keys()
    for name in CORE_SERVICES:
        assert profile_of(svcs[name]) == (), f"{name} must start without a profile"
    sglang = {name for name, svc in svcs.items() if engine_kind(svc) == "sglang" or "sglang" in name}
    assert {"sglang-0", "sglang-1", "gateway-sglang"} <= sglang
    for name in sglang:
        assert profile_of(svcs[name]) == ("sglang",), f"{name} must be in the sglang profile only"
    assert {name for name, svc in svcs.items() if engine_kind(svc) == "vllm"} == {"vllm-0", "vllm-1"}


def test_every_long_running_service_has_a_healthcheck() -> None:
    svcs = services()
    jobs = {
        dep
        for svc in svcs.values()
        for dep, cond in depends_on(svc).items()
        if cond == "service_completed_successfully"
    }
    for name, svc in svcs.items():
        if name in jobs:
            # A one-shot job (model-fetch) is waited on for its exit, not its health; it must not restart.
            assert svc.get("restart", "no") == "no", name
            continue
        assert "healthcheck" in svc, f"{name} has no healthcheck"
        words = healthcheck_words(svc)
        assert words[0] in ("CMD", "CMD-SHELL") and len(words) > 1, f"{name}: {words}"
        assert not svc["healthcheck"].get("disable"), name
    assert "redis-cli ping" in " ".join(healthcheck_words(svcs["redis"]))


def test_every_engine_and_gateway_health_check_probes_health_on_its_port() -> None:
    for name, svc in {**engines(), **{g: services()[g] for g in GATEWAYS}}.items():
        port = "8000" if name in GATEWAYS else engine_port(svc)
        assert f"127.0.0.1:{port}/health" in " ".join(healthcheck_words(svc)), name


@pytest.mark.parametrize("name", sorted(GATEWAYS))
def test_gateways_publish_8000_and_wait_for_redis_and_their_replicas(name: str) -> None:
    svc = services()[name]
    published = [interpolate(str(port)) for port in svc["ports"]]
    assert any(port.rsplit(":", 1)[-1] == "8000" for port in published), published
    deps = depends_on(svc)
    assert deps.get("redis") == "service_healthy"
    replicas = {n for n, e in engines().items() if engine_kind(e) == GATEWAYS[name]}
    assert len(replicas) == 2
    for replica in replicas:
        assert deps.get(replica) in ("service_healthy", "service_started"), f"{name} does not wait for {replica}"
    assert set(profile_of(svc)) >= {p for r in replicas for p in profile_of(services()[r])}


def test_the_gateway_is_built_from_the_repository_root_with_the_dockerfile() -> None:
    for name in GATEWAYS:
        build = services()[name]["build"]
        context = (DOCKER / build["context"]).resolve()
        assert context == ROOT, name
        assert (context / build["dockerfile"]).resolve() == DOCKERFILE


def test_the_admin_token_comes_from_a_required_variable_never_a_literal() -> None:
    for name in GATEWAYS:
        value = environment(services()[name])["RG_SERVER__ADMIN_TOKEN"]
        assert re.fullmatch(r"\$\{[A-Za-z_][A-Za-z0-9_]*:\?[^}]+\}", value), f"{name}: {value!r}"
        with pytest.raises(KeyError):
            interpolate(value)


def test_engines_each_reserve_their_own_gpu() -> None:
    ids = {name: gpu_device_ids(svc) for name, svc in engines().items()}
    assert {"vllm-0", "vllm-1", "sglang-0", "sglang-1"} <= ids.keys()
    for name, device_ids in ids.items():
        assert len(device_ids) == 1, f"{name}: one GPU per replica, got {device_ids}"
    every = [i for device_ids in ids.values() for i in device_ids]
    assert len(every) == len(set(every)), f"engines share a GPU: {ids}"


def test_vllm_replicas_run_in_dev_mode_with_routed_experts() -> None:
    for name, svc in engines().items():
        words = command(svc)
        assert "--enable-return-routed-experts" in words, name
        if engine_kind(svc) == "vllm":
            assert environment(svc)["VLLM_SERVER_DEV_MODE"] == "1", name
            assert words[:2] == ["vllm", "serve"], words
            assert "--enable-scale-out" in words, name
        else:
            assert words[:3] == ["python3", "-m", "sglang.launch_server"], words
        assert "--host=0.0.0.0" in words, name


def test_engines_and_gateways_agree_on_the_model() -> None:
    gateway_env = {
        key: interpolate(value, {"GATEWAY_ADMIN_TOKEN": "t"})
        for key, value in environment(services()["gateway"]).items()
    }
    fetched = interpolate(environment(services()["model-fetch"])["MODEL"])
    for name, svc in engines().items():
        assert engine_model(svc) == fetched, f"{name} serves another model than model-fetch downloads"
        assert flag(svc, "--served-model-name") == gateway_env["RG_MODEL__NAME"], name
        length = flag(svc, "--max-model-len" if engine_kind(svc) == "vllm" else "--context-length")
        assert length == gateway_env["RG_MODEL__MAX_MODEL_LEN"], name


def test_engines_share_the_model_cache_and_see_the_checkpoints_read_only() -> None:
    for name, svc in engines().items():
        mounts = {target: (source, ro) for source, target, ro in volume_mounts(svc)}
        assert mounts["/root/.cache/huggingface"][0] == "hf-cache", name
        assert mounts["/checkpoints"][1], f"{name}: checkpoints must be read-only"
        assert "shm_size" in svc or svc.get("ipc") == "host", name
        assert depends_on(svc).get("model-fetch") == "service_completed_successfully", name


def test_named_volumes_are_declared_and_bind_mounts_exist() -> None:
    declared = set(compose().get("volumes") or {})
    used = set()
    for name, svc in services().items():
        for source, _target, _ro in volume_mounts(svc):
            if is_bind(source):
                if source.startswith("./checkpoints"):
                    continue  # created on the host by the operator (docker/README.md)
                assert (DOCKER / source).resolve().exists(), f"{name}: {source} does not exist"
            else:
                assert source in declared, f"{name} uses the undeclared volume {source!r}"
                used.add(source)
    assert used == declared, f"declared but unused: {declared - used}"
    assert {"redis-data", "hf-cache", "tokenizer"} <= declared


def test_redis_keeps_an_append_only_file_on_a_volume() -> None:
    redis = services()["redis"]
    assert redis["image"].startswith("redis:")
    words = command(redis)
    assert words[words.index("--appendonly") + 1] == "yes"
    assert ("redis-data", "/data") in {(s, t) for s, t, _ in volume_mounts(redis)}


@pytest.fixture
def rg_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No RG_* variable of the machine running the tests leaks into `load_config`."""
    for variable in [v for v in os.environ if v.upper().startswith("RG_")]:
        monkeypatch.delenv(variable)
    return monkeypatch


@pytest.mark.parametrize("name", sorted(GATEWAYS))
def test_the_mounted_config_loads_and_names_the_compose_services(name: str, rg_env: pytest.MonkeyPatch) -> None:
    svc = services()[name]
    mounts = {target: (source, ro) for source, target, ro in volume_mounts(svc)}
    assert mounts[CONFIG_TARGET][1], "the config is mounted read-only"
    env = {"GATEWAY_ADMIN_TOKEN": "test-token"}
    for key, value in environment(svc).items():
        rg_env.setenv(key, interpolate(value, env))

    settings = load_config(mounted_config(svc))

    assert settings.server.admin_token.get_secret_value() == "test-token"
    assert (settings.server.host, settings.server.port) == ("0.0.0.0", 8000)
    assert urlsplit(settings.redis.url).hostname == "redis"
    assert str(settings.model.tokenizer) in mounts, "the tokenizer folder is a mount of the gateway"
    assert settings.model.name == "policy"
    kind = GATEWAYS[name]
    replicas = {n: e for n, e in engines().items() if engine_kind(e) == kind}
    by_host = {urlsplit(r.url).hostname: r for r in settings.replicas}
    assert by_host.keys() == replicas.keys()
    for host, replica in by_host.items():
        assert replica.backend == kind
        assert str(urlsplit(replica.url).port) == engine_port(replicas[host])
        assert replica.routed_experts


def test_the_two_gateways_keep_their_data_apart(rg_env: pytest.MonkeyPatch) -> None:
    configs = {name: mounted_config(services()[name]) for name in GATEWAYS}
    urls = {name: load_config(path).redis.url for name, path in configs.items()}
    assert len(set(configs.values())) == len(set(urls.values())) == len(GATEWAYS), urls


def test_the_gateway_container_is_hardened() -> None:
    gateway = services()["gateway"]
    assert gateway["read_only"] is True
    assert "ALL" in gateway["cap_drop"]
    assert "user" not in gateway, "the gateway runs as the image's non-root user"


# ---------------------------------------------------------------------------------------------------------------
# Dockerfile
# ---------------------------------------------------------------------------------------------------------------


def test_the_image_is_multi_stage_and_ends_on_python_slim() -> None:
    froms = [args for keyword, args in dockerfile_instructions() if keyword == "FROM"]
    assert len(froms) >= 2, "the wheels are built in a separate stage"
    assert froms[-1].split()[0] == "python:3.11-slim"
    stage = final_stage()
    installs = " ".join(args for keyword, args in stage if keyword == "RUN")
    assert not re.search(r"\b(gcc|g\+\+|build-essential|clang|make)\b", installs), "no compilers in the final image"
    assert "--no-index" in installs and "/wheels" in installs, "the final stage installs the built wheels only"
    assert "venv" in installs


def test_the_image_runs_as_a_fixed_non_root_user() -> None:
    users = [args for keyword, args in final_stage() if keyword == "USER"]
    assert users, "no USER in the final stage"
    user = users[-1].split(":")[0]
    assert user.isdigit() and int(user) >= 1000, f"a fixed, non-root numeric uid, got {users[-1]!r}"


def test_the_entrypoint_is_the_cli_and_the_command_serves_the_mounted_config() -> None:
    stage = dict(final_stage())
    assert exec_form(stage["ENTRYPOINT"]) == ["rollout-gateway"]
    cmd = exec_form(stage["CMD"])
    assert cmd[0] == "serve" and cmd[cmd.index("--config") + 1] == CONFIG_TARGET
    assert stage["STOPSIGNAL"] == "SIGTERM"
    assert "8000" in stage["EXPOSE"].split()
    assert re.search(r"\bPYTHONUNBUFFERED=1\b", " ".join(a for k, a in final_stage() if k == "ENV"))


def test_the_image_healthcheck_probes_health_with_python() -> None:
    health = dict(final_stage())["HEALTHCHECK"]
    assert "CMD" in health and "/health" in health and "urllib" in health
    assert "curl" not in health, "slim has no curl"


def test_the_entrypoint_is_a_console_script_of_the_project() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, func = scripts["rollout-gateway"].partition(":")
    path = ROOT / module.replace(".", "/")
    source = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    assert source.is_file(), f"{module} is not a module of the project"
    assert f"def {func}(" in source.read_text()
    copies = [args for keyword, args in dockerfile_instructions() if keyword == "COPY" and "--from" not in args]
    copied = {args.split()[0] for args in copies}
    assert module.split(".")[0] in copied, "the image's entrypoint is built from a package the Dockerfile copies"


def test_the_build_context_filter_keeps_what_the_dockerfile_copies() -> None:
    patterns = [
        line.strip()
        for line in (DOCKER / "Dockerfile.dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert patterns[0] == "*", "an allowlist: everything else stays out of the context"
    allowed = {p[1:] for p in patterns if p.startswith("!")}
    for keyword, args in dockerfile_instructions():
        if keyword == "COPY" and "--from" not in args:
            sources = [word for word in args.split()[:-1] if not word.startswith("--")]
            for source in sources:
                assert source in allowed, f"COPY {source} is filtered out of the build context"
                assert (ROOT / source).exists(), source


# ---------------------------------------------------------------------------------------------------------------
# Grafana dashboard and Prometheus
# ---------------------------------------------------------------------------------------------------------------


def test_the_dashboard_is_a_grafana_dashboard_with_a_prometheus_input() -> None:
    board = dashboard()
    assert board["uid"] and board["title"]
    assert 36 <= board["schemaVersion"] <= 41
    assert [i["name"] for i in board["__inputs"]] == ["DS_PROMETHEUS"]
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"


def test_panels_have_unique_ids_and_use_the_prometheus_input() -> None:
    panels = list(all_panels(dashboard()["panels"]))
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    for panel in panels:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, panel["title"]


def test_every_query_selects_only_gateway_metrics_and_every_metric_is_shown() -> None:
    board = dashboard()
    exprs = [t["expr"] for p in all_panels(board["panels"]) for t in p.get("targets", [])]
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":  # label_values(selector, label): the label is not a metric
            selector = re.fullmatch(r"label_values\((.+),\s*\w+\)", variable["definition"])
            assert selector, variable["definition"]
            exprs.append(selector[1])
    shown: set[str] = set()
    for expr in exprs:
        names = {base_metric(name) for name in promql_metric_names(expr)}
        assert names, f"no metric in {expr!r}"
        assert names <= METRICS, f"unknown metrics {names - METRICS} in {expr!r}"
        shown |= names
    assert shown == METRICS, f"not on the dashboard: {METRICS - shown}"


def test_the_dashboard_metrics_are_the_ones_the_gateway_exports() -> None:
    import gateway.metrics

    contract = gateway.metrics.__doc__ or ""
    missing = {name for name in METRICS if f"`{name}`" not in contract}
    assert not missing, f"gateway/metrics.py does not export {missing}"


def test_prometheus_scrapes_the_gateways() -> None:
    config = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    gateway = jobs["rollout-gateway"]
    assert gateway.get("metrics_path", "/metrics") == "/metrics"
    targets = {t for group in gateway["static_configs"] for t in group["targets"]}
    assert {f"{name}:8000" for name in GATEWAYS} <= targets
    for name in targets | {t for job in jobs.values() for g in job["static_configs"] for t in g["targets"]}:
        assert name.split(":")[0] in services(), f"{name} is not a compose service"


# ---------------------------------------------------------------------------------------------------------------
# Profile haproxy and docker/haproxy/haproxy.cfg (tests/chaos/test_load_balancer.py runs the same file)
# ---------------------------------------------------------------------------------------------------------------

BALANCED = ("gateway", "gateway-2", "gateway-3")


def haproxy_directives(section: str) -> list[str]:
    """The directives of one section of haproxy.cfg (`backend gateways`, ...), comments and indentation removed."""
    raw = HAPROXY_CONFIG.read_text().splitlines()
    lines = [line.split("#", 1)[0].strip() for line in raw]
    start = lines.index(section) + 1
    # A section ends where the next one starts: the next line that is not indented and not blank.
    end = next((i for i in range(start, len(raw)) if lines[i] and not raw[i][0].isspace()), len(raw))
    return [line for line in lines[start:end] if line]


def haproxy_seconds(value: str) -> float:
    """An HAProxy time (`3s`, `11m`, `1h`; a bare number is milliseconds) in seconds."""
    match = re.fullmatch(r"(\d+)(ms|s|m|h)?", value)
    assert match, value
    return int(match[1]) * {"ms": 0.001, "s": 1, None: 0.001, "m": 60, "h": 3600}[match[2]]


def test_the_balanced_gateways_are_copies_of_gateway_on_its_config_and_replicas() -> None:
    svcs = services()
    gateway = svcs["gateway"]
    for name in BALANCED[1:]:
        svc = svcs[name]
        assert profile_of(svc) == ("haproxy",)
        assert mounted_config(svc) == mounted_config(gateway)  # the same Redis and replicas
        assert depends_on(svc) == depends_on(gateway)
        assert "ports" not in svc, f"{name} is reached through HAProxy only"
        assert svc["healthcheck"] == gateway["healthcheck"] and svc["image"] == gateway["image"]


def test_haproxy_runs_the_shipped_config_in_front_of_the_three_gateways() -> None:
    svc = services()["haproxy"]
    assert profile_of(svc) == ("haproxy",)
    mounts = {target: (source, ro) for source, target, ro in volume_mounts(svc)}
    source, ro = mounts["/usr/local/etc/haproxy/haproxy.cfg"]
    assert ro and (DOCKER / source).resolve() == HAPROXY_CONFIG
    env = environment(svc)
    assert [env[f"GATEWAY_{i}"] for i in (1, 2, 3)] == [f"{name}:8000" for name in BALANCED]
    assert {dep: depends_on(svc)[dep] for dep in BALANCED} == dict.fromkeys(BALANCED, "service_healthy")
    published = [interpolate(str(port)) for port in svc["ports"]]
    assert any(port.endswith(":" + env["HAPROXY_BIND"].rsplit(":", 1)[-1]) for port in published), published


def test_haproxy_balances_round_robin_checks_ready_and_outlasts_a_generation() -> None:
    backend = haproxy_directives("backend gateways")
    assert "balance roundrobin" in backend and "option httpchk GET /ready" in backend
    servers = [line.split() for line in backend if line.startswith("server ")]
    assert [words[2] for words in servers] == [f'"${{GATEWAY_{i}-gateway-{i}:8000}}"' for i in (1, 2, 3)]
    alive = haproxy_directives("backend gateways-alive")
    assert [line for line in alive if line.startswith("server ")] == [
        line for line in backend if line.startswith("server ")
    ]
    defaults = dict(line.split(None, 2)[1:] for line in haproxy_directives("defaults") if line.startswith("timeout "))
    generation = load_config(ROOT / "config.yaml").generation
    # A non-streamed answer may wait for an update, then take a whole generation before its first byte.
    longest = generation.request_timeout_s + generation.max_wait_s
    assert haproxy_seconds(defaults["server"]) >= longest and haproxy_seconds(defaults["client"]) >= longest
    assert haproxy_seconds(defaults["tunnel"]) >= longest


@pytest.mark.skipif(shutil.which("haproxy") is None, reason="haproxy is not on PATH (Debian: apt-get install haproxy)")
def test_haproxy_accepts_the_config_with_the_compose_environment() -> None:
    env = {**os.environ, **environment(services()["haproxy"])}  # -c binds nothing
    checked = subprocess.run(
        ["haproxy", "-c", "-f", str(HAPROXY_CONFIG)], env=env, capture_output=True, text=True, timeout=30
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    # The compose names do not resolve here: those warnings only (init-addr none starts without them).
    warnings = [line for line in checked.stderr.splitlines() if "[WARNING]" in line]
    assert all("could not resolve address" in line for line in warnings), warnings
