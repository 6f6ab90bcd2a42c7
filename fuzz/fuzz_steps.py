#!/usr/bin/env python3
"""Fuzz the step models' request parsers: the C step's ``kimi_check_images`` (through ctypes, with
its kernels run on what it accepts) and the Python steps' ``decoded_from_inputs`` /
``check_request_size``, and the config-parameter parsers (``decoder_settings``).

Inputs are built, not mutated bytes: K, the IMAGE_SHAPES rows (tiled, aliased, gapped, overlapping,
negative, huge, wrapping products), IMAGE's length, dtypes and ranks, MODE and RESAMPLE rows, STORED_SIZES,
and parameter strings. The rules (:func:`check_case`):

- the C verdict is OK, InvalidRequestError or ImageTooLargeError, and the Python one a
  ``PreprocessError`` subclass or a result: nothing else escapes, nothing crashes;
- whatever either accepts tiles IMAGE exactly (image k at the sum of the sizes before it, the
  last ending at L) and stays within ``max_images_per_request`` and ``max_patches_per_request``;
- on the same RGB rows, the C and Python layout verdicts agree (accepted or not);
- the C kernels write every accepted image into a buffer of exactly the accepted patch count.

    python fuzz/fuzz_steps.py --seconds 60                   # `make fuzz` runs it longer
    python fuzz/fuzz_steps.py --library /tmp/asan.so ...     # the C step built with sanitizers

Exit status 0: no finding (findings are printed with the case's seed, which replays it).
"""

from __future__ import annotations

import argparse
import ctypes
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kimi_vision_common.errors import ImageTooLargeError, InvalidPresetError, InvalidRequestError, PreprocessError
from kimi_vision_common.sizing import navit_patch_bound
from kimi_vision_prep import PRESETS
from kimi_vision_server.models.config import decoder_settings
from kimi_vision_server.models.requests import check_request_size, decoded_from_inputs
from kimi_vision_server.triton_install import patchify_library

CHECK_CODES = {0: None, 1: InvalidRequestError, 2: ImageTooLargeError}
MAX_IMAGES = 16
I64 = ctypes.POINTER(ctypes.c_int64)


class Limits(ctypes.Structure):
    """``Limits`` of the C step (``models/patchify/kimi_patchify.h``), in its order."""

    _fields_ = [(name, ctypes.c_int64) for name in (
        "patch_size", "factor", "side_limit", "image_patches", "max_images", "max_patches"
    )]  # fmt: skip


class Image(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("height", "width", "offset", "grid_h", "grid_w", "patches")]


def load_library(path: Path | None = None) -> ctypes.CDLL:
    library = ctypes.CDLL(str(path or patchify_library()))
    library.kimi_check_images.restype = ctypes.c_int
    library.kimi_check_images.argtypes = [
        ctypes.POINTER(Limits), I64, ctypes.c_int64, ctypes.c_int64, ctypes.POINTER(Image),
        ctypes.POINTER(ctypes.c_size_t), ctypes.c_char_p, ctypes.c_size_t,
    ]  # fmt: skip
    u8, f32, size = ctypes.POINTER(ctypes.c_uint8), ctypes.POINTER(ctypes.c_float), ctypes.c_size_t
    library.kimi_write_patches_u8.argtypes = [u8, size, size, u8, size, size, size]
    library.kimi_write_patches_f32.argtypes = [u8, size, size, f32, f32, size, size, size]
    return library


@dataclass
class Case:
    """One built request to a step model."""

    preset: str
    rows: np.ndarray  # int64 (K, 4), or another dtype/rank to probe the Python checks
    length: int
    modes: list[bytes]
    resample: np.ndarray
    stored: np.ndarray | None
    max_patches: int


def tiled_rows(rng: random.Random, k: int, side: int) -> list[list[int]]:
    rows, offset = [], 0
    for _ in range(k):
        h, w = rng.randint(1, side), rng.randint(1, side)
        rows.append([h, w, 3, offset])
        offset += h * w * 3
    return rows


