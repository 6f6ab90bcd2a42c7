"""Run ``tritonserver`` on the model repository: the NGC one on PATH, else the embedded one.

On an NGC Triton container ``tritonserver`` is on PATH with its own backends. Elsewhere the PyPI
wheel ``nvidia-pytriton`` ships tritonserver 2.51 with the Python backend (it runs on CPU); its
backend directory is laid out once in a cache dir (``$XDG_CACHE_HOME/kimi_vision_prep/triton`` or
``~/.cache/kimi_vision_prep/triton``) with the Python stub matching the running interpreter, and
the environment is set so that stub loads this interpreter's libpython and this venv's packages.

- :func:`serve`: foreground server for ``kimi-prep serve``; forwards SIGINT/SIGTERM, returns the exit code.
- :class:`EmbeddedServer`: context manager on free ports for tests and embedding.
- :func:`render_repository`: a copy of the repository with instance counts substituted.

Both run a :class:`~.watchdog.StubWatchdog` next to the server (a dead Python-backend stub gets
its model reloaded) and, given a probe port, a :class:`~.probes.ProbeServer` (``/livez``,
``/readyz``, ``/metrics``). The Python backend's shared-memory regions carry the launcher's pid
and start time in their name (:func:`shm_region_prefix`): regions a killed server left behind are
removed when that server is stopped, and at every start for launchers that no longer run.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import itertools
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..allocator import allocator_env
from .probes import ProbeServer
from .watchdog import StubWatchdog, process_start_ticks

# One FP32 PIXEL_VALUES of a 1920x1080 image is ~25 MiB, K3's largest ~145 MiB: start each stub's
# shared-memory pool large enough for typical images and grow it in big steps.
SHM_DEFAULT_BYTES = 64 << 20
SHM_GROWTH_BYTES = 64 << 20
STUB_TIMEOUT_S = 120
PR_SET_PDEATHSIG = 1  # linux/prctl.h
SHM_DIR = Path("/dev/shm")
SHM_REGION_PREFIX = "kimi_prep_"
# kimi_prep_<launcher pid>-<its start time in ticks>-<server number>_<uuid the backend appends>
_OWNED_REGION = re.compile(rf"{SHM_REGION_PREFIX}(\d+)-(\d+)-\d+_")
_server_numbers = itertools.count()
PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # .../kimi_vision_prep


@dataclass(frozen=True)
class TritonInstall:
    """How to run a tritonserver: the binary, its ``--backend-directory`` (None: its default), env."""

    binary: Path
    backend_directory: Path | None
    env: dict[str, str]
    embedded: bool


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kimi_vision_prep" / "triton"


def default_model_repository() -> Path:
    """``model_repository/`` of the source checkout this package runs from, else ``./model_repository``."""
    checkout = PACKAGE_ROOT.parents[1] / "model_repository"
    return checkout if checkout.is_dir() else Path.cwd() / "model_repository"


def _python_path_env(env: dict[str, str]) -> None:
    """Let the stubs import this package and this venv's packages."""
    bin_dir = os.path.dirname(sys.executable)
    env["PATH"] = os.pathsep.join([bin_dir, env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PACKAGE_ROOT.parent), env.get("PYTHONPATH", "")) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")


def _layout_embedded_backends(pytriton_dir: Path) -> Path:
    """``<cache>/<version>/backends/python/`` with the backend library, utils and the matching stub."""
    version = f"py{sys.version_info.major}.{sys.version_info.minor}"
    stub = pytriton_dir / "tritonserver" / "python_backend_stubs" / version[2:] / "triton_python_backend_stub"
    if not stub.exists():
        raise RuntimeError(f"nvidia-pytriton has no Python backend stub for Python {version[2:]} ({stub})")
    source = pytriton_dir / "tritonserver" / "backends" / "python"
    files = {
        "libtriton_python.so": source / "libtriton_python.so",
        "triton_python_backend_utils.py": source / "triton_python_backend_utils.py",
        "triton_python_backend_stub": stub,
    }
    stamp = "|".join(f"{f}:{f.stat().st_size}:{int(f.stat().st_mtime)}" for f in files.values())
    backends = cache_dir() / f"{version}-{hashlib.sha256(stamp.encode()).hexdigest()[:12]}" / "backends"
    if (backends / "python" / "triton_python_backend_stub").exists():
        return backends
    backends.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="backends.", dir=backends.parent))
    (staging / "python").mkdir()
    for name, path in files.items():
        shutil.copy2(path, staging / "python" / name)
    try:
        staging.rename(backends)  # atomic: a concurrent launcher may have won the race
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
    return backends


