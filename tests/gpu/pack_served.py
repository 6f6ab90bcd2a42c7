"""Pack what the served GPU check needs on the device machine into ``tests/gpu/served/`` (git-ignored).

The device machine (Python 3.12, torch, numpy 2, grpcio, protobuf; no network, no tritonserver, no
nvImageCodec) gets the work tree plus the carried paths, at most 64 MiB in all. Two xz tarballs
(15.5 + 23.9 MiB at preset 9e; the dry run's preset 6: 15.7 + 25.7). With the work tree (the test
corpus included) they no longer fit one run together, so they travel in two runs on the same warm
machine, one tarball each (``run_device_checks.sh served`` unpacks what it is given and runs the
check once both are unpacked); each run must fit on its own:

* ``site.tar.xz``: the Python packages, unpacked
  from their cp312 wheels and trimmed: numpy 1.26 (the 2.51 stub needs numpy < 2, so it goes
  first on the stubs' and the check's path), nvImageCodec cu13 (this interpreter's binding, the
  nvJPEG and libjpeg-turbo extensions only), nvJPEG, Pillow 13 (without AVIF and FreeType),
  simplejpeg, tritonclient (pure Python; its gRPC needs the machine's grpcio and protobuf), and
  ``kimi_libjpeg/_libjpeg.cpython-312-x86_64-linux-gnu.so``: the library's libjpeg extension built
  here for CPython 3.12 (gcc and a 3.12 interpreter's headers; the machine has neither libjpeg's
  headers nor this build), which ``run_device_checks.sh`` copies into the machine's
  ``backend_src/kimi_vision_prep/``: the exact GPU route (``coefficients-cuda``) reads coefficients
  with it, and without it every JPEG goes to Pillow. The library checks (``run_device_checks.sh
  library``) carry the same tarball and drop its numpy (they use the machine's numpy 2).
* ``tritonserver.tar.xz``: ``nvidia-pytriton``'s
  tritonserver laid out as the launcher expects it (``pytriton/tritonserver/bin``, the Python
  backend, the 3.12 stub, ``nvidia_pytriton.libs`` without libpython 3.13), an empty
  ``pytriton/__init__.py`` (the launcher only needs the folder).

    .venv/bin/python tests/gpu/pack_served.py [--out tests/gpu/served] [--preset 9]

Prints the sizes and exits 1 when a run (the work tree and one tarball) would carry more than
:data:`DEVICE_LIMIT_BYTES`.
``run_device_checks.sh --dry-run`` runs it at ``--preset 6`` (a minute instead of three; its
archives are larger, so a pass there is a pass at 9e), so ``make test`` checks layout and size.
"""

from __future__ import annotations

import argparse
import lzma
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEVICE_LIMIT_BYTES = 64 << 20  # work tree + carried paths, per run
SITE_WHEELS = (
    "numpy==1.26.4",
    "nvidia-nvimgcodec-cu13==0.9.0.20",
    "nvidia-nvjpeg==13.0.4.44",
    "pillow==13.0.0",
    "simplejpeg==1.9.0",
)
PURE_WHEELS = ("tritonclient==2.51.0",)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
STUB_PYTHON = "3.12"
LIBJPEG_EXTENSION = "_libjpeg.cpython-312-x86_64-linux-gnu.so"  # under kimi_libjpeg/ in site.tar.xz
# nvImageCodec parts the served check does not load: other interpreters' bindings, codecs it never meets.
NVIMGCODEC_UNUSED = ("nvimgcodec_impl.cpython-", "libopencv_ext", "libnvjpeg2k_ext", "libnvtiff_ext", "libtiff_ext")
# Pillow parts nothing here loads: AVIF and FreeType (with the libraries only they need; the
# library's formats stay), ~2 MiB of the carry.
PILLOW_UNUSED = ("_avif.", "_imagingft.", "libavif-", "libfreetype-", "libharfbuzz-", "libpng16-", "libbrotli")


def download(wheels: tuple[str, ...], dest: Path, pure: bool) -> list[Path]:
    """cp312 manylinux wheels (or pure-Python ones) of ``wheels`` into ``dest``."""
    target = ["--platform", "any"] if pure else [f"--platform={p}" for p in PLATFORMS]
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(dest)]
    command += ["--python-version", STUB_PYTHON, "--implementation", "cp", *target, *wheels]
    subprocess.run(command, check=True)
    names = [w.split("==")[0].replace("-", "_").lower() for w in wheels]
    return sorted(p for p in dest.glob("*.whl") if p.name.lower().split("-")[0] in names)


def unpack_site(wheels: list[Path], site: Path) -> None:
    """Unzip the wheels into one site folder (what ``pip install --target`` does for these) and trim."""
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(site)
    tag = f"cpython-{STUB_PYTHON.replace('.', '')}-"
    for path in (site / "nvidia" / "nvimgcodec").rglob("*"):
        unused = any(path.name.startswith(prefix) for prefix in NVIMGCODEC_UNUSED) and tag not in path.name
        if path.is_file() and unused:
            path.unlink()
    for path in [*(site / "PIL").iterdir(), *(site / "pillow.libs").iterdir()]:
        if path.name.startswith(PILLOW_UNUSED):
            path.unlink()
    unused_dirs = [*site.glob("*.dist-info"), *site.rglob("__pycache__"), *(site / "numpy").rglob("tests")]
    for path in unused_dirs:
        shutil.rmtree(path, ignore_errors=True)


