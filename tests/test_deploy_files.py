"""docker/: parse the images' and compose's files and check them against the repository (the Helm
chart: tests/test_helm_chart.py; the KServe runtime: tests/test_kserve.py).

Nothing here runs Docker or Kubernetes; the checks catch the drift that breaks a build or a rollout
silently: a COPY of a path that moved, a model name that no longer exists, ports that disagree,
an unpinned base image, CMD flags that differ from the launcher's.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import inspect
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kimi_vision_client.cli import build_parser
from kimi_vision_common.wire import DEFAULT_GRPC_PORT, DEFAULT_HTTP_PORT, DEFAULT_METRICS_PORT, DEFAULT_PROBE_PORT
from kimi_vision_server.cli.commands import cmd_serve
from kimi_vision_server.launch import command

REPO = Path(__file__).resolve().parents[1]
DOCKER = REPO / "docker"
DOCKERFILES = {"cu12": DOCKER / "Dockerfile.cu12", "cu13": DOCKER / "Dockerfile.cu13"}
COMPOSE = DOCKER / "docker-compose.yml"
PORTS = {"http": DEFAULT_HTTP_PORT, "grpc": DEFAULT_GRPC_PORT, "metrics": DEFAULT_METRICS_PORT}
PROBE_PORT = DEFAULT_PROBE_PORT  # kimi-prep serve --probe-port: /livez, /readyz
PINNED_TRITON = re.compile(r"^nvcr\.io/nvidia/tritonserver:\d{2}\.\d{2}-py3$")
MODEL_NAME = re.compile(r"\bkimi_(?:k\d+_[a-z0-9_]+|patch_embed)\b")


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` pairs, comments dropped and ``\\`` continuations joined."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, arguments = (pending + line).partition(" ")
        instructions.append((keyword.upper(), arguments.strip()))
        pending = ""
    return instructions


def instruction_args(path: Path, keyword: str) -> list[str]:
    return [args for kw, args in dockerfile_instructions(path) if kw == keyword]


def cmd_argv(path: Path) -> list[str]:
    (cmd,) = instruction_args(path, "CMD")
    return json.loads(cmd)


def flag_value(argv: list[str], flag: str) -> str:
    (value,) = [arg.split("=", 1)[1] for arg in argv if arg.startswith(f"{flag}=")]
    return value


def model_repository_names() -> set[str]:
    return {p.parent.name for p in (REPO / "model_repository").glob("*/config.pbtxt")}


def compose_service() -> dict:
    (service,) = yaml.safe_load(COMPOSE.read_text())["services"].values()
    return service


def deploy_texts() -> dict[str, str]:
    """Every file under docker/ and the serving docs, by repository-relative path."""
    paths = [p for p in sorted(DOCKER.rglob("*")) if p.is_file()] + [REPO / "docs" / "serving.md"]
    return {str(p.relative_to(REPO)): p.read_text() for p in paths if p.exists()}


# -- Dockerfiles --------------------------------------------------------------------------------


@pytest.mark.parametrize("cuda", sorted(DOCKERFILES))
def test_dockerfile_base_image_is_a_pinned_ngc_tritonserver(cuda: str) -> None:
    (base,) = instruction_args(DOCKERFILES[cuda], "FROM")
    assert PINNED_TRITON.match(base), f"{DOCKERFILES[cuda].name}: FROM {base!r} is not a pinned NGC tag"


@pytest.mark.parametrize("cuda", sorted(DOCKERFILES))
def test_dockerfile_copies_existing_paths(cuda: str) -> None:
    copies = instruction_args(DOCKERFILES[cuda], "COPY")
    assert copies
    for args in copies:
        *sources, _destination = shlex.split(args)
        for source in sources:
            assert (REPO / source).exists(), f"{DOCKERFILES[cuda].name}: COPY source {source} missing in the repo"


@pytest.mark.parametrize("cuda", sorted(DOCKERFILES))
def test_dockerfile_installs_the_server_with_its_nvimagecodec_extra(cuda: str) -> None:
    """The image installs the server package (no embedded tritonserver: the image brings one) with the
    library's nvImageCodec extra for its CUDA major."""
    runs = " ".join(instruction_args(DOCKERFILES[cuda], "RUN"))
    assert f'pip install "./backend_src/server[{cuda}]"' in runs
    server_requires = importlib.metadata.requires("kimi-vision-server") or []
    assert any(dep.startswith(f"kimi-vision-prep[{cuda}]") and f'extra == "{cuda}"' in dep for dep in server_requires)
    assert any(dep.startswith("kimi-vision-client") and "extra" not in dep for dep in server_requires)
    assert not any(dep.startswith("nvidia-pytriton") and "extra" not in dep for dep in server_requires)
    requires = importlib.metadata.requires("kimi-vision-prep") or []
    assert any(f"nvimgcodec-{cuda}" in dep and f'extra == "{cuda}"' in dep for dep in requires)


