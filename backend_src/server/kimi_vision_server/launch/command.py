"""tritonserver's command line and its output: the ports, the flags a launch passes (:func:`server_args`),
the repository path its Python backend can start a stub under, where a generated admin key is kept,
and the log relay of ``kimi-prep serve`` (:func:`relay_log`: on a CPU-only host the CUDA noise dropped).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from kimi_vision_common.wire import DEFAULT_GRPC_PORT, DEFAULT_HTTP_PORT, DEFAULT_METRICS_PORT

from ..host import cuda_device_count
from ..triton_install import TritonInstall, cache_root
from .access import AccessPolicy, access_args

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
