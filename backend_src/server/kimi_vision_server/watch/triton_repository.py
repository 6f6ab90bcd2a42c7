"""The few HTTP endpoints of tritonserver that the stub watchdog calls (its repository API, health
and, on the metrics port, the requests a model's backend failed), and the version folders whose
mtime makes a ``load`` start a new version of a model.

tritonserver loads a model whose version folder is newer than at its last load as a new version,
in the background while the old one serves (docs/faults.md, "Recovery").

**Backend failures** (:meth:`TritonRepository.backend_failures`), the watchdog's sign that the
Python backend gave up on a request to a stub that did not answer: the metrics port's
``nv_inference_request_failure{model, version, reason="BACKEND"}``, summed over the versions.
Triton's core counts a failed request under one reason: ``REJECTED`` (its queue's timeout),
``CANCELED`` (the client went away while it queued), ``OTHER`` (checks before execution) or
``BACKEND`` (the backend reported it failed). The Python backend (its ``python_be.cc`` from 24.10
to 25.10, tritonserver 2.51 here and the Docker images) reports a request failed only where its
``ProcessRequests`` returned an error: the stub did not answer within its health check (``Stub
process '<instance>' is not healthy``), or the request could not be put in the stub's shared
memory. An error a model instance answered itself (a refused image, a busy decoder, an internal
error: :mod:`.contract` answers them all) is a *success* to it, since its ``PbMetricReporter``
gets no responses to look at. Measured on a two-instance ``kimi_k25_decode`` of ``kimi-prep
serve``: 5 refused images left every failure count at 0 (``kimi_prep_errors_total`` 5); 22
requests whose queue timeout expired and 22 whose client deadline passed raised the statistics
API's ``inference_stats.fail.count`` by 44 and ``BACKEND`` by none; one request sent to a stub
frozen in its cgroup raised ``BACKEND`` by 1. So neither the statistics' fail count (queue
timeouts and cancellations count there) nor that count less ``kimi_prep_errors_total`` (the
errors it holds are not in the fail count at all, so the difference would hide a failed stub) is
the sign; ``BACKEND`` is. It is per model, not per instance: another instance's "not healthy"
counts too, but that instance does not answer either, and a reload replaces every stub of the model.
"""

from __future__ import annotations

import json
import os
import re
import time
import urllib.error
import urllib.request
from pathlib import Path

READY = "READY"
UNLOADED = "UNLOADED"  # an operator's explicit unload (Triton: UNAVAILABLE, reason "unloaded")
# Triton's counter of failed requests, one sample per model, version and reason (module docstring).
FAILURES = "nv_inference_request_failure"
BACKEND_REASON = "BACKEND"
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


class RepositoryError(RuntimeError):
    """A repository API call of tritonserver failed or timed out."""


def _state(entry: dict[str, str]) -> str:
    state = entry.get("state", "UNAVAILABLE")
    return UNLOADED if state == "UNAVAILABLE" and entry.get("reason") == "unloaded" else state


class TritonRepository:
    """The few HTTP endpoints of tritonserver the watchdog needs: ``http_url``'s and ``metrics_url``'s
    (``host:port``); ``headers`` go with its repository calls (the admin key of the restricted
    repository API, :mod:`.access`)."""

    def __init__(
        self, http_url: str, metrics_url: str, load_timeout_s: float = 600.0, headers: dict[str, str] | None = None
    ) -> None:
        self.base = f"http://{http_url}/v2"
        self.metrics = f"http://{metrics_url}/metrics"
        self.load_timeout_s = load_timeout_s
        self.headers = dict(headers or {})

    def _post(self, path: str, timeout_s: float) -> bytes:
        return self._fetch(
            urllib.request.Request(f"{self.base}{path}", data=b"{}", method="POST", headers=self.headers),
            f"POST {path}",
            timeout_s,
        )

    @staticmethod
    def _fetch(request: urllib.request.Request, what: str, timeout_s: float) -> bytes:
        """The body of ``request``'s answer; RepositoryError naming ``what`` where it failed."""
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                return response.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")
            raise RepositoryError(f"{what}: HTTP {exc.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise RepositoryError(f"{what}: {exc}") from None

    def index(self) -> list[dict[str, str]]:
        """tritonserver's repository index: ``name``, ``state`` and ``reason`` of every model."""
        return list(json.loads(self._post("/repository/index", timeout_s=10) or b"[]"))

    def model_states(self) -> dict[str, str]:
        """``{model: state}`` of every model in the repository (READY, LOADING, UNLOADING, UNAVAILABLE;
        UNLOADED for one an operator unloaded through the repository API)."""
        return {entry["name"]: _state(entry) for entry in self.index()}

    def backend_failures(self, model: str) -> int:
        """How many requests of ``model`` its backend has failed so far (the module's docstring); a
        stub's "not healthy" answers count there, answers a model instance gave do not."""
        text = self._fetch(urllib.request.Request(self.metrics), f"GET {self.metrics}", timeout_s=10)
        failures = backend_failures_in(text.decode(errors="replace"), model)
        if failures is None:
            raise RepositoryError(f"{self.metrics} has no {FAILURES} of {model} with reason {BACKEND_REASON}")
        return failures

    def server_ready(self) -> bool:
        return self._health("ready")

    def server_live(self) -> bool:
        return self._health("live")

    def _health(self, which: str) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base}/health/{which}", timeout=5) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def unload(self, model: str) -> None:
        self._post(f"/repository/models/{model}/unload", timeout_s=60)

    def load(self, model: str) -> None:
        self._post(f"/repository/models/{model}/load", timeout_s=self.load_timeout_s)

    def wait_not_ready(self, model: str, timeout_s: float = 60.0) -> None:
        """Until ``model`` left ``READY`` (its unload began)."""
        deadline = time.monotonic() + timeout_s
        while self.model_states().get(model) == READY:
            if time.monotonic() > deadline:
                raise RepositoryError(f"{model} still READY {timeout_s:g} s after its unload")
            time.sleep(0.05)


def backend_failures_in(metrics: str, model: str) -> int | None:
    """The ``reason="BACKEND"`` samples of :data:`FAILURES` for ``model`` in tritonserver's
    Prometheus text, summed over its versions; None where there is none (metrics off, or the model
    not loaded)."""
    samples = [
        float(value.split()[0])
        for labels, value in _samples(metrics, FAILURES)
        if labels.get("model") == model and labels.get("reason") == BACKEND_REASON
    ]
    return int(sum(samples)) if samples else None


def _samples(metrics: str, family: str) -> list[tuple[dict[str, str], str]]:
    """(labels, the rest of the line) of each sample of ``family`` in a Prometheus text."""
    prefix = family + "{"
    found = []
    for line in metrics.splitlines():
        if line.startswith(prefix):
            labels, _, value = line[len(prefix) :].rpartition("} ")
            found.append((dict(_LABEL.findall(labels)), value))
    return found


def version_folders(model_folder: Path) -> list[Path]:
    """The version folders (``1``, ``2``, ...) of a model folder of the repository."""
    return sorted(p for p in model_folder.iterdir() if p.is_dir() and p.name.isdigit())


def mark_changed(folders: list[Path]) -> None:
    """Set each folder's mtime later than it was and than now: tritonserver loads a model whose
    version folder is newer than at its last load as a new version."""
    for folder in folders:
        mtime = max(time.time_ns(), folder.stat().st_mtime_ns + 1_000_000_000)  # a 1 s clock too
        os.utime(folder, ns=(mtime, mtime))