def build_case(rng: random.Random) -> Case:
    """A request: a tiled layout, then zero or more structural mutations."""
    preset = rng.choice(sorted(PRESETS))
    k = rng.choice([1, 1, 2, 3, 5, MAX_IMAGES, MAX_IMAGES + 1, 0])
    rows = tiled_rows(rng, max(k, 0), rng.choice([4, 40, 300]))
    length = sum(r[0] * r[1] * r[2] for r in rows)
    for _ in range(rng.randint(0, 3)):
        if not rows:
            break
        row = rng.choice(rows)
        move = rng.randrange(9)
        if move == 0:
            row[3] = 0  # alias the first image
        elif move == 1:
            row[3] += rng.choice([-1, 1, 3, -row[3] - 1])  # overlap, gap, negative
        elif move == 2:
            length += rng.choice([-1, 1, 17, -length])  # bytes short, left over, none
        elif move == 3:
            row[rng.randrange(3)] = rng.choice([0, -1, 1 << 31, 1 << 40, (1 << 62) + 1])
        elif move == 4:
            row[2] = rng.choice([1, 4])
        elif move == 5:
            rows.append(list(row))  # a duplicate row: aliasing by repetition
        elif move == 6:
            rows.reverse()
        elif move == 7:
            row[0], row[1] = 7168 + rng.randint(0, 64), rng.randint(1, 3)  # a side past the limit
        else:
            rng.shuffle(rows)
    table = np.array(rows, np.int64).reshape(-1, 4)
    modes = [rng.choice([b"RGB", b"RGB", b"RGBA", b"L", b"\xff", b"P transparency=3"]) for _ in rows]
    resample = np.array([rng.choice([0, 0, 1, 7]) for _ in rows], np.uint8)
    stored = None
    if rng.random() < 0.3:
        stored = np.array([[max(r[0], 1), max(r[1], 1)] for r in rows], np.int64).reshape(-1, 2)
    budget = navit_patch_bound(PRESETS[preset]) if rng.random() < 0.7 else rng.randint(1, 600)
    return Case(preset, table, max(length, 0), modes, resample, stored, budget)


def c_limits(case: Case) -> Limits:
    preset = PRESETS[case.preset]
    p = preset.patch_size
    return Limits(p, p * preset.merge_kernel_size, preset.patch_limit_on_one_side, navit_patch_bound(preset),
                  MAX_IMAGES, case.max_patches)  # fmt: skip


def tiles(rows: np.ndarray, length: int) -> bool:
    expected = 0
    for h, w, c, offset in rows.tolist():
        if min(h, w, c) < 1 or offset != expected:
            return False
        expected += h * w * c
    return expected == length


def c_verdict(library: ctypes.CDLL, case: Case) -> tuple[type | None, int, list[Image]]:
    rows = np.ascontiguousarray(case.rows, np.int64)
    k = len(rows)
    images = (Image * max(k, 1))()
    total = ctypes.c_size_t(0)
    message = ctypes.create_string_buffer(1024)
    code = library.kimi_check_images(
        ctypes.byref(c_limits(case)), rows.ctypes.data_as(I64), k, case.length, images, ctypes.byref(total),
        message, len(message),
    )  # fmt: skip
    if code not in CHECK_CODES:
        raise AssertionError(f"kimi_check_images returned {code}")
    if code and not message.value:
        raise AssertionError("a refusal without a message")
    return CHECK_CODES[code], total.value, list(images[:k])


