"""docker/kserve: the ServingRuntime and the InferenceService example, validated against KServe's own
CRDs (docker/crds/kserve, pinned, turned into strict JSON Schemas by docker/crds/crd_to_json_schema.py),
broken variants refused, and what no schema sees: the runtime runs ``kimi-prep serve`` on KServe's
v2 ports with the repository KServe downloads, and the example picks this runtime.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from k8s_manifests import CRDS, check_jsonschema, crd_schema, quantity

from kimi_vision_client.cli import build_parser
from kimi_vision_server.cli.commands import cmd_serve

REPO = Path(__file__).resolve().parents[1]
KSERVE = REPO / "docker" / "kserve"
RUNTIME, SERVICE = KSERVE / "servingruntime.yaml", KSERVE / "inferenceservice.yaml"
CRD_FILES = {
    "ServingRuntime": "serving.kserve.io_servingruntimes.yaml",
    "InferenceService": "serving.kserve.io_inferenceservices.yaml",
}
KSERVE_V2_PORTS = {"http": 8080, "grpc": 9000}  # where KServe's ingress and its v2 runtimes expect them
STORAGE_MOUNT = "/mnt/models"  # KServe's storage initializer downloads storageUri here


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