def python312() -> str:
    """A CPython 3.12 here (``PYTHON312``, ``python3.12`` or pyenv's), for its headers."""
    candidates = [os.environ.get("PYTHON312", ""), "python3.12"]
    pyenv = shutil.which("pyenv") and subprocess.run(["pyenv", "root"], capture_output=True, text=True, check=False)
    if pyenv and pyenv.returncode == 0:
        candidates += sorted(str(p) for p in Path(pyenv.stdout.strip()).glob("versions/3.12*/bin/python3.12"))
    for candidate in filter(None, candidates):
        probe = [candidate, "-c", "import sys; assert sys.version_info[:2] == (3, 12)"]
        if shutil.which(candidate) and subprocess.run(probe, capture_output=True, check=False).returncode == 0:
            return candidate
    raise SystemExit("no CPython 3.12 here (set PYTHON312): the libjpeg extension for the machine needs its headers")


def build_libjpeg(dest: Path) -> Path:
    """The library's ``_libjpeg`` extension for CPython 3.12 (setup.py's C files; it binds Pillow's
    libjpeg at run time, so no libjpeg headers or library are needed) as ``dest/kimi_libjpeg/``."""
    include = subprocess.run(
        [python312(), "-c", "import sysconfig; print(sysconfig.get_paths()['include'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    sources = sorted(str(p) for p in (ROOT / "backend_src/kimi_vision_prep/decode/libjpeg").glob("*.c"))
    target = dest / "kimi_libjpeg" / LIBJPEG_EXTENSION
    target.parent.mkdir(parents=True, exist_ok=True)
    command = ["gcc", "-shared", "-fPIC", "-O2", "-std=c11", f"-I{include}", *sources, "-ldl", "-lpthread"]
    subprocess.run([*command, "-o", str(target)], check=True)
    return target


def layout_tritonserver(dest: Path) -> None:
    """The slim tritonserver tree of the installed ``nvidia-pytriton`` under ``dest``."""
    import importlib.util

    spec = importlib.util.find_spec("pytriton")
    if spec is None or spec.origin is None:
        raise SystemExit("nvidia-pytriton is not installed (make setup)")
    source = Path(spec.origin).parent
    server = source / "tritonserver"
    files = {
        "pytriton/tritonserver/bin/tritonserver": server / "bin" / "tritonserver",
        "pytriton/tritonserver/backends/python/libtriton_python.so": server / "backends/python/libtriton_python.so",
        "pytriton/tritonserver/backends/python/triton_python_backend_utils.py": server
        / "backends/python/triton_python_backend_utils.py",
        f"pytriton/tritonserver/python_backend_stubs/{STUB_PYTHON}/triton_python_backend_stub": server
        / "python_backend_stubs"
        / STUB_PYTHON
        / "triton_python_backend_stub",
    }
    for lib in (source.parent / "nvidia_pytriton.libs").iterdir():
        if not lib.name.startswith("libpython3"):  # the stub loads the machine's libpython3.12
            files[f"nvidia_pytriton.libs/{lib.name}"] = lib
    for name, path in files.items():
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, dest / name)
    (dest / "pytriton" / "__init__.py").write_text('"""nvidia-pytriton\'s tritonserver, slimmed."""\n')


def compress(folder: Path, archive: Path, preset: int) -> int:
    """``folder``'s contents as ``archive`` (tar, xz ``preset``, 9 meaning 9e); returns its size in bytes."""
    archive.parent.mkdir(parents=True, exist_ok=True)
    level = preset | lzma.PRESET_EXTREME if preset == 9 else preset
    with lzma.open(archive, "wb", preset=level) as raw, tarfile.open(fileobj=raw, mode="w") as tar:
        for path in sorted(folder.iterdir()):
            tar.add(path, arcname=path.name)
    return archive.stat().st_size


def work_tree_bytes() -> int:
    """What travels besides the carry: tracked and untracked-not-ignored files."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, check=True, capture_output=True,
    ).stdout  # fmt: skip
    return sum((ROOT / name).stat().st_size for name in listed.decode().split("\0") if name and (ROOT / name).is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "tests" / "gpu" / "served")
    parser.add_argument("--preset", type=int, default=9, choices=range(10), help="xz preset (9: 9e)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        downloads, site, server = Path(tmp) / "wheels", Path(tmp) / "site", Path(tmp) / "tritonserver"
        wheels = download(SITE_WHEELS, downloads, pure=False) + download(PURE_WHEELS, downloads, pure=True)
        unpack_site(wheels, site)
        build_libjpeg(site)
        layout_tritonserver(server)
        sizes = {name: compress(folder, args.out / name, args.preset)
                 for name, folder in (("site.tar.xz", site), ("tritonserver.tar.xz", server))}  # fmt: skip
    tree = work_tree_bytes()
    print(f"work tree {tree / 2**20:.1f} MiB")
    over = False
    for name, size in sizes.items():
        total = tree + size
        over |= total > DEVICE_LIMIT_BYTES
        verdict = "over" if total > DEVICE_LIMIT_BYTES else "fits"
        carried = f"tests/gpu/served/{name} ({size / 2**20:.1f} MiB)"
        print(f"run carrying {carried}: {total / 2**20:.1f} of 64 MiB, {verdict}")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
