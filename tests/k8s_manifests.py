"""Kubernetes manifests under test: helm, the schema validators, and the rules schemas cannot express.

A schema checks each field alone. A Deployment whose selector does not match its pods' labels, two
ports of one name, requests above limits or a probe on a port the container does not have all pass
``kubernetes-validate --strict`` and fail (or misbehave) only when applied: :func:`semantic_errors`
finds them in a list of rendered resources, with every control of the Pod Security Standard
``restricted`` for the pods (tests/pod_security.py).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from fractions import Fraction
from pathlib import Path
from typing import Any

import yaml
from pod_security import pod_security_errors

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "docker" / "helm" / "kimi-vision-prep"
CRDS = REPO / "docker" / "crds"
SCHEMA_SCRIPT = CRDS / "crd_to_json_schema.py"
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
POD_OWNERS = ("Deployment",)
SELECTING = {
    "Service": ("spec", "selector"),
    "PodDisruptionBudget": ("spec", "selector", "matchLabels"),
    "PodMonitor": ("spec", "selector", "matchLabels"),
    "NetworkPolicy": ("spec", "podSelector", "matchLabels"),
}
SUFFIXES = {"": 1, "m": Fraction(1, 1000), "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
            "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}  # fmt: skip
QUANTITY = re.compile(r"^([+-]?\d+(?:\.\d*)?|[+-]?\.\d+)(?:[eE]([+-]?\d+)|(Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E)?)$")


def tool(name: str) -> str:
    """A console script of this interpreter's environment (the test extra installs it)."""
    path = Path(sys.executable).parent / name
    assert path.exists(), f"{name} is not installed: the test extra brings it"
    return str(path)


def helm() -> str:
    """``KIMI_HELM`` (``make test`` sets it), else ``.tools/helm`` (``make helm`` installs it)."""
    path = Path(os.environ.get("KIMI_HELM", REPO / ".tools" / "helm"))
    assert path.exists(), f"no {path}: `make helm` installs it"
    return str(path)


def run(command: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, check=False, cwd=cwd)


def supported_minors() -> list[str]:
    """Every Kubernetes minor in Chart.yaml's ``kubeVersion`` range (``>=1.A.0-0 <1.B.0-0``): the
    chart's and the KServe runtime's manifests are validated against each."""
    constraint = yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"]
    low, high = (int(m) for m in re.fullmatch(r">=1\.(\d+)\.0-0 <1\.(\d+)\.0-0", constraint).groups())
    return [f"1.{minor}.0" for minor in range(low, high)]


def render_chart(
    values: Path | None = None,
    *,
    kube_version: str | None = None,
    sets: tuple[str, ...] = (),
    api_versions: tuple[str, ...] = (),
) -> str:
    """``helm template`` of the chart (release ``prep``) for a cluster that serves ``api_versions``
    beside Kubernetes' own (``group/version/Kind``); raises with helm's message when it fails."""
    command = [helm(), "template", "prep", str(CHART)]
    command += ["-f", str(values)] if values else []
    command += ["--kube-version", kube_version] if kube_version else []
    command += [arg for version in api_versions for arg in ("--api-versions", version)]
    command += [arg for value in sets for arg in ("--set", value)]
    done = run(command)
    if done.returncode:
        raise ValueError(done.stderr.strip())
    return done.stdout