def find_tritonserver() -> TritonInstall:
    """``tritonserver`` on PATH (NGC container), else the embedded one from ``nvidia-pytriton``."""
    # Big buffers stay on the heap in tritonserver and the stubs (allocator.py); operator values win.
    env = {**allocator_env(), **os.environ}
    _python_path_env(env)
    on_path = shutil.which("tritonserver", path=os.environ.get("PATH"))
    if on_path:
        return TritonInstall(Path(on_path), None, env, embedded=False)
    try:
        import pytriton
    except ImportError:
        raise RuntimeError(
            "no tritonserver on PATH and nvidia-pytriton is not installed: `pip install -e '.[serve]'` "
            "or run inside an NGC tritonserver container"
        ) from None
    pytriton_dir = Path(pytriton.__file__).resolve().parent
    binary = pytriton_dir / "tritonserver" / "bin" / "tritonserver"
    backends = _layout_embedded_backends(pytriton_dir)
    libs = [pytriton_dir.parent / "nvidia_pytriton.libs", Path(sysconfig.get_config_var("LIBDIR") or "")]
    # The stub would otherwise resolve the system libpython instead of this interpreter's.
    env["LD_LIBRARY_PATH"] = os.pathsep.join([*(str(p) for p in libs if str(p)), env.get("LD_LIBRARY_PATH", "")])
    return TritonInstall(binary, backends, env, embedded=True)


_COUNT = re.compile(r"(instance_group\s*\[\s*\{[^\]]*?\bcount\s*:\s*)\d+", re.S)


def _set_parameter(text: str, key: str, value: int) -> str:
    """``text`` (a config.pbtxt) with the integer parameter ``key`` set to ``value`` where present."""
    return re.sub(rf'(key: "{key}" value: {{ string_value: ")\d+(")', rf"\g<1>{value}\g<2>", text)


def render_repository(src: Path, dst: Path, instances: int | None = None, threads: int | None = None) -> Path:
    """Copy the repository ``src`` to ``dst``; with ``instances``, every ``instance_group`` count
    becomes it; with ``threads``, every ``numba_threads`` and ``decoder_threads`` parameter (the CPU
    threads of one instance's kernels and of its nvImageCodec decoder; 0: all cores).

    On a CPU-only host, instances x threads <= cores serves best: measured on 2 cores, 2 instances
    x 1 thread beat 1 instance x 2 threads and 2 x 2 (BENCHMARKS.md).
    """
    src, dst = Path(src), Path(dst)
    if instances is not None and instances < 1:
        raise ValueError(f"instances must be >= 1, got {instances}")
    if threads is not None and threads < 0:
        raise ValueError(f"threads must be >= 0, got {threads}")
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"), dirs_exist_ok=True)
    for config in dst.glob("*/config.pbtxt"):
        text = config.read_text()
        if instances is not None:
            text = _COUNT.sub(lambda m: f"{m.group(1)}{instances}", text)
        if threads is not None:
            text = _set_parameter(_set_parameter(text, "numba_threads", threads), "decoder_threads", threads)
        config.write_text(text)
    return dst


