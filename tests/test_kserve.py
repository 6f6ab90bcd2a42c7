"""docker/kserve: the ServingRuntime and the InferenceService example, validated against KServe's own
CRDs (docker/crds/kserve, pinned, turned into strict JSON Schemas by docker/crds/crd_to_json_schema.py),
broken variants refused, and what no schema sees: the runtime runs ``kimi-prep serve`` on KServe's
v2 ports with the repository KServe downloads, and the example picks this runtime. The predictor pod
KServe builds from the two passes every control of the Pod Security Standard ``restricted``
(tests/pod_security.py), and networkpolicy.yaml selects that pod and admits what docs/serving.md says.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from k8s_manifests import (
    CHART,
    CRDS,
    check_jsonschema,
    crd_schema,
    documents,
    kubernetes_validate,
    quantity,
    render_chart,
    supported_minors,
)
from pod_security import BREAKERS, pod_security_errors

from kimi_vision_client.cli import build_parser
from kimi_vision_server.cli.commands import cmd_serve

REPO = Path(__file__).resolve().parents[1]
KSERVE = REPO / "docker" / "kserve"
RUNTIME, SERVICE = KSERVE / "servingruntime.yaml", KSERVE / "inferenceservice.yaml"
POLICY = KSERVE / "networkpolicy.yaml"
CRD_FILES = {
    "ServingRuntime": "serving.kserve.io_servingruntimes.yaml",
    "InferenceService": "serving.kserve.io_inferenceservices.yaml",
}
KSERVE_V2_PORTS = {"http": 8080, "grpc": 9000}  # where KServe's ingress and its v2 runtimes expect them
STORAGE_MOUNT = "/mnt/models"  # KServe's storage initializer downloads storageUri here
# The labels KServe puts on an InferenceService's predictor pods (v0.20.0,
# pkg/controller/v1beta1/inferenceservice/components/predictor.go, buildObjectMeta), and the volume
# it mounts a pvc:// storageUri from (constants.PvcSourceMountName; no init container for a PVC).
PREDICTOR_LABELS = {"serving.kserve.io/inferenceservice": "{name}", "component": "predictor"}
PVC_VOLUME = "kserve-pvc-source"
COMPONENT_FIELDS = ("model", "minReplicas", "maxReplicas")  # the predictor's keys that are not PodSpec fields


@pytest.fixture(scope="module")
def schemas(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("kserve-schemas")
    return {kind: crd_schema(CRDS / "kserve" / name, out / f"{kind}.json") for kind, name in CRD_FILES.items()}


def load(path: Path) -> dict[str, Any]:
    (doc,) = [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    return doc


def runtime_container() -> dict[str, Any]:
    (container,) = load(RUNTIME)["spec"]["containers"]
    return container


@pytest.mark.parametrize("path", [RUNTIME, SERVICE], ids=lambda p: p.name)
def test_kserve_resource_is_valid_against_kserves_crd(path: Path, schemas: dict[str, Path]) -> None:
    done = check_jsonschema(schemas[load(path)["kind"]], path)
    assert done.returncode == 0, done.stdout + done.stderr


def set_at(path: tuple[str | int, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def change(doc: dict[str, Any]) -> None:
        for key in path[:-1]:
            doc = doc[key]
        doc[path[-1]] = value

    return change


def drop(path: tuple[str | int, ...]) -> Callable[[dict[str, Any]], None]:
    def change(doc: dict[str, Any]) -> None:
        for key in path[:-1]:
            doc = doc[key]
        del doc[path[-1]]

    return change


BROKEN: dict[str, tuple[Path, Callable[[dict[str, Any]], None]]] = {
    "runtime without containers": (RUNTIME, drop(("spec", "containers"))),
    "runtime port as a string": (RUNTIME, set_at(("spec", "containers", 0, "ports", 0, "containerPort"), "9000")),
    "runtime unknown field": (RUNTIME, set_at(("spec", "protocolVersion"), "v2")),
    "runtime old apiVersion": (RUNTIME, set_at(("apiVersion",), "serving.kserve.io/v1beta1")),
    "service without predictor": (SERVICE, drop(("spec", "predictor"))),
    "service replicas as words": (SERVICE, set_at(("spec", "predictor", "minReplicas"), "two")),
    "service misspelt storageUri": (SERVICE, set_at(("spec", "predictor", "model", "storageURI"), "pvc://x/y")),
    "service format without name": (SERVICE, drop(("spec", "predictor", "model", "modelFormat", "name"))),
    "service upper-case name": (SERVICE, set_at(("metadata", "name"), "Kimi")),
}


def test_kserve_schemas_refuse_every_broken_variant(schemas: dict[str, Path], tmp_path: Path) -> None:
    """Each variant alone, all in one check-jsonschema run per kind: every file is named in its errors."""
    files: dict[str, list[Path]] = {}
    for number, (source, change) in enumerate(BROKEN[name] for name in sorted(BROKEN)):
        doc = copy.deepcopy(load(source))
        change(doc)
        path = tmp_path / f"broken{number}.yaml"
        path.write_text(yaml.safe_dump(doc))
        files.setdefault(load(source)["kind"], []).append(path)
    for kind, paths in files.items():
        done = check_jsonschema(schemas[kind], *paths)
        assert done.returncode != 0
        output = done.stdout + done.stderr
        assert all(path.name in output for path in paths), output


def test_kserve_runtime_runs_the_launcher_on_kserves_v2_ports() -> None:
    container = runtime_container()
    assert container["command"] == ["kimi-prep"]
    args = build_parser().parse_args(container["args"])
    assert args.run.__wrapped__ is cmd_serve
    assert {"http": args.http_port, "grpc": args.grpc_port} == KSERVE_V2_PORTS
    assert str(args.model_repository) == STORAGE_MOUNT
    assert [p["containerPort"] for p in container["ports"]] == [KSERVE_V2_PORTS["grpc"]]
    for probe, path in (("startupProbe", "/readyz"), ("readinessProbe", "/readyz"), ("livenessProbe", "/livez")):
        assert container[probe]["httpGet"] == {"path": path, "port": args.probe_port}
    metrics = load(RUNTIME)["spec"]["annotations"]
    assert int(metrics["prometheus.kserve.io/port"]) == args.metrics_port
    (shm,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    (volume,) = [v for v in load(RUNTIME)["spec"]["volumes"] if v["name"] == shm["name"]]
    assert volume["emptyDir"]["medium"] == "Memory"


def test_kserve_runtime_keeps_the_security_bounds() -> None:
    container = runtime_container()
    args = build_parser().parse_args(container["args"])
    assert args.open_api == [] and args.admin_key_file is None and args.response_cache_mib is None
    env = {entry["name"]: entry for entry in container["env"]}
    assert "value" not in env["KIMI_PREP_ADMIN_KEY"] and env["KIMI_PREP_ADMIN_KEY"]["valueFrom"]["secretKeyRef"]
    context = container["securityContext"]
    assert context["runAsNonRoot"] is True and context["allowPrivilegeEscalation"] is False


def test_kserve_example_picks_this_runtime_and_its_protocol() -> None:
    runtime, service = load(RUNTIME), load(SERVICE)
    model = service["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"]
    (fmt,) = runtime["spec"]["supportedModelFormats"]
    assert model["modelFormat"] == {"name": fmt["name"], "version": fmt["version"]}
    assert fmt["autoSelect"] is False  # never chosen for someone else's Triton model
    assert model["protocolVersion"] in runtime["spec"]["protocolVersions"]
    # The probe port beside the serving port needs a plain Deployment, not Knative's one port.
    assert service["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] == "RawDeployment"


@pytest.mark.parametrize("resources", ["runtime", "service"])
def test_kserve_requests_within_limits(resources: str) -> None:
    if resources == "runtime":
        spec = runtime_container()["resources"]
    else:
        spec = load(SERVICE)["spec"]["predictor"]["model"]["resources"]
    for name in spec["requests"].keys() & spec["limits"].keys():
        assert quantity(spec["requests"][name]) <= quantity(spec["limits"][name])


def test_serving_doc_states_the_runtimes_ports_and_kserve_release() -> None:
    doc = " ".join((REPO / "docs" / "serving.md").read_text().split())
    assert f"(HTTP {KSERVE_V2_PORTS['http']}, gRPC {KSERVE_V2_PORTS['grpc']}, KServe's ports)" in doc
    release = re.search(r"tag `(v[\d.]+)`", (CRDS / "README.md").read_text())
    assert release and f"KServe's own CRDs ({release[1]}," in doc


def predictor_deployment() -> dict[str, Any]:
    """The Deployment KServe makes in RawDeployment mode for inferenceservice.yaml on this runtime:
    the runtime's pod merged with the predictor's pod fields, the model's resources on the runtime's
    container, the pvc:// storageUri mounted at /mnt/models, KServe's labels on the pod."""
    runtime, service = load(RUNTIME), load(SERVICE)
    predictor = service["spec"]["predictor"]
    (container,) = copy.deepcopy(runtime["spec"]["containers"])
    container["resources"] = predictor["model"]["resources"]
    container.setdefault("volumeMounts", []).append({"name": PVC_VOLUME, "mountPath": STORAGE_MOUNT, "readOnly": True})
    claim, _, _path = predictor["model"]["storageUri"].removeprefix("pvc://").partition("/")
    volumes = [*runtime["spec"]["volumes"], {"name": PVC_VOLUME, "persistentVolumeClaim": {"claimName": claim}}]
    pod_fields = {key: value for key, value in predictor.items() if key not in COMPONENT_FIELDS}
    labels = {key: value.format(name=service["metadata"]["name"]) for key, value in PREDICTOR_LABELS.items()}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": f"{service['metadata']['name']}-predictor", "labels": labels},
        "spec": {
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {**pod_fields, "containers": [container], "volumes": volumes},
            },
        },
    }


