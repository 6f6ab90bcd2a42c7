"""What the host has (CPU cores, GPUs): the serving layout and the nvImageCodec extensions that fit it.

nvImageCodec loads every extension it finds when it is imported; on a host without CUDA the GPU
ones (nvJPEG, nvJPEG2000, nvTIFF) each print red ``[ERROR] ... Failed to load`` lines. The
launcher (for the Python stubs) and the CLI (for itself) point ``NVIMGCODEC_EXTENSIONS_PATH`` at a
folder holding only the CPU extensions on such a host, through :func:`codec_env`; the library
itself never sets the environment.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path

# The wheel's extensions that need CUDA libraries (the others run on the CPU).
GPU_EXTENSIONS = re.compile(r"^lib(nvjpeg|nvjpeg2k|nvtiff)_ext\.so")


def cuda_device_count() -> int:
    """NVIDIA GPUs the kernel exposes (``/dev/nvidiaN``), without loading CUDA or NVML."""
    return sum(1 for path in Path("/dev").glob("nvidia*") if re.fullmatch(r"nvidia\d+", path.name))


def nvimgcodec_extensions() -> Path | None:
    """The extensions folder of the installed nvImageCodec wheel (found without importing it:
    importing loads every extension)."""
    spec = importlib.util.find_spec("nvidia.nvimgcodec")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations))) / "extensions"
    return folder if folder.is_dir() else None


def codec_env(cache: Path) -> dict[str, str]:
    """``{"NVIMGCODEC_EXTENSIONS_PATH": <cache>/nvimgcodec-cpu}`` on a host without GPUs (the folder
    links the wheel's CPU extensions), else nothing; an operator's own setting wins."""
    source = nvimgcodec_extensions()
    if cuda_device_count() or source is None or "NVIMGCODEC_EXTENSIONS_PATH" in os.environ:
        return {}
    folder = cache / "nvimgcodec-cpu"
    folder.mkdir(parents=True, exist_ok=True)
    for extension in source.iterdir():
        link = folder / extension.name
        if not GPU_EXTENSIONS.match(extension.name) and not link.exists():
            with contextlib.suppress(FileExistsError):  # another launcher made it first
                link.symlink_to(extension)
    return {"NVIMGCODEC_EXTENSIONS_PATH": str(folder)}


# The defaults `kimi-prep serve` renders for the host it starts on (flags override each).
MAX_CPU_INSTANCES = 16  # each instance is a stub process (~150-250 MB): caps memory on big hosts
MAX_GPU_THREADS = 4  # CPU threads per GPU instance (Pillow routes, nvImageCodec's CPU stages)


@dataclass(frozen=True)
class HostLayout:
    """Instances per model, CPU threads per instance and the instance kind for ``cores`` CPU cores
    and ``gpus`` GPUs (see :func:`host_layout` for the formula)."""

    cores: int
    gpus: int
    instances: int
    threads: int
    kind: str

    def describe(self) -> str:
        per = "per GPU" if self.kind == "gpu" else "per model"
        return (
            f"host: {self.cores} CPU cores, {self.gpus} GPUs -> {self.instances} instance(s) {per} x "
            f"{self.threads} thread(s), KIND_{self.kind.upper()}"
        )


CGROUP = Path("/sys/fs/cgroup")


def cpu_quota_cores(cgroup: Path = CGROUP) -> int | None:
    """The CPU limit of this process's cgroup in whole cores, rounded up (a Kubernetes container's
    ``limits.cpu``: cgroup v2's ``cpu.max``, v1's ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``);
    None where there is none or it cannot be read."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        quota, period = (cgroup / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else max(1, -(-int(quota) // int(period)))
    with contextlib.suppress(OSError, ValueError):
        quota_us = int((cgroup / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((cgroup / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota_us <= 0 else max(1, -(-quota_us // period_us))
    return None


def available_cores(cgroup: Path = CGROUP) -> int:
    """The cores this process may use: those it may run on (its affinity), no more than its
    cgroup's CPU limit. ``os.cpu_count()`` counts the whole machine, so a pod limited to 8 CPUs on
    a 64-core node would run 64 threads in 8 CPUs' time."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cpu_quota_cores(cgroup)
    return max(1, min(cores, quota) if quota else cores)


def host_layout(cores: int | None = None, gpus: int | None = None) -> HostLayout:
    """The serving layout for a host (``None``: this one's :func:`available_cores` / :func:`cuda_device_count`).

    CPU-only: instances x threads = cores, 1 thread an instance up to 4 cores and 2 above (several
    processes beat threads in one on small hosts: on 2 cores 2 instances x 1 thread served best;
    a third instance served the uint8 wire 10% faster but took the hostile load over its memory
    bound, BENCHMARKS.md's "Decisions not kept"), at most :data:`MAX_CPU_INSTANCES` instances.
    With GPUs: KIND_GPU, one instance per GPU (Triton's count is per device) and the cores shared
    out, at most :data:`MAX_GPU_THREADS` threads each; provisional until the served GPU check
    measures HBM per instance (tests/gpu/README.md).
    """
    cores = max(1, cores if cores is not None else available_cores())
    gpus = cuda_device_count() if gpus is None else gpus
    if gpus:
        return HostLayout(cores, gpus, 1, max(1, min(MAX_GPU_THREADS, cores // gpus)), "gpu")
    threads = 1 if cores <= 4 else 2
    return HostLayout(cores, 0, max(1, min(MAX_CPU_INSTANCES, cores // threads)), threads, "cpu")
