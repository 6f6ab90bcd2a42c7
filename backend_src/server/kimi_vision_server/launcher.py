"""Run ``tritonserver`` on a model repository, one start path for ``kimi-prep serve`` and tests.

:func:`launch` is that path: stale shared-memory regions removed, the repository rendered from the
presets when :class:`~.repository.RenderOptions` are given (never edited as text), tritonserver
started in its own process group with a SIGTERM-on-parent-death, and next to it a
:class:`~.watchdog.StubWatchdog` (a dead Python-backend stub gets its model reloaded) and, given a
probe port, a :class:`~.probes.ProbeServer` (``/livez``, ``/readyz``, ``/metrics``). Everything it
starts is stopped, in reverse order, when its ``ExitStack`` closes.

- :func:`serve`: the foreground server of ``kimi-prep serve``; forwards SIGINT/SIGTERM, returns the exit code.
- :class:`EmbeddedServer`: a context manager on free ports, ready when entered (tests, embedding).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from kimi_vision_common.wire import DEFAULT_GRPC_PORT, DEFAULT_HTTP_PORT, DEFAULT_METRICS_PORT, is_loopback

from .access import LOOPBACK_HOST, AccessPolicy, access_args, generated_key, redacted, write_key_file
from .allocator import describe_server_allocator
from .host import cuda_device_count
from .render.blocks import SERVING_DEFAULTS
from .render.repository import RenderOptions, render_repository
from .shm_regions import remove_shm_regions, remove_stale_shm_regions, shm_region_prefix
from .triton_install import TritonInstall, cache_root, default_model_repository, find_tritonserver, patchify_library
from .watch.probes import ProbeServer
from .watch.stub_scan import StubProcess, end_process, stub_processes, stubs_in_group
from .watch.triton_repository import RepositoryError
from .watch.watchdog import StubWatchdog

# One FP32 PIXEL_VALUES of a 1920x1080 image is ~25 MiB, K3's largest ~145 MiB: start each stub's
# shared-memory pool large enough for typical images and grow it in big steps.
SHM_DEFAULT_BYTES = 64 << 20
SHM_GROWTH_BYTES = 64 << 20
STUB_TIMEOUT_S = 120
# gRPC request/response objects tritonserver keeps for reuse (its default: 8). A kept response keeps
# the capacity of its largest output (37 MiB of float32 pixel_values), so 8 of them held ~650 MiB
# more at concurrency 16 than 1 does, for the same perf_analyzer throughput (BENCHMARKS.md's history).
GRPC_INFER_POOL_SIZE = 1
PR_SET_PDEATHSIG = 1  # linux/prctl.h
log = logging.getLogger(__name__)
# On a host without GPUs: tritonserver flags that keep it from trying CUDA where it can (no pinned
# host pool, no GPU metrics: no NVML/DCGM), and the lines it prints anyway, which the log relay of
# `kimi-prep serve` drops (said once instead). Every other line, errors included, is relayed.
CPU_ONLY_ARGS = ("--pinned-memory-pool-byte-size=0", "--allow-gpu-metrics=false")
CPU_ONLY_NOISE = (
    re.compile(r'"CudaDriverHelper has not been initialized\."'),
    re.compile(r'"unable to create stream for \S+: CUDA driver version is insufficient for CUDA runtime version"'),
    # The launcher turns the pinned pool off on a host without CUDA (CPU_ONLY_ARGS): nothing to warn about.
    re.compile(r'"failed to allocate pinned system memory: no pinned memory pool'),
)
CPU_ONLY_NOTICE = (
    b"kimi-prep: CPU-only host: CUDA and pinned memory disabled (tritonserver's messages about them are not shown)\n"
)


@dataclass(frozen=True)
class Ports:
    http: int = DEFAULT_HTTP_PORT
    grpc: int = DEFAULT_GRPC_PORT
    metrics: int = DEFAULT_METRICS_PORT
    probe: int | None = None


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

    ports: Ports = Ports()
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
class ServerStop:
    """How a launched server's stop ended, once its launch's stack has closed: the exit code of
    :func:`stop_process` (0 also for a server ended while waiting only on pinned versions)."""

    exit_code: int | None = None

    def stop(self, watchdog: StubWatchdog) -> None:
        """Stop the server ``watchdog`` runs now (it stood down first: nothing starts it again)."""
        process = watchdog.process
        self.exit_code = stop_process(process, pinned=watchdog.pinned_versions)
        end_left_in_group(process.pid)


def end_left_in_group(pgid: int) -> list[StubProcess]:
    """SIGKILL the stubs still in an exited server's process group (its pgid is its pid:
    :func:`_server_process_setup`); those stubs. A stub exits once it sees its server gone, unless
    its health thread blocks first: the Python backend's stub stops its queue monitors under a
    lock held by a thread that waits for the dead server to take a log message, and then sleeps
    for good (seen after a server was killed: an orphan holding 150 MiB)."""
    left = [stub for stub in stubs_in_group(pgid) if not stub.zombie]
    for stub in left:
        log.warning("ending %s (pid %d): a stub left running after tritonserver exited", stub.instance, stub.pid)
        end_process(stub.pid)
    return left


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


def _load_prctl() -> Any:
    """libc's prctl, resolved in the parent (nothing may be loaded between fork and exec)."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_prctl = _load_prctl()