def test_kserve_predictor_pod_passes_the_restricted_pod_security_standard() -> None:
    pod = predictor_deployment()["spec"]["template"]
    assert pod_security_errors("predictor", pod) == []
    assert pod["spec"]["automountServiceAccountToken"] is False


@pytest.mark.parametrize("control", sorted(BREAKERS))
def test_pod_security_rule_names_its_broken_variant_of_the_predictor_pod(control: str) -> None:
    pod = predictor_deployment()["spec"]["template"]
    BREAKERS[control](pod)
    assert any(error.startswith(f"predictor: {control}: ") for error in pod_security_errors("predictor", pod))


@pytest.mark.parametrize("kube_version", supported_minors())
def test_kserve_networkpolicy_and_predictor_are_valid_for_each_supported_kubernetes(
    kube_version: str, tmp_path: Path
) -> None:
    manifest = tmp_path / "kserve.yaml"
    manifest.write_text(POLICY.read_text() + "---\n" + yaml.safe_dump(predictor_deployment()))
    status, passed, output = kubernetes_validate(manifest, kube_version)
    assert status == 0 and passed == {"networkpolicy", "deployment"}, output


def admitted(policy: dict[str, Any], pod_labels: dict[str, str]) -> dict[str, set[int]]:
    """What ``policy`` admits to a pod labelled ``pod_labels``: ``{source: ports}``, a source being
    ``pods <label>=<value>`` or ``namespace <name>`` (``*``: every one); {} where it selects no such pod."""
    if not policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items():
        return {}
    sources: dict[str, set[int]] = {}
    for rule in policy["spec"]["ingress"]:
        for peer in rule["from"]:
            if "podSelector" in peer:
                source = " ".join(f"pods {k}={v}" for k, v in peer["podSelector"]["matchLabels"].items())
            else:
                namespace = peer["namespaceSelector"].get("matchLabels", {}).get("kubernetes.io/metadata.name", "*")
                source = f"namespace {namespace}"
            sources.setdefault(source, set()).update(port["port"] for port in rule["ports"])
    return sources


