"""docker/helm/kimi-vision-prep: helm lint and template for every values file shipped, the result
validated strictly against every Kubernetes minor the chart supports, the PodMonitor against the
prometheus-operator CRD (rendered only for a cluster that serves its API), and the rules schemas miss
(tests/k8s_manifests.py, every control of the Pod Security Standard ``restricted`` among them:
tests/pod_security.py), shown to catch the mistakes they are for. The pod runs ``kimi-prep serve``
with arguments the CLI parses, and the chart's defaults keep the security bounds: the admin key from
a Secret, no restricted API opened, no response cache beyond loopback (docs/security.md), no
service-account token; its probes' thresholds are those docs/serving.md gives from measured answers.
"""

from __future__ import annotations

import copy
import functools
import re
import shlex
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
    helm,
    kubernetes_validate,
    quantity,
    render_chart,
    run,
    semantic_errors,
    supported_minors,
)
from pod_security import BREAKERS, CONTROLS, pod_security_errors

from kimi_vision_client.cli import build_parser
from kimi_vision_common.wire import DEFAULT_GRPC_PORT, DEFAULT_HTTP_PORT, DEFAULT_METRICS_PORT, DEFAULT_PROBE_PORT
from kimi_vision_server.cli.commands import cmd_serve

REPO = Path(__file__).resolve().parents[1]
VALUES = [CHART / "values.yaml", *sorted(CHART.glob("values-*.yaml"))]
PODMONITOR_API = "monitoring.coreos.com/v1/PodMonitor"
PORTS = {
    "http": DEFAULT_HTTP_PORT,
    "grpc": DEFAULT_GRPC_PORT,
    "metrics": DEFAULT_METRICS_PORT,
    "probes": DEFAULT_PROBE_PORT,
}


def rendered(values: Path = VALUES[0], **kwargs: Any) -> dict[str, dict[str, Any]]:
    """The chart's resources by ``Kind`` (``Service`` is the ordinary one, ``Service/pods`` the headless)."""
    docs = documents(render_chart(values, **kwargs))
    by_kind: dict[str, dict[str, Any]] = {}
    for doc in docs:
        key = "Service/pods" if doc["kind"] == "Service" and doc["spec"].get("clusterIP") == "None" else doc["kind"]
        assert key not in by_kind, f"two {key}s"
        by_kind[key] = doc
    return by_kind


def values_of(path: Path) -> dict[str, Any]:
    defaults = yaml.safe_load(VALUES[0].read_text())
    return {**defaults, **yaml.safe_load(path.read_text())}