def _server_process_setup() -> None:
    """In the forked child: own process group (a terminal's Ctrl-C reaches tritonserver once, through
    the launcher, not twice) and SIGTERM when the launcher dies (no orphaned servers on a shared host).
    The signal follows the thread that started the server: for a server the watchdog started again,
    the watchdog's thread, which ends only when the server is being stopped anyway."""
    os.setpgrp()
    if _prctl is not None:
        _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def admin_key_path(http_port: int) -> Path:
    """Where a generated admin key is kept: ``$XDG_RUNTIME_DIR/kimi-prep/`` (else the cache's
    ``run/``), one file per HTTP port, readable by its owner only."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    folder = Path(runtime) / "kimi-prep" if runtime else cache_root() / "run"
    return folder / f"admin-key-{http_port}"


def server_args(
    install: TritonInstall,
    model_repository: Path,
    ports: Ports,
    access: AccessPolicy,
    *,
    extra_args: Sequence[str] = (),
    shm_prefix: str = "kimi_prep_",
    cache_bytes: int = 0,
) -> list[str]:
    """Command line: explicit model control loading every model, the listeners and restricted APIs
    of ``access``, Python backend shm sized for big outputs, a small gRPC response pool, a response
    cache of ``cache_bytes`` (0: none); ``extra_args`` last (a repeated flag: the last one wins)."""
    args = [
        str(install.binary),
        f"--model-repository={model_repository}",
        "--model-control-mode=explicit",
        "--load-model=*",
        # A model that fails to load is reported (ready_line) while the others serve.
        "--exit-on-error=false",
        # The rendered configs are complete: without this flag the Python backend starts a stub of
        # its own for every model load only to ask it for config changes, 1.4 s of a stub's reload
        # after a crash (docs/faults.md).
        "--disable-auto-complete-config",
        f"--http-port={ports.http}",
        f"--grpc-port={ports.grpc}",
        f"--metrics-port={ports.metrics}",
        *access_args(access),
        f"--grpc-infer-allocation-pool-size={GRPC_INFER_POOL_SIZE}",
        f"--backend-config=python,shm-default-byte-size={SHM_DEFAULT_BYTES}",
        f"--backend-config=python,shm-growth-byte-size={SHM_GROWTH_BYTES}",
        f"--backend-config=python,stub-timeout-seconds={STUB_TIMEOUT_S}",
        # Regions get a UUID suffix anyway; the prefix makes leftovers of a killed server identifiable.
        f"--backend-config=python,shm-region-prefix-name={shm_prefix}",
    ]
    if install.backend_directory is not None:
        args.append(f"--backend-directory={install.backend_directory}")
    if cache_bytes:
        if install.cache_directory is not None:
            args.append(f"--cache-directory={install.cache_directory}")
        args.append(f"--cache-config=local,size={cache_bytes}")
    if not cuda_device_count():
        args.extend(CPU_ONLY_ARGS)
    return [*args, *extra_args]


# tritonserver's info lines ("I1203 12:00:00.000000 42 file.cc:12] ...") and the tables it prints
# at start: shown with --verbose only; its warnings and errors (W, E) always.
INFO_LINE = re.compile(r"^I\d{4} ")
TABLE_LINE = re.compile(r"^(\+[-+]*\+|\|.*\|)\s*$|^\s*$")


def relay_log(source: IO[bytes], sink: IO[bytes], drop: Sequence[re.Pattern[str]], *, verbose: bool = False) -> None:
    """Copy tritonserver's output line by line, dropping lines that match ``drop`` (saying so once)
    and, unless ``verbose``, its info lines and start-up tables."""
    noticed = False
    for line in iter(source.readline, b""):
        text = line.decode(errors="replace")
        if any(pattern.search(text) for pattern in drop):
            if not noticed:
                sink.write(CPU_ONLY_NOTICE)
                noticed = True
            continue
        if not verbose and (INFO_LINE.match(text) or TABLE_LINE.match(text)):
            continue
        sink.write(line)
        sink.flush()


# A stopping server that has run no stub this long (its requests done, its Python models unloaded)
# is waiting only for what never unloads.
PINNED_ONLY_AFTER_S = 2.0


def wait_stopping(
    process: subprocess.Popen[bytes], timeout_s: float | None, pinned: Callable[[], list[str]] = list
) -> int:
    """Wait for a server that was asked to stop; its exit code, or -9 after SIGKILL at ``timeout_s``
    (None: no limit but tritonserver's own).

    tritonserver stops by waiting for in-flight requests, then unloading every model, up to its
    exit timeout (30 s), and exits with code 1 when a version never unloads. A version pinned by a
    request that reached a crashed stub never does (``pinned()``: its models, from the watchdog;
    docs/faults.md). Once the server has run no stub for :data:`PINNED_ONLY_AFTER_S` (every
    request done, every Python model unloaded), waiting on for those is pointless: it is ended and
    counts as stopped (0)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    stubless_since: float | None = None
    while process.poll() is None:
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            process.kill()
            break
        models = pinned()
        if models and not stub_processes(process.pid):
            stubless_since = stubless_since or now
            if now - stubless_since >= PINNED_ONLY_AFTER_S:
                log.info(
                    "tritonserver has stopped serving and would wait its exit timeout for the version of %s "
                    "that a crashed stub pinned (docs/faults.md): ending it",
                    ", ".join(models),
                )
                process.kill()
                process.wait()
                return 0
        else:
            stubless_since = None
        time.sleep(0.25)
    return process.wait()


def stop_process(
    process: subprocess.Popen[bytes], timeout_s: float = 60.0, pinned: Callable[[], list[str]] = list
) -> int:
    """SIGINT (a clean shutdown that unloads the models), then :func:`wait_stopping`; the exit code."""
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        return wait_stopping(process, timeout_s, pinned)
    return process.returncode


# tritonserver 2.51's Python backend starts each stub through `bash -c` with the model's path
# unquoted: under a path with a space or a shell character no stub starts, and the server only
# times out (seen with a folder named "64 MiB (default)").
SAFE_REPOSITORY_PATH = re.compile(r"[\w./@%+=:,-]+")


def checked_repository_path(repository: Path) -> Path:
    """``repository``, or ValueError where its path would keep every Python stub from starting."""
    if not SAFE_REPOSITORY_PATH.fullmatch(str(repository)):
        raise ValueError(
            f"model repository {str(repository)!r}: tritonserver's Python backend cannot start a stub "
            "under a path with spaces or shell characters; serve it from a path of letters, digits and ._-/"
        )
    return repository


def launch(stack: contextlib.ExitStack, spec: LaunchSpec) -> Launched:
    """Start a server as ``spec`` says; closing ``stack`` stops it and removes what it left."""
    install = find_tritonserver()
    log.debug("%s", describe_server_allocator(install.env))
    for region in remove_stale_shm_regions():
        log.info("removed stale shared-memory region /dev/shm/%s", region)
    shm_prefix = shm_region_prefix()
    stack.callback(remove_shm_regions, shm_prefix)
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
    repository = checked_repository_path(Path(repository).resolve())
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
            preexec_fn=_server_process_setup,  # noqa: PLW1509  (async-signal-safe calls only)
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


def ready_lines(index: Sequence[dict[str, str]], host: str, ports: Ports) -> list[str]:
    """What ``kimi-prep serve`` says once every model has loaded or failed: one line with the
    models and the URLs, then one line per model that failed to load, with tritonserver's reason."""
    ready = [m["name"] for m in index if m.get("state") == "READY"]
    failed = [m for m in index if m.get("state") != "READY"]
    urls = f"HTTP http://{host}:{ports.http}, gRPC {host}:{ports.grpc}, metrics http://{host}:{ports.metrics}/metrics"
    if ports.probe is not None:
        urls += f", probes http://{host}:{ports.probe}/readyz"
    lines = [f"kimi-prep: ready: {len(ready)} of {len(index)} models ({', '.join(ready)}) at {urls}"]
    lines += [
        f"kimi-prep: not serving {m['name']}: {m.get('reason') or m.get('state') or 'not loaded'}" for m in failed
    ]
    return lines


def announce_ready(launched: Launched, host: str, out: IO[str]) -> None:
    """Wait until tritonserver answers (it opens its ports once every model has loaded or failed),
    then write :func:`ready_lines`; nothing if the server exits first."""
    while launched.process.poll() is None:
        try:
            index = launched.watchdog.repository.index()
        except (RepositoryError, ValueError):
            time.sleep(0.2)
            continue
        if index and all(m.get("state") in ("READY", "UNAVAILABLE") for m in index):
            out.write("\n".join(ready_lines(index, host, launched.ports)) + "\n")
            out.flush()
            return
        time.sleep(0.2)


def _log_to_stderr() -> None:
    """The watchdog's recoveries on stderr, next to tritonserver's log (unless the caller set up logging)."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s kimi-prep %(levelname)s %(name)s: %(message)s")


def exit_status(code: int) -> int:
    """A Popen return code as a shell reports it: 128 + N for a process killed by signal N."""
    return code if code >= 0 else 128 - code


def serve(spec: LaunchSpec) -> int:
    """Run tritonserver in the foreground until SIGINT/SIGTERM, or until it exits cleanly or fails
    to start (one that dies once it served is started again by the watchdog); returns its exit
    status (128 + N where a signal N ended it).

    The handlers are in place before the server starts: a signal that arrives while it starts
    is held and forwarded as soon as there is a process to forward it to."""
    _log_to_stderr()
    held: list[int] = []
    started: list[Launched] = []
    stopping = threading.Event()

    def forward(signum: int, _frame: Any) -> None:
        if not started:
            held.append(signum)
            return
        started[0].watchdog.stand_down()  # a shutdown on purpose: its stub exits are no faults
        started[0].process.send_signal(signum)
        stopping.set()

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with contextlib.ExitStack() as stack:
            launched = launch(stack, spec)
            started.append(launched)
            if held:
                forward(held[0], None)
            threading.Thread(target=announce_ready, args=(launched, spec.host, sys.stderr), daemon=True).start()
            # A server that exits by itself is started again by the watchdog, unless it exited
            # cleanly (code 0: a signal sent to tritonserver itself), which ends the launcher too.
            while not stopping.wait(0.5) and (launched.process.poll() is None or launched.watchdog.watching()):
                pass
            return exit_status(wait_stopping(launched.process, None, launched.watchdog.pinned_versions))
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