def serve_arguments(path: Path) -> argparse.Namespace:
    """The Dockerfile's CMD parsed by the ``kimi-prep`` CLI (it must be ``kimi-prep serve ...``)."""
    argv = cmd_argv(path)
    assert argv[0] == "kimi-prep", f"{path.name}: CMD must run the launcher (watchdog, probes), not {argv[0]}"
    scripts = importlib.metadata.entry_points(group="console_scripts", name="kimi-prep")
    assert [script.value for script in scripts] == ["kimi_vision_client.cli:main"]
    args = build_parser().parse_args(argv[1:])
    assert args.run.__wrapped__ is cmd_serve  # run after the codec environment is set
    return args


@pytest.mark.parametrize("cuda", sorted(DOCKERFILES))
def test_dockerfile_cmd_runs_the_launcher_with_probes(cuda: str) -> None:
    args = serve_arguments(DOCKERFILES[cuda])
    copied_to = {shlex.split(a)[-1] for a in instruction_args(DOCKERFILES[cuda], "COPY")}
    assert str(args.model_repository) in copied_to
    assert {name: getattr(args, f"{name}_port") for name in PORTS} == PORTS
    assert args.probe_port == PROBE_PORT
    assert args.instances is None  # the shipped configs' instance counts


@pytest.mark.parametrize("cuda", sorted(DOCKERFILES))
def test_dockerfile_exposes_the_ports_it_serves_on(cuda: str) -> None:
    exposed = {int(p) for args in instruction_args(DOCKERFILES[cuda], "EXPOSE") for p in args.split()}
    args = serve_arguments(DOCKERFILES[cuda])
    served = {getattr(args, f"{name}_port") for name in PORTS} | {args.probe_port}
    assert exposed == served == {*PORTS.values(), PROBE_PORT}


@pytest.mark.parametrize("cuda", sorted(DOCKERFILES))
def test_dockerignore_keeps_every_copied_path(cuda: str) -> None:
    ignore = DOCKERFILES[cuda].with_name(DOCKERFILES[cuda].name + ".dockerignore").read_text().splitlines()
    kept = {line[1:].split("/")[0] for line in ignore if line.startswith("!")}
    for args in instruction_args(DOCKERFILES[cuda], "COPY"):
        *sources, _ = shlex.split(args)
        assert all(source in kept for source in sources), f"{sources} excluded from the build context"


# -- defaults shared with the Python entry points ----------------------------------------------


def test_default_ports_match_launcher_and_cli() -> None:
    defaults = inspect.signature(command.Ports).parameters
    assert {name: defaults[name].default for name in PORTS} == PORTS
    serve_args = build_parser().parse_args(["serve"])
    assert {name: getattr(serve_args, f"{name}_port") for name in PORTS} == PORTS


# -- docker-compose -----------------------------------------------------------------------------


def test_compose_builds_an_existing_dockerfile_from_the_repository_root() -> None:
    build = compose_service()["build"]
    context = (COMPOSE.parent / build["context"]).resolve()
    assert context == REPO
    dockerfile = re.sub(r"\$\{CUDA:-(\w+)\}", r"\1", build["dockerfile"])
    assert (context / dockerfile).resolve() == DOCKERFILES["cu12"]
    for cuda, path in DOCKERFILES.items():
        assert (context / build["dockerfile"].replace("${CUDA:-cu12}", cuda)).resolve() == path


def test_compose_ports_gpu_shm_and_healthcheck() -> None:
    service = compose_service()
    published = {tuple(int(p) for p in mapping.split(":")) for mapping in service["ports"]}
    assert published == {(port, port) for port in (*PORTS.values(), PROBE_PORT)}
    (device,) = service["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert service["shm_size"]
    health = " ".join(service["healthcheck"]["test"])
    assert f"localhost:{PROBE_PORT}/readyz" in health  # Triton's own ready stays 200 with a dead stub


# -- model names --------------------------------------------------------------------------------


def test_model_names_referenced_exist_in_the_model_repository() -> None:
    available = model_repository_names()
    assert available, "model_repository/ is rendered and checked in"
    for name, text in deploy_texts().items():
        missing = set(MODEL_NAME.findall(text)) - available
        assert not missing, f"{name} references models not in model_repository/: {sorted(missing)}"


@pytest.mark.parametrize("cuda", sorted(DOCKERFILES))
def test_dockerfile_listens_beyond_loopback_as_a_non_root_user_behind_the_admin_key(cuda: str) -> None:
    """The image's server answers outside the container (--host 0.0.0.0) with the launcher's
    restricted APIs (no --open-api), its key from the environment or generated; never as root."""
    args = serve_arguments(DOCKERFILES[cuda])
    assert args.host == "0.0.0.0" and args.open_api == [] and args.admin_key_file is None
    (user,) = instruction_args(DOCKERFILES[cuda], "USER")
    assert user not in ("root", "0")


# -- schemas (validators from PyPI with their schemas inside: no network) -------------------------


def validator(name: str) -> str:
    """The console script ``name`` of this interpreter's environment (the test extra installs it)."""
    path = Path(sys.executable).parent / name
    assert path.exists(), f"{name} is not installed: the test extra brings it"
    return str(path)


def test_compose_file_is_valid_against_the_compose_spec() -> None:
    done = subprocess.run(
        [validator("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(COMPOSE)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