def run_kernels(library: ctypes.CDLL, case: Case, images: list[Image], total: int) -> None:
    """The C kernels on an accepted request, into buffers of exactly ``total`` patches."""
    p = PRESETS[case.preset].patch_size
    flat = np.random.default_rng(case.length).integers(0, 256, case.length, np.uint8)
    u8 = np.empty((total, 3, p, p), np.uint8)
    f32 = np.empty((total, 3, p, p), np.float32)
    tables = np.zeros((3, 256), np.float32)
    row = 0
    for image in images:
        pixels = flat[image.offset :].ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        end = row + image.patches
        if end > total:
            raise AssertionError("the accepted images need more patches than the total")
        out = u8[row:end].ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        library.kimi_write_patches_u8(pixels, image.height, image.width, out, image.grid_h, image.grid_w, p)
        out32 = f32[row:end].ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        table = tables.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        library.kimi_write_patches_f32(pixels, image.height, image.width, table, out32, image.grid_h, image.grid_w, p)
        row = end
    if row != total:
        raise AssertionError(f"the images hold {row} patches, the total says {total}")


def python_verdict(case: Case) -> type | None:
    image = np.zeros((1, case.length), np.uint8)
    mode = np.array([case.modes], dtype=np.object_)
    stored = None if case.stored is None else case.stored[None]
    try:
        decoded = decoded_from_inputs(image, case.rows[None], mode, case.resample[None], stored, PRESETS[case.preset])
        check_request_size(decoded, PRESETS[case.preset], MAX_IMAGES, case.max_patches)
    except PreprocessError as exc:
        return type(exc)
    return None


def check_case(library: ctypes.CDLL, case: Case) -> None:
    """The rules of the module docstring for one case; AssertionError on a violation."""
    c_error, total, images = c_verdict(library, case)
    python_error = python_verdict(case)
    rgb = len(case.rows) and all(row[2] == 3 for row in case.rows.tolist())
    for who, error in (("C", c_error), ("Python", python_error)):
        if error is None:
            if not tiles(case.rows, case.length):
                raise AssertionError(f"{who} accepted a layout that does not tile IMAGE: {case.rows.tolist()}")
            if len(case.rows) > MAX_IMAGES:
                raise AssertionError(f"{who} accepted {len(case.rows)} images")
    if c_error is None:
        if total > case.max_patches:
            raise AssertionError(f"C accepted {total} patches over {case.max_patches}")
        run_kernels(library, case, images, total)
    if rgb and not tiles(case.rows, case.length) and c_error is None:
        raise AssertionError("C accepted a layout Python's tiling rule refuses")


def check_parameters(rng: random.Random) -> None:
    """Parameter strings: a setting or InvalidPresetError, nothing else."""
    values = ["0", "1", "-3", "16", " 8 ", "1e3", "0x10", "", "yes", "9" * 30, "\x00", "NaN", "２"]
    keys = ["max_images_per_request", "max_patches_per_request", "cpu_decode_threads", "max_pixels", "strict_decode"]
    parameters = {key: rng.choice(values) for key in rng.sample(keys, rng.randint(1, len(keys)))}
    try:
        decoder_settings(parameters)
    except InvalidPresetError:
        pass


def fuzz(library: ctypes.CDLL, seconds: float, seed: int) -> tuple[int, list[str]]:
    """Cases until ``seconds`` pass (at least 200); the case count and the findings."""
    findings: list[str] = []
    deadline, count = time.monotonic() + seconds, 0
    while count < 200 or time.monotonic() < deadline:
        case_seed = seed + count
        rng = random.Random(case_seed)
        try:
            check_case(library, build_case(rng))
            check_parameters(rng)
        except Exception as exc:  # a finding: report it with the seed that replays it
            findings.append(f"seed {case_seed}: {type(exc).__name__}: {exc}")
        count += 1
    return count, findings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--library", type=Path, default=None, help="the C step to load (default: the built one)")
    args = parser.parse_args(argv)
    count, findings = fuzz(load_library(args.library), args.seconds, args.seed)
    for finding in findings[:20]:
        print(finding, file=sys.stderr)
    print(f"fuzz_steps: {count} cases, {len(findings)} findings")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