def expected_sources() -> dict[str, set[int]]:
    """Inference from the Helm chart's client label, metrics and probes from its monitoring namespace,
    on the ports the runtime's ``kimi-prep serve`` listens on."""
    args = build_parser().parse_args(runtime_container()["args"])
    chart = yaml.safe_load((CHART / "values.yaml").read_text())["networkPolicy"]
    return {
        f"pods {chart['clientLabel']}=true": {args.http_port, args.grpc_port},
        f"namespace {chart['monitoringNamespace']}": {args.metrics_port, args.probe_port},
    }


def test_kserve_networkpolicy_admits_clients_to_inference_and_monitoring_to_metrics() -> None:
    pod_labels = predictor_deployment()["spec"]["template"]["metadata"]["labels"]
    assert admitted(load(POLICY), pod_labels) == expected_sources()
    # The Helm chart's policy admits the same sources to the same roles.
    chart = {doc["kind"]: doc for doc in documents(render_chart())}
    chart_pod = chart["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert admitted(chart["NetworkPolicy"], chart_pod).keys() == expected_sources().keys()


BROKEN_POLICIES: dict[str, Callable[[dict[str, Any]], None]] = {
    # The chart's pod label: KServe's pods do not carry it, so the policy guards nothing.
    "selector of another pod": set_at(("spec", "podSelector", "matchLabels"), {"app": "kimi-vision-prep"}),
    "inference on the chart's gRPC port": set_at(("spec", "ingress", 0, "ports", 1, "port"), 8001),
    "metrics from every namespace": set_at(("spec", "ingress", 1, "from", 0, "namespaceSelector", "matchLabels"), {}),
}


@pytest.mark.parametrize("mistake", sorted(BROKEN_POLICIES))
def test_kserve_networkpolicy_checks_catch_what_kubernetes_validate_passes(mistake: str, tmp_path: Path) -> None:
    policy = copy.deepcopy(load(POLICY))
    BROKEN_POLICIES[mistake](policy)
    manifest = tmp_path / "policy.yaml"
    manifest.write_text(yaml.safe_dump(policy))
    status, _passed, output = kubernetes_validate(manifest, supported_minors()[-1])
    assert status == 0, output  # the schemas see nothing wrong
    pod_labels = predictor_deployment()["spec"]["template"]["metadata"]["labels"]
    assert admitted(policy, pod_labels) != expected_sources()


def test_kserve_probes_match_the_charts() -> None:
    """One readiness rule for both: the thresholds measured against /readyz (docs/serving.md)."""
    chart = {doc["kind"]: doc for doc in documents(render_chart())}
    (chart_container,) = chart["Deployment"]["spec"]["template"]["spec"]["containers"]
    timing = ("periodSeconds", "timeoutSeconds", "failureThreshold", "successThreshold")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        ours = {key: runtime_container()[probe].get(key) for key in timing}
        assert ours == {key: chart_container[probe].get(key) for key in timing}, probe


def test_serving_doc_states_what_the_networkpolicy_admits() -> None:
    doc = " ".join((REPO / "docs" / "serving.md").read_text().split())
    labels = predictor_deployment()["spec"]["template"]["metadata"]["labels"]
    assert "(" + ", ".join(f"`{key}: {value}`" for key, value in labels.items()) + ")" in doc
    (clients, inference), (monitoring, metrics) = expected_sources().items()
    label = clients.removeprefix("pods ")
    assert f"inference ({', '.join(map(str, sorted(inference)))}) only from pods labelled `{label}`" in doc
    namespace = monitoring.removeprefix("namespace ")
    assert f"metrics and probes ({', '.join(map(str, sorted(metrics)))}) only from the `{namespace}` namespace" in doc