def documents(text: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def quantity(value: str | int | float) -> Fraction:
    """A Kubernetes resource quantity (``"500m"``, ``"16Gi"``, ``"1e3"``, ``4``) as an exact number."""
    match = QUANTITY.match(str(value))
    if match is None:
        raise ValueError(f"not a quantity: {value!r}")
    number, exponent, suffix = match.groups()
    return Fraction(number) * (Fraction(10) ** int(exponent) if exponent else SUFFIXES[suffix or ""])


def nested(doc: dict[str, Any], path: tuple[str, ...]) -> Any:
    for key in path:
        doc = (doc or {}).get(key)
    return doc


def pod_templates(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {doc["metadata"]["name"]: doc["spec"]["template"] for doc in docs if doc["kind"] in POD_OWNERS}


def container_errors(where: str, container: dict[str, Any], volumes: set[str]) -> list[str]:
    errors = []
    ports = container.get("ports", [])
    names = [p["name"] for p in ports if "name" in p]
    numbers = [p["containerPort"] for p in ports]
    for label, values in (("port name", names), ("port", numbers)):
        errors += [f"{where}: {label} {v} declared twice" for v in sorted(set(values), key=str) if values.count(v) > 1]
    resources = container.get("resources", {})
    requests, limits = resources.get("requests", {}), resources.get("limits", {})
    for name in sorted(requests.keys() & limits.keys()):
        if quantity(requests[name]) > quantity(limits[name]):
            errors.append(f"{where}: requests.{name} {requests[name]} above limits.{name} {limits[name]}")
    for probe in PROBES:
        handlers = container.get(probe, {})
        for action in (handlers[kind] for kind in ("httpGet", "tcpSocket", "grpc") if kind in handlers):
            if action["port"] not in (names if isinstance(action["port"], str) else numbers):
                errors.append(f"{where}: {probe} on port {action['port']!r}, which the container does not declare")
    errors += [f"{where}: mounts volume {m['name']!r}, which the pod does not have"
               for m in container.get("volumeMounts", []) if m["name"] not in volumes]  # fmt: skip
    return errors


def semantic_errors(docs: list[dict[str, Any]]) -> list[str]:
    """What an API server or a controller would trip on in ``docs`` that no schema refuses."""
    errors: list[str] = []
    templates = pod_templates(docs)
    pod_labels = {name: t["metadata"].get("labels", {}) for name, t in templates.items()}
    container_ports = {
        name: [port for c in template["spec"]["containers"] for port in c.get("ports", [])]
        for name, template in templates.items()
    }
    for doc in docs:
        kind, name = doc["kind"], doc["metadata"]["name"]
        if kind in POD_OWNERS:
            selector = doc["spec"]["selector"]["matchLabels"]
            if not selector.items() <= pod_labels[name].items():
                errors.append(f"{kind}/{name}: selector {selector} does not match its pods' labels {pod_labels[name]}")
            errors += pod_security_errors(f"{kind}/{name}", doc["spec"]["template"])
            pod = doc["spec"]["template"]["spec"]
            volumes = {v["name"] for v in pod.get("volumes", [])}
            for container in pod["containers"]:
                errors += container_errors(f"{kind}/{name} container {container['name']}", container, volumes)
        if kind in SELECTING:
            selector = nested(doc, SELECTING[kind]) or {}
            selected = [pod for pod, labels in pod_labels.items() if selector.items() <= labels.items()]
            if not selected:
                errors.append(f"{kind}/{name}: selector {selector} selects no pod of this manifest")
            if kind == "Service":
                names = [p["name"] for p in doc["spec"]["ports"]]
                twice = sorted(n for n in set(names) if names.count(n) > 1)
                errors += [f"Service/{name}: port name {n} declared twice" for n in twice]
                for port in doc["spec"]["ports"]:
                    target = port.get("targetPort", port["port"])
                    for pod in selected:
                        key = "name" if isinstance(target, str) else "containerPort"
                        if target not in [p.get(key) for p in container_ports[pod]]:
                            errors.append(f"Service/{name}: targetPort {target!r} is no port of {pod}'s containers")
            if kind == "PodMonitor":
                for endpoint in doc["spec"]["podMetricsEndpoints"]:
                    for pod in selected:
                        if endpoint["port"] not in [p.get("name") for p in container_ports[pod]]:
                            errors.append(f"PodMonitor/{name}: port {endpoint['port']!r} is no port of {pod}")
        if kind == "HorizontalPodAutoscaler":
            target = doc["spec"]["scaleTargetRef"]
            if target["kind"] not in POD_OWNERS or target["name"] not in templates:
                scaled = f"{target['kind']}/{target['name']}"
                errors.append(f"HorizontalPodAutoscaler/{name}: scales {scaled}, not in this manifest")
            if doc["spec"].get("minReplicas", 1) > doc["spec"]["maxReplicas"]:
                errors.append(f"HorizontalPodAutoscaler/{name}: minReplicas above maxReplicas")
    return errors


def kubernetes_validate(path: Path, kube_version: str) -> tuple[int, set[str], str]:
    """``kubernetes-validate --strict``: exit status, the kinds it passed (lower case), its output."""
    done = run([tool("kubernetes-validate"), "--strict", "-k", kube_version, str(path)])
    output = done.stdout + done.stderr
    return done.returncode, set(re.findall(r"passed for resource (\w+)/", output)), output


def crd_schema(crd: Path, out: Path) -> Path:
    """``crd`` converted by the project's script into a strict JSON Schema file at ``out``."""
    done = run([sys.executable, str(SCHEMA_SCRIPT), str(crd), "--out", str(out)])
    assert done.returncode == 0, done.stderr
    json.loads(out.read_text())
    return out


def check_jsonschema(schema: Path, *instances: Path) -> subprocess.CompletedProcess[str]:
    return run([tool("check-jsonschema"), "--schemafile", str(schema), *map(str, instances)])
