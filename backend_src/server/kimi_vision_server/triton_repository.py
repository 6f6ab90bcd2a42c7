"""The few HTTP endpoints of tritonserver that the stub watchdog calls (its repository API, health
and a model's failed requests), and the version folders whose mtime makes a ``load`` start a new
version of a model.

tritonserver loads a model whose version folder is newer than at its last load as a new version,
in the background while the old one serves (docs/faults.md, "Recovery").
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from pathlib import Path

READY = "READY"
UNLOADED = "UNLOADED"  # an operator's explicit unload (Triton: UNAVAILABLE, reason "unloaded")


class RepositoryError(RuntimeError):
    """A repository API call of tritonserver failed or timed out."""


def _state(entry: dict[str, str]) -> str:
    state = entry.get("state", "UNAVAILABLE")
    return UNLOADED if state == "UNAVAILABLE" and entry.get("reason") == "unloaded" else state


class TritonRepository:
    """The few HTTP endpoints of tritonserver the watchdog needs; ``headers`` go with every call
    (the admin key of the restricted repository API, :mod:`.access`)."""

    def __init__(self, http_url: str, load_timeout_s: float = 600.0, headers: dict[str, str] | None = None) -> None:
        self.base = f"http://{http_url}/v2"
        self.load_timeout_s = load_timeout_s
        self.headers = dict(headers or {})

    def _post(self, path: str, timeout_s: float) -> bytes:
        return self._call("POST", path, timeout_s)

    def _call(self, method: str, path: str, timeout_s: float) -> bytes:
        data = b"{}" if method == "POST" else None
        request = urllib.request.Request(f"{self.base}{path}", data=data, method=method, headers=self.headers)
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                return response.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")
            raise RepositoryError(f"{method} {path}: HTTP {exc.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise RepositoryError(f"{method} {path}: {exc}") from None

    def index(self) -> list[dict[str, str]]:
        """tritonserver's repository index: ``name``, ``state`` and ``reason`` of every model."""
        return list(json.loads(self._post("/repository/index", timeout_s=10) or b"[]"))

    def model_states(self) -> dict[str, str]:
        """``{model: state}`` of every model in the repository (READY, LOADING, UNLOADING, UNAVAILABLE;
        UNLOADED for one an operator unloaded through the repository API)."""
        return {entry["name"]: _state(entry) for entry in self.index()}

    def failed_requests(self, model: str) -> int:
        """How many requests of ``model`` have failed so far (``inference_stats.fail.count`` of its
        versions' statistics): a stub's "not healthy" answers count there."""
        body = json.loads(self._call("GET", f"/models/{model}/stats", timeout_s=10))
        return sum(int(stats["inference_stats"]["fail"]["count"]) for stats in body.get("model_stats", []))

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


def version_folders(model_folder: Path) -> list[Path]:
    """The version folders (``1``, ``2``, ...) of a model folder of the repository."""
    return sorted(p for p in model_folder.iterdir() if p.is_dir() and p.name.isdigit())


def mark_changed(folders: list[Path]) -> None:
    """Set each folder's mtime later than it was and than now: tritonserver loads a model whose
    version folder is newer than at its last load as a new version."""
    for folder in folders:
        mtime = max(time.time_ns(), folder.stat().st_mtime_ns + 1_000_000_000)  # a 1 s clock too
        os.utime(folder, ns=(mtime, mtime))
