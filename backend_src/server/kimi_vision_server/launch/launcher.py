"""Run ``tritonserver`` on a model repository, one start path for ``kimi-prep serve`` and tests.

:func:`launch` is that path: stale shared-memory regions removed, the repository rendered from the
presets when :class:`~..render.repository.RenderOptions` are given (never edited as text), tritonserver
started in its own process group with a SIGTERM-on-parent-death (:mod:`.process`; its command line:
:mod:`.command`), and next to it a :class:`~..watch.watchdog.StubWatchdog` (a dead Python-backend stub
gets its model reloaded) and, given a probe port, a :class:`~..watch.probes.ProbeServer` (``/livez``,
``/readyz``, ``/metrics``). Everything it starts is stopped, in reverse order, when its ``ExitStack`` closes.

- :func:`~.serve.serve`: the foreground server of ``kimi-prep serve``; forwards SIGINT/SIGTERM, returns the exit code.
- :class:`~.embedded.EmbeddedServer`: a context manager on free ports, ready when entered (tests, embedding).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from kimi_vision_common.wire import is_loopback

from ..allocator import describe_server_allocator
from ..host import cuda_device_count
from ..render.blocks import SERVING_DEFAULTS
from ..render.repository import RenderOptions, render_repository
from ..triton_install import default_model_repository, find_tritonserver, patchify_library
from ..watch.probes import ProbeServer
from ..watch.watchdog import StubWatchdog
from .access import LOOPBACK_HOST, AccessPolicy, generated_key, redacted, write_key_file
from .command import CPU_ONLY_NOISE, Ports, admin_key_path, checked_repository_path, relay_log, server_args
from .process import ServerStop, end_left_in_group, server_process_setup
from .shm_regions import remove_shm_regions, remove_stale_shm_regions, shm_region_prefix

log = logging.getLogger("kimi_vision_server.launcher")  # fixed: log lines and logging configs key on it


@dataclass(frozen=True)
class LaunchSpec:
    """What to serve and how. ``model_repository``: served as it is (None: the checked-in
    ``model_repository/`` of a checkout; an installed package without one renders it);
    ``render`` and/or ``models``: serve a fresh rendering from the presets
    with these options (default: host-independent) of these models and their steps (default: all),
    exclusive with ``model_repository``. ``extra_args`` go to tritonserver last.

    ``host``: the address every listener binds to (loopback unless the operator says otherwise);
    ``admin_key``: the key of the restricted APIs (:mod:`.access`; None: a random one, written to
    :func:`admin_key_path`); ``open_apis``: restricted APIs opened to anonymous clients;
    ``verbose``: relay tritonserver's info lines and tables too (default: warnings and errors)."""

    ports: Ports = Ports()  # noqa: RUF009  (a frozen dataclass: one shared default is safe)
    model_repository: Path | None = None
    render: RenderOptions | None = None
    models: tuple[str, ...] | None = None
    extra_args: Sequence[str] = ()
    stdout: IO[bytes] | None = None  # None: inherit the launcher's
    host: str = LOOPBACK_HOST
    admin_key: str | None = None
    open_apis: tuple[str, ...] = ()
    verbose: bool = False  # tritonserver's info lines and start-up tables, relayed
    response_cache_bytes: int | None = None  # None: ServingDefaults.response_cache_bytes on loopback, else 0

    @property
    def cache_bytes(self) -> int:
        """The response cache's size in bytes (0: none)."""
        if self.response_cache_bytes is not None:
            return self.response_cache_bytes
        return SERVING_DEFAULTS.response_cache_bytes if is_loopback(self.host) else 0

    def __post_init__(self) -> None:
        if self.response_cache_bytes is not None and self.response_cache_bytes < 0:
            raise ValueError(f"the response cache size must be >= 0, got {self.response_cache_bytes}")
        if self.model_repository is not None and (self.render is not None or self.models is not None):
            raise ValueError(
                "--instances/--threads/--kind and the model selection render a repository from the presets: "
                "drop --model-repository"
            )


@dataclass
class Launched:
    """A started server: its repository, shared-memory prefix, watchdog (which starts tritonserver
    again should it exit by itself: ``process`` is the one running now) and access policy
    (``key_file``: where a generated admin key was written; None for the operator's), and how its
    stop ended (``stopped``)."""

    repository: Path
    shm_prefix: str
    watchdog: StubWatchdog
    access: AccessPolicy
    ports: Ports = field(default_factory=Ports)
    key_file: Path | None = None
    stopped: ServerStop = field(default_factory=ServerStop)

    @property
    def process(self) -> subprocess.Popen[bytes]:
        return self.watchdog.process