def _load_prctl() -> Any:
    """libc's prctl, resolved in the parent (nothing may be loaded between fork and exec)."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_prctl = _load_prctl()


def _server_process_setup() -> None:
    """In the forked child: own process group (a terminal's Ctrl-C reaches tritonserver once, through
    the launcher, not twice) and SIGTERM when the launcher dies (no orphaned servers on a shared host)."""
    os.setpgrp()
    if _prctl is not None:
        _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def server_args(  # noqa: PLR0917  (positional use in tests/test_deploy_files.py)
    install: TritonInstall,
    model_repository: Path,
    http_port: int,
    grpc_port: int,
    metrics_port: int,
    extra_args: Sequence[str] = (),
    shm_prefix: str = SHM_REGION_PREFIX,
) -> list[str]:
    """Command line: explicit model control loading every model, Python backend shm sized for big outputs."""
    args = [
        str(install.binary),
        f"--model-repository={model_repository}",
        "--model-control-mode=explicit",
        "--load-model=*",
        f"--http-port={http_port}",
        f"--grpc-port={grpc_port}",
        f"--metrics-port={metrics_port}",
        "--backend-config=python,shm-default-byte-size=" + str(SHM_DEFAULT_BYTES),
        "--backend-config=python,shm-growth-byte-size=" + str(SHM_GROWTH_BYTES),
        f"--backend-config=python,stub-timeout-seconds={STUB_TIMEOUT_S}",
        # Regions get a UUID suffix anyway; the prefix makes leftovers of a killed server identifiable.
        f"--backend-config=python,shm-region-prefix-name={shm_prefix}",
    ]
    if install.backend_directory is not None:
        args.append(f"--backend-directory={install.backend_directory}")
    return [*args, *extra_args]


def shm_region_prefix() -> str:
    """A region prefix naming this launcher (pid, start time) and a new server of it."""
    pid = os.getpid()
    return f"{SHM_REGION_PREFIX}{pid}-{process_start_ticks(pid) or 0}-{next(_server_numbers)}_"


def remove_shm_regions(prefix: str) -> list[str]:
    """Unlink the regions in ``/dev/shm`` named ``prefix*`` (those of one stopped server); their names."""
    removed = []
    for region in SHM_DIR.glob(f"{prefix}*"):
        with contextlib.suppress(FileNotFoundError):
            region.unlink()
            removed.append(region.name)
    return removed


def _owner_running(pid: int, start_ticks: int) -> bool:
    return process_start_ticks(pid) == start_ticks


def remove_stale_shm_regions() -> list[str]:
    """Unlink the regions whose launcher no longer runs (a killed server's leftovers); their names.

    Regions without an owner in their name (other prefixes, older launchers) are left alone.
    """
    removed = []
    for region in SHM_DIR.glob(f"{SHM_REGION_PREFIX}*"):
        owner = _OWNED_REGION.match(region.name)
        if owner and not _owner_running(int(owner[1]), int(owner[2])):
            with contextlib.suppress(FileNotFoundError):
                region.unlink()
                removed.append(region.name)
    return removed


@contextlib.contextmanager
def supervision(process: subprocess.Popen[bytes], http_port: int, probe_port: int | None) -> Iterator[StubWatchdog]:
    """The stub watchdog of a started server and, with ``probe_port``, its probe server."""
    with contextlib.ExitStack() as stack:
        watchdog = stack.enter_context(StubWatchdog(process, f"127.0.0.1:{http_port}"))
        if probe_port is not None:
            stack.enter_context(ProbeServer(watchdog, probe_port))
        yield watchdog


def _log_to_stderr() -> None:
    """The watchdog's recoveries on stderr, next to tritonserver's log (unless the caller set up logging)."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s kimi-prep %(levelname)s %(name)s: %(message)s")


def serve(  # noqa: PLR0917  (the `kimi-prep serve` contract)
    model_repository: Path | None = None,
    http_port: int = 8000,
    grpc_port: int = 8001,
    metrics_port: int = 8002,
    instances: int | None = None,
    extra_args: Sequence[str] = (),
    probe_port: int | None = None,
    threads: int | None = None,
) -> int:
    """Run tritonserver in the foreground until it exits or SIGINT/SIGTERM; returns its exit code.

    A stub watchdog reloads models whose Python stub died; ``probe_port`` serves ``/livez``,
    ``/readyz`` and the watchdog's ``/metrics``. ``instances`` / ``threads`` render a copy of the
    repository (:func:`render_repository`).
    """
    install = find_tritonserver()
    repository = Path(model_repository or default_model_repository()).resolve()
    _log_to_stderr()
    for region in remove_stale_shm_regions():
        logging.getLogger(__name__).info("removed stale shared-memory region /dev/shm/%s", region)
    shm_prefix = shm_region_prefix()
    with contextlib.ExitStack() as stack:
        stack.callback(remove_shm_regions, shm_prefix)
        if instances is not None or threads is not None:
            rendered = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kimi_prep_repo.")))
            repository = render_repository(repository, rendered / "model_repository", instances, threads)
        args = server_args(
            install,
            repository,
            http_port=http_port,
            grpc_port=grpc_port,
            metrics_port=metrics_port,
            extra_args=extra_args,
            shm_prefix=shm_prefix,
        )
        process = subprocess.Popen(args, env=install.env, preexec_fn=_server_process_setup)  # noqa: PLW1509

        def forward(signum: int, _frame: Any) -> None:
            process.send_signal(signum)

        previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            with supervision(process, http_port, probe_port):
                return process.wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if process.poll() is None:
                process.kill()
                process.wait()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