def container(docs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    (only,) = docs["Deployment"]["spec"]["template"]["spec"]["containers"]
    return only


@pytest.mark.parametrize("values", VALUES, ids=lambda p: p.name)
def test_chart_lints_strictly(values: Path) -> None:
    done = run([helm(), "lint", "--strict", str(CHART), "-f", str(values)])
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 chart(s) failed" in done.stdout


@pytest.mark.parametrize("kube_version", supported_minors())
@pytest.mark.parametrize("values", VALUES, ids=lambda p: p.name)
def test_chart_renders_resources_valid_for_each_supported_kubernetes(
    values: Path, kube_version: str, tmp_path: Path
) -> None:
    manifest = tmp_path / "chart.yaml"
    manifest.write_text(render_chart(values, kube_version=kube_version))
    status, passed, output = kubernetes_validate(manifest, kube_version)
    assert status == 0, output
    kinds = {doc["kind"] for doc in documents(manifest.read_text())}
    assert {kind.lower() for kind in kinds - {"PodMonitor"}} <= passed, output


def test_chart_refuses_a_kubernetes_older_than_it_supports() -> None:
    with pytest.raises(ValueError, match="kubeVersion"):
        render_chart(kube_version="1.29.0")


@pytest.mark.parametrize("values", VALUES, ids=lambda p: p.name)
def test_chart_podmonitor_is_valid_against_the_prometheus_operator_crd(values: Path, tmp_path: Path) -> None:
    crd = CRDS / "prometheus-operator" / "monitoring.coreos.com_podmonitors.yaml"
    schema = crd_schema(crd, tmp_path / "podmonitor.json")
    monitor = tmp_path / "podmonitor.yaml"
    docs = rendered(values, api_versions=(PODMONITOR_API,))
    monitor.write_text(yaml.safe_dump(docs["PodMonitor"]))
    done = check_jsonschema(schema, monitor)
    assert done.returncode == 0, done.stdout + done.stderr
    broken = copy.deepcopy(docs["PodMonitor"])
    broken["spec"]["podMetricsEndpoints"][0]["scrapeEvery"] = "15s"  # not a field of the CRD
    monitor.write_text(yaml.safe_dump(broken))
    assert check_jsonschema(schema, monitor).returncode != 0


def test_chart_renders_the_podmonitor_only_where_the_cluster_serves_its_api() -> None:
    """A cluster without the Prometheus Operator's CRD would refuse the whole install for one unknown kind."""
    assert "PodMonitor" not in rendered()
    assert rendered(api_versions=(PODMONITOR_API,))["PodMonitor"]["apiVersion"] == PODMONITOR_API.rsplit("/", 1)[0]
    assert "PodMonitor" not in rendered(sets=("podMonitor.enabled=false",), api_versions=(PODMONITOR_API,))


@pytest.mark.parametrize("values", VALUES, ids=lambda p: p.name)
def test_chart_holds_the_rules_schemas_miss(values: Path) -> None:
    assert semantic_errors(list(rendered(values, api_versions=(PODMONITOR_API,)).values())) == []


@pytest.mark.parametrize("values", VALUES, ids=lambda p: p.name)
def test_chart_pod_passes_the_restricted_pod_security_standard(values: Path) -> None:
    template = rendered(values)["Deployment"]["spec"]["template"]
    assert pod_security_errors("pod", template) == []
    assert template["spec"]["automountServiceAccountToken"] is False
    assert template["spec"]["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert all(volume.keys() == {"name", "emptyDir"} for volume in template["spec"]["volumes"])


def broken_selector(docs: dict[str, dict[str, Any]]) -> None:
    docs["Deployment"]["spec"]["selector"]["matchLabels"]["app.kubernetes.io/instance"] = "other"


def broken_port_names(docs: dict[str, dict[str, Any]]) -> None:
    container(docs)["ports"][1]["name"] = container(docs)["ports"][0]["name"]


def broken_requests(docs: dict[str, dict[str, Any]]) -> None:
    container(docs)["resources"]["requests"]["memory"] = "64Gi"


def broken_probe_port(docs: dict[str, dict[str, Any]]) -> None:
    container(docs)["readinessProbe"]["httpGet"]["port"] = "health"


def broken_service_target(docs: dict[str, dict[str, Any]]) -> None:
    docs["Service/pods"]["spec"]["ports"][0]["targetPort"] = 9000


BROKEN = {
    "selector does not match labels": (broken_selector, "does not match its pods' labels"),
    "duplicated port name": (broken_port_names, "declared twice"),
    "requests above limits": (broken_requests, "above limits.memory"),
    "probe on a missing port": (broken_probe_port, "readinessProbe on port 'health'"),
    "service to a missing port": (broken_service_target, "targetPort 9000 is no port"),
}


@pytest.mark.parametrize("mistake", sorted(BROKEN))
def test_semantic_rules_catch_what_kubernetes_validate_passes(mistake: str, tmp_path: Path) -> None:
    """Each broken variant passes the strict schema check, and the rule for it names the mistake."""
    break_it, message = BROKEN[mistake]
    docs = copy.deepcopy(rendered())
    break_it(docs)
    manifest = tmp_path / "broken.yaml"
    manifest.write_text(yaml.safe_dump_all([doc for kind, doc in docs.items() if kind != "PodMonitor"]))
    status, _passed, output = kubernetes_validate(manifest, supported_minors()[-1])
    assert status == 0, output  # the schemas see nothing wrong
    errors = semantic_errors(list(docs.values()))
    assert any(message in error for error in errors), errors


@functools.cache
def default_rendering() -> dict[str, dict[str, Any]]:
    return rendered()


def broken_pod(control: str) -> dict[str, dict[str, Any]]:
    """The default rendering with ``control`` of the restricted profile broken in its pod."""
    docs = copy.deepcopy(default_rendering())
    BREAKERS[control](docs["Deployment"]["spec"]["template"])
    return docs


def test_every_pod_security_control_has_a_broken_variant_the_schemas_pass(tmp_path: Path) -> None:
    """One ``kubernetes-validate --strict`` run over every variant's Deployment: the schemas see nothing wrong."""
    assert BREAKERS.keys() == CONTROLS.keys()
    deployments = []
    for number, control in enumerate(BREAKERS):
        deployment = broken_pod(control)["Deployment"]
        deployment["metadata"]["name"] += f"-{number}"
        deployments.append(deployment)
    manifest = tmp_path / "broken.yaml"
    manifest.write_text(yaml.safe_dump_all(deployments))
    status, passed, output = kubernetes_validate(manifest, supported_minors()[-1])
    assert status == 0 and passed == {"deployment"}, output
    assert output.count("passed for resource") == len(deployments), output


@pytest.mark.parametrize("control", sorted(BREAKERS))
def test_pod_security_rule_names_its_broken_variant(control: str) -> None:
    errors = semantic_errors(list(broken_pod(control).values()))
    name = default_rendering()["Deployment"]["metadata"]["name"]
    assert any(error.startswith(f"Deployment/{name}: {control}: ") for error in errors), errors


def test_quantities_compare_across_units() -> None:
    assert quantity("500m") < quantity("1") == quantity(1) < quantity("1.5") == quantity("1500m")
    assert quantity("1Gi") == quantity("1024Mi") > quantity("1G") == quantity("1e9")
    with pytest.raises(ValueError):
        quantity("1 Gi")


@pytest.mark.parametrize(
    "setting",
    ["gpus=-1", "replicaCount=0", "responseCacheMiB=-1", "image.tag=latest", "instances=0", "unknownKey=1",
     "adminKey.secretName=", "shmSizeLimit=4GB"],
)  # fmt: skip
def test_chart_values_schema_refuses_bad_values(setting: str) -> None:
    with pytest.raises(ValueError, match=r"values don.t meet the specifications|schema"):
        render_chart(sets=(setting,))


def serve_args(docs: dict[str, dict[str, Any]]) -> Any:
    pod = container(docs)
    assert pod["command"] == ["kimi-prep"]
    args = build_parser().parse_args(pod["args"])
    assert args.run.__wrapped__ is cmd_serve
    return args


@pytest.mark.parametrize("values", VALUES, ids=lambda p: p.name)
def test_chart_pod_runs_the_launcher_on_its_declared_ports(values: Path) -> None:
    docs, settings = rendered(values), values_of(values)
    args = serve_args(docs)
    ports = {p["name"]: p["containerPort"] for p in container(docs)["ports"]}
    assert ports == PORTS
    assert {name: getattr(args, f"{name}_port") for name in ("http", "grpc", "metrics")} == {
        name: PORTS[name] for name in ("http", "grpc", "metrics")
    }
    assert args.probe_port == PORTS["probes"]
    assert args.kind == ("gpu" if settings["gpus"] else "cpu")
    assert (args.instances, args.threads) == (settings["instances"], settings["threads"])
    limits = container(docs)["resources"]["limits"]
    assert int(limits.get("nvidia.com/gpu", 0)) == settings["gpus"]
    if not settings["gpus"] and settings["threads"]:
        # A CPU pod's instances x threads stays within its CPU limit (docs/serving.md, instances).
        assert settings["instances"] * settings["threads"] <= quantity(limits["cpu"])
    for probe, path in (("startupProbe", "/readyz"), ("readinessProbe", "/readyz"), ("livenessProbe", "/livez")):
        assert container(docs)[probe]["httpGet"] == {"path": path, "port": "probes"}


@pytest.mark.parametrize("values", VALUES, ids=lambda p: p.name)
def test_chart_defaults_keep_the_security_bounds(values: Path) -> None:
    docs = rendered(values)
    args = serve_args(docs)
    assert args.host == "0.0.0.0" and args.open_api == [] and args.admin_key_file is None
    assert args.response_cache_mib is None  # none beyond loopback: docs/security.md, "Response cache"
    env = {entry["name"]: entry for entry in container(docs)["env"]}
    assert "value" not in env["KIMI_PREP_ADMIN_KEY"] and env["KIMI_PREP_ADMIN_KEY"]["valueFrom"]["secretKeyRef"]
    context = {
        **docs["Deployment"]["spec"]["template"]["spec"]["securityContext"],
        **container(docs)["securityContext"],
    }
    assert context["runAsNonRoot"] is True and context["runAsUser"] != 0
    assert context["readOnlyRootFilesystem"] is True and context["allowPrivilegeEscalation"] is False
    writable = {mount["mountPath"] for mount in container(docs)["volumeMounts"]}
    assert env["XDG_CACHE_HOME"]["value"] in writable and env["XDG_RUNTIME_DIR"]["value"] in writable
    served = {port["port"] for rule in docs["NetworkPolicy"]["spec"]["ingress"] for port in rule["ports"]}
    assert served == set(PORTS.values())
    (shm,) = [v for v in docs["Deployment"]["spec"]["template"]["spec"]["volumes"] if v["name"] == "dshm"]
    assert shm["emptyDir"]["medium"] == "Memory" and shm["emptyDir"]["sizeLimit"]


def test_chart_response_cache_is_the_operators_choice() -> None:
    args = serve_args(rendered(sets=("responseCacheMiB=256",)))
    assert args.response_cache_mib == 256


def test_chart_headless_service_lists_ready_pods_for_client_balancing() -> None:
    docs = rendered()
    headless = docs["Service/pods"]
    assert headless["spec"]["clusterIP"] == "None" and not headless["spec"].get("publishNotReadyAddresses")
    assert {p["name"]: p["port"] for p in headless["spec"]["ports"]} == {"grpc": PORTS["grpc"], "http": PORTS["http"]}
    assert "Service/pods" not in rendered(sets=("headlessService.enabled=false",))


def test_chart_hpa_scales_on_the_documented_queue_metric() -> None:
    docs = rendered()
    (metric,) = docs["HorizontalPodAutoscaler"]["spec"]["metrics"]
    assert metric["type"] == "Pods"
    rule = (REPO / "docs" / "serving.md").read_text()
    assert f'as: "{metric["pods"]["metric"]["name"]}"' in rule  # the prometheus-adapter rule makes it
    assert "replicas" not in docs["Deployment"]["spec"]  # the HPA owns the count
    assert rendered(sets=("autoscaling.enabled=false",))["Deployment"]["spec"]["replicas"] == 2


def test_chart_disruption_budget_keeps_pods_serving_through_a_drain() -> None:
    budget = rendered()["PodDisruptionBudget"]["spec"]
    assert budget["maxUnavailable"] == 1
    assert rendered()["HorizontalPodAutoscaler"]["spec"]["minReplicas"] > budget["maxUnavailable"]


def test_documented_helm_commands_render() -> None:
    """Each ``helm install`` line of docs/serving.md, run as ``helm template`` from the repository root."""
    lines = re.findall(r"^helm install .*$", (REPO / "docs" / "serving.md").read_text(), re.M)
    assert len(lines) >= 2
    for line in lines:
        argv = shlex.split(line)
        done = run([helm(), "template", *argv[2:]], cwd=REPO)
        assert done.returncode == 0, f"{line}: {done.stderr}"
        assert "kind: Deployment" in done.stdout


def test_serving_doc_states_the_charts_values() -> None:
    doc = " ".join((REPO / "docs" / "serving.md").read_text().split())
    minors = supported_minors()
    assert f"({minors[0].removesuffix('.0')} to {minors[-1].removesuffix('.0')})" in doc
    cpu = values_of(CHART / "values-cpu.yaml")
    limit = cpu["resources"]["limits"]["cpu"]
    assert f"{cpu['instances']} instances x {cpu['threads']} threads within an {limit}-CPU limit" in doc
    defaults = values_of(VALUES[0])
    budget, floor = defaults["podDisruptionBudget"]["maxUnavailable"], defaults["autoscaling"]["minReplicas"]
    assert f"(`maxUnavailable: {budget}`; the HPA keeps at least {floor} pods)" in doc
    context = rendered()["Deployment"]["spec"]["template"]["spec"]["securityContext"]
    assert f"the image's non-root user (`triton-server`, {context['runAsUser']}:{context['runAsGroup']})" in doc


def probes_section() -> str:
    doc = (REPO / "docs" / "serving.md").read_text()
    return doc[doc.index("**Probes.**") : doc.index("`make test` runs `helm lint")]


def test_serving_doc_states_the_probe_thresholds_with_margin_over_the_measured_readyz() -> None:
    """The thresholds docs/serving.md gives are the chart's, and its timeout is at least 4x the
    slowest ``/readyz`` or ``/livez`` answer it reports measured."""
    section = probes_section()
    text = " ".join(section.split())
    probes = values_of(VALUES[0])["probes"]
    pod = container(rendered())
    timeout, period = probes["timeoutSeconds"], probes["readinessPeriodSeconds"]
    threshold = pod["readinessProbe"]["failureThreshold"]
    assert threshold == probes["readinessFailureThreshold"] >= 2  # one slow answer is not enough
    assert {pod[probe]["timeoutSeconds"] for probe in ("startupProbe", "readinessProbe", "livenessProbe")} == {timeout}
    assert f"Every probe waits {timeout} s for an answer (`.Values.probes.timeoutSeconds`" in text
    assert f"after {threshold} failures in a row (`.Values.probes.readinessFailureThreshold`), {period} s apart" in text
    assert f"takes it out within about {threshold * period} s" in text
    liveness = pod["livenessProbe"]
    assert f"Liveness restarts the container after {liveness['failureThreshold']} failures" in text
    assert f"{liveness['periodSeconds']} s apart; the startup probe allows" in text
    assert f"`.Values.probes.startupSeconds` ({probes['startupSeconds']})" in text
    rows = re.findall(
        r"^\|[^|]+\| ([\d.]+) / ([\d.]+) / ([\d.]+) ms \| ([\d.]+) / ([\d.]+) / ([\d.]+) ms \|$", section, re.M
    )
    assert len(rows) >= 3, section  # idle and loaded
    slowest_ms = max(float(row[column]) for row in rows for column in (2, 5))
    stated = re.search(r"The slowest answer of \w+ such runs .*? took ([\d.]+) ms", text)
    assert stated and float(stated[1]) >= slowest_ms
    assert 4 * float(stated[1]) <= 1000 * timeout