# Over 60 lines: the start sequence in order; its two closures (start, start again) share the command line.
def launch(stack: contextlib.ExitStack, spec: LaunchSpec) -> Launched:
    """Start a server as ``spec`` says; closing ``stack`` stops it and removes what it left."""
    install = find_tritonserver()
    log.debug("%s", describe_server_allocator(install.env))
    for region in remove_stale_shm_regions():
        log.info("removed stale shared-memory region /dev/shm/%s", region)
    shm_prefix = shm_region_prefix()
    stack.callback(remove_shm_regions, shm_prefix)
    repository = served_repository(stack, spec)
    check_ports_free(spec.host, spec.ports)
    access, key_file = AccessPolicy(spec.admin_key or generated_key(), spec.host, spec.open_apis), None
    if spec.admin_key is None:
        key_file = write_key_file(access.key, admin_key_path(spec.ports.http))
        stack.callback(key_file.unlink, missing_ok=True)
    args = server_args(
        install, repository, spec.ports, access, extra_args=spec.extra_args, shm_prefix=shm_prefix,
        cache_bytes=spec.cache_bytes,
    )  # fmt: skip
    log.debug("tritonserver %s", " ".join(redacted(args, access.key)))
    relays: list[threading.Thread] = []
    stack.callback(lambda: [relay.join(10) for relay in relays])

    def start_server() -> subprocess.Popen[bytes]:
        process = subprocess.Popen(
            args,
            env=install.env,
            stdout=spec.stdout or subprocess.PIPE,  # None: relayed to ours, filtered (relay_log)
            stderr=subprocess.STDOUT,
            preexec_fn=server_process_setup,  # noqa: PLW1509  (async-signal-safe calls only)
        )
        if spec.stdout is None:
            drop = () if cuda_device_count() else CPU_ONLY_NOISE
            relay = threading.Thread(
                target=relay_log,
                args=(process.stdout, sys.stdout.buffer, drop),
                kwargs={"verbose": spec.verbose},
                daemon=True,
            )
            relay.start()
            relays.append(relay)
        return process

    def start_again(exited: subprocess.Popen[bytes]) -> subprocess.Popen[bytes]:
        """A server in place of one that exited by itself: what it left (stubs, regions) removed first."""
        end_left_in_group(exited.pid)
        remove_shm_regions(shm_prefix)
        return start_server()

    http_url, metrics_url = (f"{access.connect_host}:{port}" for port in (spec.ports.http, spec.ports.metrics))
    watchdog = StubWatchdog(
        start_server(),
        http_url,
        metrics_url,
        model_repository=repository,
        headers=access.headers("http"),
        restart=start_again,
    )
    stopped = ServerStop()
    stack.callback(stopped.stop, watchdog)
    stack.enter_context(watchdog)
    if spec.ports.probe is not None:
        stack.enter_context(ProbeServer(watchdog, spec.ports.probe, spec.host))
    log.info("%s; %s", describe_listeners(spec.host, spec.ports, access, key_file), describe_cache(spec.cache_bytes))
    return Launched(repository, shm_prefix, watchdog, access, spec.ports, key_file, stopped)


def served_repository(stack: contextlib.ExitStack, spec: LaunchSpec) -> Path:
    """The repository ``spec`` serves: as given, else the checkout's, else (or with render options or
    a model selection) one rendered from the presets into a folder ``stack`` removes."""
    repository = spec.model_repository or default_model_repository()
    if spec.render is not None or spec.models is not None or repository is None:
        rendered = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kimi_prep_repo.")))
        options = spec.render or RenderOptions()
        if options.uses_c_patchify and patchify_library() is None:
            log.warning(
                "the C patchify step is not built (no C compiler at install): "
                "the CPU vision ensembles end with the Python preprocess step"
            )
            options = dataclasses.replace(options, c_patchify=False)
        repository = render_repository(rendered / "model_repository", options, names=spec.models)
    return checked_repository_path(Path(repository).resolve())


def check_ports_free(host: str, ports: Ports) -> None:
    """ValueError naming the first port of ``ports`` something already listens on at ``host``."""
    for name, port in (("http", ports.http), ("grpc", ports.grpc), ("metrics", ports.metrics), ("probe", ports.probe)):
        if port is None:
            continue
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError as exc:
                raise ValueError(f"--{name}-port {port} on {host}: {exc.strerror}") from None


def describe_listeners(host: str, ports: Ports, access: AccessPolicy, key_file: Path | None) -> str:
    """One line: where each port listens, what is restricted, where the key is."""
    listening = f"HTTP {host}:{ports.http}, gRPC {host}:{ports.grpc}, metrics {host}:{ports.metrics}"
    if ports.probe is not None:
        listening += f", probes {host}:{ports.probe}"
    key = f"admin key in {key_file}" if key_file is not None else "admin key: the operator's"
    return f"listening on {listening}; {access.describe()}; {key}"


def describe_cache(cache_bytes: int) -> str:
    """The response cache in a few words, for the start line."""
    return f"response cache {cache_bytes / (1 << 20):g} MiB" if cache_bytes else "no response cache"