class EmbeddedServer:
    """A tritonserver subprocess on given or free ports, ready when ``__enter__`` returns.

    ``instances`` / ``threads`` render the repository into a temp dir (:func:`render_repository`). The server's log
    goes to ``log_path`` (kept), else into that temp dir (removed by :meth:`stop`). Readiness means
    ``/v2/health/ready`` and every model of the repository ready. ``watchdog`` reloads models whose
    stub died; ``probe_port`` serves its probes (``probe_url``).
    """

    def __init__(
        self,
        model_repository: Path | None = None,
        *,
        instances: int | None = None,
        threads: int | None = None,
        http_port: int | None = None,
        grpc_port: int | None = None,
        metrics_port: int | None = None,
        extra_args: Sequence[str] = (),
        startup_timeout_s: float = 300.0,
        log_path: Path | None = None,
        probe_port: int | None = None,
    ) -> None:
        self.source_repository = Path(model_repository or default_model_repository()).resolve()
        self.instances = instances
        self.threads = threads
        self.http_port = http_port or free_port()
        self.grpc_port = grpc_port or free_port()
        self.metrics_port = metrics_port or free_port()
        self.extra_args = tuple(extra_args)
        self.startup_timeout_s = startup_timeout_s
        self.process: subprocess.Popen[bytes] | None = None
        self._workdir: tempfile.TemporaryDirectory[str] | None = None
        self.repository = self.source_repository
        self._kept_log_path = Path(log_path) if log_path is not None else None
        self.log_path: Path | None = self._kept_log_path
        self.probe_port = probe_port
        self.shm_prefix = shm_region_prefix()
        self.watchdog: StubWatchdog | None = None
        self._supervision = contextlib.ExitStack()

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    @property
    def probe_url(self) -> str:
        """``http://127.0.0.1:<probe_port>`` (``/livez``, ``/readyz``, ``/metrics``)."""
        if self.probe_port is None:
            raise ValueError("started without a probe_port")
        return f"http://127.0.0.1:{self.probe_port}"

    @property
    def model_names(self) -> list[str]:
        return sorted(p.parent.name for p in self.repository.glob("*/config.pbtxt"))

    def log_tail(self, chars: int = 6000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")[-chars:]

    def start(self) -> EmbeddedServer:
        install = find_tritonserver()
        remove_stale_shm_regions()
        self._workdir = tempfile.TemporaryDirectory(prefix="kimi_prep_triton.")
        workdir = Path(self._workdir.name)
        if self.instances is not None or self.threads is not None:
            self.repository = render_repository(
                self.source_repository, workdir / "model_repository", self.instances, self.threads
            )
        self.log_path = self._kept_log_path or workdir / "tritonserver.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        args = server_args(
            install,
            self.repository,
            http_port=self.http_port,
            grpc_port=self.grpc_port,
            metrics_port=self.metrics_port,
            extra_args=self.extra_args,
            shm_prefix=self.shm_prefix,
        )
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                args,
                env=install.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=_server_process_setup,  # noqa: PLW1509  (async-signal-safe calls only)
            )
        try:
            self.watchdog = self._supervision.enter_context(supervision(self.process, self.http_port, self.probe_port))
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def is_ready(self) -> bool:
        base = f"http://{self.http_url}/v2"
        return _http_ok(f"{base}/health/ready") and all(
            _http_ok(f"{base}/models/{name}/ready") for name in self.model_names
        )

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                code = None if self.process is None else self.process.returncode
                raise RuntimeError(f"tritonserver exited with code {code} during startup:\n{self.log_tail()}")
            if self.is_ready():
                return
            time.sleep(0.5)
        raise TimeoutError(f"tritonserver not ready after {self.startup_timeout_s:g} s:\n{self.log_tail()}")

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """Watchdog and probes off, SIGINT (clean shutdown, unloads models), SIGKILL after ``timeout_s``;
        then the shared-memory regions a killed server left are removed."""
        code = None
        self._supervision.close()
        self.watchdog = None
        if self.process is not None:
            if self.process.poll() is None:
                self.process.send_signal(signal.SIGINT)
                try:
                    self.process.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait()
            code = self.process.returncode
            self.process = None
            remove_shm_regions(self.shm_prefix)
        if self._workdir is not None:
            self._workdir.cleanup()
            self._workdir = None
        return code

    def __enter__(self) -> EmbeddedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
