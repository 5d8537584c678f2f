"""docker/kubernetes/: the manifests checked offline (no cluster runs where these tests run). Each object is valid
against the Kubernetes schema (the schemas `kubernetes-validate` ships), the gateway's config loads with its own
loader, and names, labels, ports and probes agree with each other and with the gateway."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from gateway.config import load_config
from tests import REPO

KUBERNETES = REPO / "docker" / "kubernetes"
SCHEMA_VERSION = "1.33.0"


@cache
def objects() -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())
    found: list[dict[str, Any]] = []
    for name in kustomization["resources"]:
        found += [d for d in yaml.safe_load_all((KUBERNETES / name).read_text()) if d is not None]
    return found


def one(kind: str, name: str) -> dict[str, Any]:
    matches = [o for o in objects() if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, (kind, name)
    return matches[0]


def container(workload: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in workload["spec"]["template"]["spec"]["containers"] if c["name"] == name)


def port_number(container: dict[str, Any], port: int | str) -> int:
    """A probe's or a Service's port, by number or by the container port's name."""
    if isinstance(port, int):
        return port
    return next(p["containerPort"] for p in container["ports"] if p["name"] == port)


def gateway_config(tmp_path: Path) -> Any:
    path = tmp_path / "config.yaml"
    path.write_text(one("ConfigMap", "rollout-gateway-config")["data"]["config.yaml"])
    return load_config(path)


def test_the_kustomization_lists_every_manifest() -> None:
    listed = set(yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())["resources"])
    assert listed == {p.name for p in KUBERNETES.glob("*.yaml")} - {"kustomization.yaml"}


@pytest.mark.parametrize("index", range(len(objects())))
def test_each_object_is_valid_against_the_kubernetes_schema(index: int) -> None:
    kubernetes_validate.validate(objects()[index], SCHEMA_VERSION, strict=True)


def test_the_gateways_config_loads_and_follows_the_engines_headless_service(tmp_path: Path) -> None:
    settings = gateway_config(tmp_path)
    assert settings.replicas == () and settings.replicas_from is not None
    source = urlsplit(settings.replicas_from)
    engines = one("Service", "vllm-engines")
    assert source.scheme == "dns" and source.hostname == engines["metadata"]["name"]
    assert engines["spec"]["clusterIP"] == "None" and not engines["spec"]["publishNotReadyAddresses"]
    assert source.port == engines["spec"]["ports"][0]["port"]
    statefulset = one("StatefulSet", "vllm-engine")
    vllm = container(statefulset, "vllm")
    assert port_number(vllm, engines["spec"]["ports"][0]["targetPort"]) == source.port
    assert engines["spec"]["selector"].items() <= statefulset["spec"]["template"]["metadata"]["labels"].items()
    # What the template says of each discovered replica, the engine's flags must provide.
    replica = settings.discovery.replica
    assert replica.backend == "vllm"
    assert replica.routed_experts == ("--enable-return-routed-experts" in vllm["args"])
    assert replica.scale_out == ("--enable-scale-out" in vllm["args"])
    assert {"name": "VLLM_SERVER_DEV_MODE", "value": "1"} in vllm["env"]
    served = next(a for a in vllm["args"] if a.startswith("--served-model-name="))
    assert served.split("=", 1)[1] == settings.model.name


def test_the_gateway_pods_are_probed_on_its_port_and_run_its_config(tmp_path: Path) -> None:
    settings = gateway_config(tmp_path)
    deployment = one("Deployment", "rollout-gateway")
    gateway = container(deployment, "gateway")
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert gateway["livenessProbe"]["httpGet"]["path"] == "/health"
    for probe in ("readinessProbe", "livenessProbe"):
        assert port_number(gateway, gateway[probe]["httpGet"]["port"]) == settings.server.port
    config_path = gateway["args"][gateway["args"].index("--config") + 1]
    mount = next(m for m in gateway["volumeMounts"] if m["name"] == "config")
    assert Path(config_path).parent == Path(mount["mountPath"])
    volume = next(v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "config")
    assert volume["configMap"]["name"] == "rollout-gateway-config"
    assert gateway["args"][0] == "serve"  # the image's entrypoint is the CLI (docker/Dockerfile)
    assert 'ENTRYPOINT ["rollout-gateway"]' in (REPO / "docker" / "Dockerfile").read_text()
    tokenizer = next(m for m in gateway["volumeMounts"] if m["name"] == "tokenizer")
    assert Path(tokenizer["mountPath"]) == settings.model.tokenizer
    # The grace period leaves room for the gateway's own drain.
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > settings.server.shutdown_timeout_s
    # Off loopback, the default admin token is refused: the token comes from the Secret.
    env = {e["name"]: e for e in gateway["env"]}
    assert settings.server.host == "0.0.0.0" and "RG_SERVER__ADMIN_TOKEN" in env
    assert "RG_REDIS__URL" in env  # several pods share one Redis, never an embedded one each


def test_service_budget_and_autoscaler_select_the_gateway_pods() -> None:
    deployment = one("Deployment", "rollout-gateway")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    service = one("Service", "rollout-gateway")
    assert service["spec"]["selector"].items() <= labels.items()
    assert port_number(container(deployment, "gateway"), service["spec"]["ports"][0]["targetPort"]) == 8000
    budget = one("PodDisruptionBudget", "rollout-gateway")
    assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items()
    target = one("HorizontalPodAutoscaler", "rollout-gateway")["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", "rollout-gateway")
    # A CPU target needs a CPU request to be a percentage of.
    assert container(deployment, "gateway")["resources"]["requests"]["cpu"]


def test_every_secret_and_configmap_the_pods_need_is_made_by_the_readme() -> None:
    readme = (KUBERNETES / "README.md").read_text()
    made = set(re.findall(r"create (?:secret generic|configmap) ([\w-]+)", readme))
    keys = set(re.findall(r"--from-literal=([\w-]+)=", readme))
    defined = {o["metadata"]["name"] for o in objects() if o["kind"] == "ConfigMap"}
    deployment = one("Deployment", "rollout-gateway")
    for env in container(deployment, "gateway")["env"]:
        ref = env["valueFrom"]["secretKeyRef"]
        assert ref["name"] in made and ref["key"] in keys, ref
    for volume in deployment["spec"]["template"]["spec"]["volumes"]:
        if "configMap" in volume:
            assert volume["configMap"]["name"] in made | defined, volume
