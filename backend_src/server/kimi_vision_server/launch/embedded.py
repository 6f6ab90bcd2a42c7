"""A tritonserver for tests, benchmarks and ``kimi-prep demo``: started through the same
:func:`~.launcher.launch` as ``kimi-prep serve``, on given or free ports, ready when ``start``
returns, stopped with everything it started."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from ..render.blocks import RenderOptions
from ..triton_install import default_model_repository
from ..watch.watchdog import StubWatchdog
from .access import LOOPBACK_HOST
from .command import Ports
from .launcher import Launched, LaunchSpec, launch


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

    ``render`` / ``models`` serve a rendering from the presets (:class:`~.repository.RenderOptions`,
    a model selection), else ``model_repository`` (default: the checked-in one) as it is. The server's log goes to
    ``log_path`` (kept), else into a temp dir (removed by :meth:`stop`). Ready means
    ``/v2/health/ready`` and every model of the repository ready. ``probe_port`` serves the
    watchdog's probes (``probe_url``). ``response_cache_bytes``: Triton's response cache (0, the
    default here: none, so that a test or benchmark repeating a request measures the models).
    """

    def __init__(
        self,
        model_repository: Path | None = None,
        *,
        render: RenderOptions | None = None,
        models: Sequence[str] | None = None,
        http_port: int | None = None,
        grpc_port: int | None = None,
        metrics_port: int | None = None,
        probe_port: int | None = None,
        extra_args: Sequence[str] = (),
        startup_timeout_s: float = 300.0,
        log_path: Path | None = None,
        host: str = LOOPBACK_HOST,
        admin_key: str | None = None,
        open_apis: Sequence[str] = (),
        response_cache_bytes: int = 0,
    ) -> None:
        self.model_repository = model_repository
        self.render = render
        self.models = tuple(models) if models is not None else None
        self.ports = Ports(http_port or free_port(), grpc_port or free_port(), metrics_port or free_port(), probe_port)
        self.extra_args = tuple(extra_args)
        self.host = host
        self.admin_key = admin_key
        self.open_apis = tuple(open_apis)
        self.response_cache_bytes = response_cache_bytes
        self.startup_timeout_s = startup_timeout_s
        self._kept_log_path = Path(log_path) if log_path is not None else None
        self.log_path: Path | None = self._kept_log_path
        self.launched: Launched | None = None
        self.shm_prefix: str | None = None  # the last start's (kept after stop: what it left is checkable)
        self._stack = contextlib.ExitStack()

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.ports.http}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.ports.grpc}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.metrics}/metrics"

    @property
    def probe_url(self) -> str:
        """``http://127.0.0.1:<probe_port>`` (``/livez``, ``/readyz``, ``/metrics``)."""
        if self.ports.probe is None:
            raise ValueError("started without a probe_port")
        return f"http://127.0.0.1:{self.ports.probe}"

    def admin_headers(self, protocol: str = "http") -> dict[str, str]:
        """The header that opens the restricted APIs of the running server over ``protocol`` (:mod:`.access`)."""
        if self.launched is None:
            raise ValueError("not started")
        return self.launched.access.headers(protocol)

    @property
    def process(self) -> subprocess.Popen[bytes] | None:
        return self.launched.process if self.launched else None

    @property
    def watchdog(self) -> StubWatchdog | None:
        return self.launched.watchdog if self.launched else None

    @property
    def repository(self) -> Path:
        if self.launched:
            return self.launched.repository
        return Path(self.model_repository or default_model_repository() or "model_repository")

    def process_tree(self) -> list[int]:
        """tritonserver's pid and every process below it (its stubs): what a memory measurement sums."""
        if self.process is None:
            return []
        tree, stack = [], [self.process.pid]
        while stack:
            current = stack.pop()
            tree.append(current)
            for task in Path(f"/proc/{current}/task").iterdir():
                stack += [int(child) for child in (task / "children").read_text().split()]
        return tree

    @property
    def model_names(self) -> list[str]:
        return sorted(p.parent.name for p in self.repository.glob("*/config.pbtxt"))

    def log_tail(self, chars: int = 6000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")[-chars:]

    def start(self) -> EmbeddedServer:
        try:
            if self._kept_log_path is None:
                workdir = Path(self._stack.enter_context(tempfile.TemporaryDirectory(prefix="kimi_prep_triton.")))
                self.log_path = workdir / "tritonserver.log"
            assert self.log_path is not None
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            log_file = self._stack.enter_context(self.log_path.open("wb"))
            spec = LaunchSpec(
                self.ports, self.model_repository, self.render, self.models, self.extra_args, log_file,
                self.host, self.admin_key, self.open_apis, response_cache_bytes=self.response_cache_bytes,
            )  # fmt: skip
            self.launched = launch(self._stack, spec)
            self.shm_prefix = self.launched.shm_prefix
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
            process = self.process
            if process is None or process.poll() is not None:
                code = None if process is None else process.returncode
                raise RuntimeError(f"tritonserver exited with code {code} during startup:\n{self.log_tail()}")
            if self.is_ready():
                return
            time.sleep(0.5)
        raise TimeoutError(f"tritonserver not ready after {self.startup_timeout_s:g} s:\n{self.log_tail()}")

    def stop(self) -> int | None:
        """Watchdog and probes off, then the server (SIGINT, SIGKILL after 60 s; ended at once when
        it waits only on versions a crashed stub pinned), then the shared memory it left; returns
        its exit code, 0 in that case (None if it never started)."""
        launched = self.launched
        self._stack.close()
        self._stack = contextlib.ExitStack()
        self.launched = None
        return None if launched is None else launched.stopped.exit_code

    def __enter__(self) -> EmbeddedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
