"""Who may call what on a served tritonserver: the listening address, the admin key, the restricted APIs.

tritonserver's own mechanism does the refusing: ``--http-restricted-api`` and
``--grpc-restricted-protocol`` make a request to a listed API carry the header
:data:`ADMIN_HEADER` with the key, else it is refused (HTTP 403 / gRPC UNAVAILABLE), before the
API runs. :func:`access_args` renders them from an :class:`AccessPolicy`:

- always restricted (:data:`ADMIN_APIS`): ``model-repository`` (load with a ``file:`` parameter
  runs the code it carries; unload takes models away), ``logging`` and ``trace`` (they write
  files and change what the server logs);
- ``shared-memory`` (a client makes the server read and write a region it names) is restricted
  too when the server listens beyond the loopback address, unless the operator opens it
  (``--open-api shared-memory``): on loopback only local processes reach it, and perf_analyzer
  ``--shared-memory system`` works with no key.

The key is the operator's (``--admin-key-file`` or :data:`ADMIN_KEY_ENV`; a Kubernetes Secret in
the manifest) or a random one per start, written to a file only its owner can read
(:func:`write_key_file`). The launcher's watchdog sends it with every repository call.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from kimi_vision_common.wire import ADMIN_HEADER, admin_headers, checked_key, is_loopback

ADMIN_APIS = ("model-repository", "logging", "trace")
SHARED_MEMORY_API = "shared-memory"
# The APIs an operator may open to anonymous clients (--open-api); the admin APIs stay behind the key.
OPENABLE_APIS = (SHARED_MEMORY_API,)
LOOPBACK_HOST = "127.0.0.1"


def generated_key() -> str:
    return secrets.token_urlsafe(32)


def write_key_file(key: str, path: Path) -> Path:
    """``path`` holding ``key``, readable by its owner only (its folder 0700, the file 0600)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.parent.chmod(0o700)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as file:
        file.write(key + "\n")
    path.chmod(0o600)
    return path


@dataclass(frozen=True)
class AccessPolicy:
    """Where the server listens and what anonymous clients may call.

    ``host``: the address HTTP, gRPC, metrics and probes bind to; ``key``: the admin key;
    ``open_apis``: APIs of :data:`OPENABLE_APIS` the operator opens to anonymous clients."""

    key: str
    host: str = LOOPBACK_HOST
    open_apis: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        unknown = sorted(set(self.open_apis) - set(OPENABLE_APIS))
        if unknown:
            raise ValueError(f"--open-api {', '.join(unknown)}: only {', '.join(OPENABLE_APIS)} can be opened")
        checked_key(self.key, "the policy")

    @property
    def restricted_apis(self) -> tuple[str, ...]:
        """The APIs that need the key: :data:`ADMIN_APIS`, and shared memory beyond loopback unless opened."""
        shm_open = is_loopback(self.host) or SHARED_MEMORY_API in self.open_apis
        return (*ADMIN_APIS, *(() if shm_open else (SHARED_MEMORY_API,)))

    def headers(self, protocol: str = "http") -> dict[str, str]:
        """The header a client sends to call a restricted API (:func:`admin_headers`)."""
        return admin_headers(self.key, protocol)

    @property
    def connect_host(self) -> str:
        """The address a client on this host reaches the listeners at (a wildcard bind: loopback)."""
        return LOOPBACK_HOST if self.host in ("0.0.0.0", "::", "") else self.host

    def describe(self) -> str:
        return f"APIs that need the {ADMIN_HEADER} header: {', '.join(self.restricted_apis)}"


def access_args(policy: AccessPolicy) -> list[str]:
    """tritonserver flags: every listener on ``policy.host``, the restricted APIs behind the key."""
    apis = ",".join(policy.restricted_apis)
    return [
        f"--http-address={policy.host}",
        f"--grpc-address={policy.host}",
        f"--metrics-address={policy.host}",
        f"--http-restricted-api={apis}:{ADMIN_HEADER}={policy.key}",
        f"--grpc-restricted-protocol={apis}:{ADMIN_HEADER}={policy.key}",
    ]


def redacted(args: Iterable[str], key: str) -> list[str]:
    """``args`` with the key replaced, for logs."""
    return [arg.replace(key, "***") for arg in args]
