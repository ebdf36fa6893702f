"""deploy/kubernetes/: valid objects, consistent with each other and with kvroute's own parsers (no
cluster here to apply them to).

* Kubernetes' own kinds validate strictly against the Kubernetes API's schemas (kubernetes-validate,
  offline); the Gateway API and Inference Extension objects against the fields of their v1 APIs
  that these manifests use (``POOL`` and ``ROUTE`` below, written from the published API reference);
* every kvroute container's command and environment build its settings as the CLI would;
* kvroute's pods run as non-root with read-only root filesystems, no privilege escalation, every
  capability dropped, requests and limits set, probes on;
* the pool selects the vLLM pods, targets their port and names the picker's Service and port; the
  picker's probes ask the gRPC health services it serves; the route's backend is the pool.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from kvroute.cli import build_parser
from router.epp.settings import settings_from_args as epp_settings
from router.settings import settings_from_args as router_settings
from tests.support import ROOT
from worker_agent.settings import settings_from_args as agent_settings

DEPLOY = ROOT / "deploy" / "kubernetes"
KUBERNETES = kubernetes_validate.latest_version()
OBJECTS = [
    (path.name, document)
    for path in sorted(DEPLOY.glob("*.yaml"))
    if path.name != "kustomization.yaml"
    for document in yaml.safe_load_all(path.read_text())
    if document
]
# The Inference Extension's InferencePool, inference.networking.k8s.io/v1: the fields used here.
POOL = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "inference.networking.k8s.io/v1"},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "targetPorts", "endpointPickerRef"],
            "properties": {
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["matchLabels"],
                    "properties": {"matchLabels": {"type": "object", "additionalProperties": {"type": "string"}}},
                },
                "targetPorts": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["number"],
                        "properties": {"number": {"type": "integer", "minimum": 1, "maximum": 65535}},
                    },
                },
                "endpointPickerRef": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["name", "port"],
                    "properties": {
                        "group": {"type": "string"},
                        "kind": {"const": "Service"},
                        "name": {"type": "string", "minLength": 1},
                        "port": {
                            "type": "object",
                            "required": ["number"],
                            "properties": {"number": {"type": "integer", "minimum": 1, "maximum": 65535}},
                        },
                        "failureMode": {"enum": ["FailOpen", "FailClose"]},
                    },
                },
            },
        },
    },
}
# The Gateway API's HTTPRoute, gateway.networking.k8s.io/v1: the fields used here.
ROUTE = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "gateway.networking.k8s.io/v1"},
        "spec": {
            "type": "object",
            "required": ["parentRefs", "rules"],
            "properties": {
                "parentRefs": {"type": "array", "minItems": 1, "items": {"required": ["name"]}},
                "rules": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "matches": {"type": "array"},
                            "backendRefs": {
                                "type": "array",
                                "items": {"type": "object", "required": ["name"], "additionalProperties": False,
                                          "properties": {"group": {"type": "string"}, "kind": {"type": "string"},
                                                         "name": {"type": "string"}, "port": {"type": "integer"},
                                                         "weight": {"type": "integer"}}},
                            },
                            "timeouts": {"type": "object", "additionalProperties": False,
                                         "properties": {"request": {"type": "string"},
                                                        "backendRequest": {"type": "string"}}},
                        },
                    },
                },
            },
        },
    },
}  # fmt: skip
CUSTOM = {"InferencePool": POOL, "HTTPRoute": ROUTE}


def _named(kind: str, name: str | None = None) -> dict[str, Any]:
    return next(d for _, d in OBJECTS if d["kind"] == kind and (name is None or d["metadata"]["name"] == name))


def _kvroute_containers() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for _, document in OBJECTS:
        pod = document.get("spec", {}).get("template", {}).get("spec")
        for container in (pod or {}).get("containers", []) + (pod or {}).get("initContainers", []):
            if container["image"] == "kvroute":
                found.append((f"{document['metadata']['name']}/{container['name']}", container))
    return found


@pytest.mark.parametrize(("path", "document"), OBJECTS, ids=[f"{p}:{d['kind']}" for p, d in OBJECTS])
def test_every_object_validates(path, document):
    schema = CUSTOM.get(document["kind"])
    if schema is not None:
        jsonschema.validate(document, schema)
    elif document["kind"] == "ServiceMonitor":
        assert document["apiVersion"] == "monitoring.coreos.com/v1" and document["spec"]["endpoints"]
    else:
        kubernetes_validate.validate(document, KUBERNETES, strict=True)


def test_the_validation_can_fail():
    deployment = copy.deepcopy(_named("Deployment", "kvroute-epp"))
    deployment["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES, strict=True)
    pool = copy.deepcopy(_named("InferencePool"))
    pool["spec"]["targetPortNumber"] = 8000  # the alpha API's field, gone in v1
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(pool, POOL)


def test_the_kustomization_lists_every_file():
    listed = set(yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())["resources"])
    assert listed == {p.name for p in DEPLOY.glob("*.yaml")} - {"kustomization.yaml"}


@pytest.mark.parametrize(("name", "container"), _kvroute_containers(), ids=[n for n, _ in _kvroute_containers()])
def test_every_kvroute_command_builds_its_settings(name, container, tmp_path):
    env = {}
    for variable in container.get("env", []):
        value = variable.get("value", "10.1.2.3" if variable["name"] == "POD_IP" else "a-pod")
        if variable["name"].endswith("_FILE"):
            path = tmp_path / variable["name"]
            path.write_text("a-secret\n")
            value = str(path)
        env[variable["name"]] = value
    words = [*container.get("command", []), *container.get("args", [])]
    if words[:2] == ["sh", "-ec"]:
        assert "kvroute redis acl --aclfile" in words[2]
        return
    words = [w.replace("$(POD_IP)", env.get("POD_IP", "")) for w in words]
    args = build_parser().parse_args(words[1:])
    settings = {"router": router_settings, "epp": epp_settings, "agent": agent_settings}[args.command](args, env)
    if args.command == "epp":
        assert settings.grpc_port == 9002 and settings.router.redis.url.startswith("redis://router@")
    if args.command == "agent":
        assert settings.engine_root == "http://10.1.2.3:8000"  # the pod's IP: what the picker names


@pytest.mark.parametrize(("name", "container"), _kvroute_containers(), ids=[n for n, _ in _kvroute_containers()])
def test_kvroute_runs_locked_down(name, container):
    document = next(
        d for _, d in OBJECTS if d["metadata"]["name"] == name.split("/")[0] and "template" in d.get("spec", {})
    )
    pod = document["spec"]["template"]["spec"]
    context = {**pod.get("securityContext", {}), **container.get("securityContext", {})}
    assert context["runAsNonRoot"] is True and context["readOnlyRootFilesystem"] is True
    assert context["allowPrivilegeEscalation"] is False and context["capabilities"] == {"drop": ["ALL"]}
    assert context.get("seccompProfile") == {"type": "RuntimeDefault"}
    assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]
    assert pod.get("automountServiceAccountToken") is False
    if "initContainers" not in pod or container not in pod["initContainers"]:
        assert "livenessProbe" in container


def test_the_pool_the_picker_and_the_model_servers_agree():
    pool, route = _named("InferencePool"), _named("HTTPRoute")
    vllm = _named("Deployment", "vllm-qwen")
    labels = vllm["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    ports = [p["containerPort"] for c in vllm["spec"]["template"]["spec"]["containers"] for p in c["ports"]]
    assert pool["spec"]["targetPorts"][0]["number"] in ports
    picker = pool["spec"]["endpointPickerRef"]
    service = _named("Service", picker["name"])
    grpc = next(p for p in service["spec"]["ports"] if p["port"] == picker["port"]["number"])
    assert grpc["appProtocol"] == "http2"
    epp = _named("Deployment", picker["name"])
    (container,) = epp["spec"]["template"]["spec"]["containers"]
    served = int(container["args"][container["args"].index("--grpc-port") + 1])
    assert next(p["containerPort"] for p in container["ports"] if p["name"] == grpc["targetPort"]) == served
    assert container["readinessProbe"]["grpc"] == {"port": served, "service": "readiness"}
    assert container["livenessProbe"]["grpc"] == {"port": served, "service": "liveness"}
    assert route["spec"]["rules"][0]["backendRefs"][0] == {
        "group": "inference.networking.k8s.io",
        "kind": "InferencePool",
        "name": pool["metadata"]["name"],
    }


def test_only_kvroutes_pods_reach_redis():
    policy = _named("NetworkPolicy", "kvroute-redis")
    allowed = [peer["podSelector"]["matchLabels"] for peer in policy["spec"]["ingress"][0]["from"]]
    assert {"app.kubernetes.io/name": "kvroute-router"} in allowed and {
        "app.kubernetes.io/name": "kvroute-epp"
    } in allowed
    assert len(allowed) == 3  # and the model servers' agents


def test_the_deploy_directory_is_what_the_docs_name():
    docs = (ROOT / "docs" / "kubernetes.md").read_text()
    for path in DEPLOY.glob("*.yaml"):
        assert f"deploy/kubernetes/{path.name}" in docs, path.name
    assert Path(DEPLOY / "kustomization.yaml").exists()
