"""What became of each input of ``kimi-prep infer`` / ``preprocess``: folders expanded, one line
per result or error, the npz in the processor's layout, and the exit code."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
from PIL import Image

from kimi_vision_common.errors import ModelNotServedError, PreprocessError, ServerUnavailableError
from kimi_vision_common.results import VideoChunkResult, concat_results
from kimi_vision_common.wire import NUM_TOKENS_DTYPE

EXIT_OK, EXIT_SOME_FAILED, EXIT_USAGE, EXIT_UNAVAILABLE = 0, 1, 2, 3


class ImageOutput(Protocol):
    """What both the library's ``PreprocessResult`` and ``VisionResult`` provide."""

    pixel_values: np.ndarray
    grid_thw: np.ndarray
    num_tokens: int


@dataclass
class Outcome:
    """One input file and what became of it: a result or the error it raised."""

    name: str
    result: ImageOutput | None = None
    error: Exception | None = None


VIDEO_SUFFIXES = frozenset({".mp4", ".mkv", ".webm", ".mov", ".avi", ".m4v"})


def image_suffixes() -> frozenset[str]:
    """File suffixes Pillow knows (``.jpg``, ``.png``, ...) and video containers': what a directory
    expands to."""
    Image.init()
    return frozenset(Image.registered_extensions()) | VIDEO_SUFFIXES


def expand_paths(paths: Sequence[Path]) -> list[Path]:
    """Files as given, directories replaced by their image files (recursive, sorted)."""
    suffixes = image_suffixes()
    expanded: list[Path] = []
    for path in paths:
        if path.is_dir():
            expanded.extend(sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in suffixes))
        else:
            expanded.append(path)
    return expanded


def grid_text(grid_thw: np.ndarray) -> str:
    return "x".join(str(int(v)) for v in grid_thw)


def summary_line(name: str, result: ImageOutput) -> str:
    """``name: [WxH -> new WxH, ]grid 1xHxW, T tokens, N patches[, decode path]`` (sizes and the
    decode path where the result knows them: an in-process ``PreprocessResult``)."""
    parts = []
    target, decode_path = getattr(result, "target", None), getattr(result, "decode_path", None)
    if target is not None:
        parts.append(f"{target.width}x{target.height} -> {target.new_width}x{target.new_height}")
    if isinstance(result, VideoChunkResult):
        parts.append(f"at {result.timestamp}, frames {','.join(map(str, result.frame_indices))}")
    parts += [f"grid {grid_text(result.grid_thw)}", f"{result.num_tokens} tokens"]
    parts.append(f"{len(result.pixel_values)} patches")
    if decode_path is not None:
        fallback = getattr(result, "fallback_reason", None)
        parts.append(decode_path + (f" (fallback: {fallback})" if fallback else ""))
    return f"{name}: " + ", ".join(parts)


def error_line(name: str, error: Exception) -> str:
    return f"{name}: error: {type(error).__name__}: {error}"


def write_npz(path: Path, outcomes: Sequence[Outcome], patch_size: int = 14) -> None:
    """Save the good results as the processor returns them.

    ``pixel_values`` float32 ``(ΣN, 3, p, p)``, ``grid_thws`` int64 ``(n, 3)``, ``num_tokens``
    int32 ``(n,)`` (as on the wire), ``names`` str ``(n,)``; failed images are left out.
    """
    good = [o for o in outcomes if o.result is not None]
    results = [o.result for o in good if o.result is not None]
    pixel_values, grid_thws = concat_results(results, patch_size)
    np.savez(
        path,
        pixel_values=pixel_values,
        grid_thws=grid_thws,
        num_tokens=np.array([r.num_tokens for r in results], dtype=NUM_TOKENS_DTYPE),
        names=np.array([o.name for o in good], dtype=np.str_),
    )


def report(outcomes: Sequence[Outcome], out: Path | None) -> int:
    """Write the npz (if asked), print an error count, and return the exit code: 0 when every input
    gave a result, 1 when some failed, 3 when none did because the server lacks what they need."""
    if out is not None:
        write_npz(out, outcomes)
    errors = [o.error for o in outcomes if o.error is not None]
    if not errors:
        return EXIT_OK
    print(f"{len(errors)} of {len(outcomes)} inputs failed", file=sys.stderr)
    unavailable = all(isinstance(e, (ServerUnavailableError, ModelNotServedError)) for e in errors)
    return EXIT_UNAVAILABLE if unavailable and len(errors) == len(outcomes) else EXIT_SOME_FAILED


def read_inputs(paths: Sequence[Path]) -> list[tuple[Outcome, bytes | None]]:
    """Each path's bytes, or an outcome already carrying the read error."""
    inputs: list[tuple[Outcome, bytes | None]] = []
    for path in paths:
        try:
            inputs.append((Outcome(str(path)), path.read_bytes()))
        except OSError as exc:
            inputs.append((Outcome(str(path), error=exc), None))
    return inputs


def print_outcome(outcome: Outcome, write_line: Callable[..., object] = print) -> None:
    """Summary on stdout or error on stderr; ``write_line`` is ``print`` or ``tqdm.write``."""
    if outcome.result is not None:
        write_line(summary_line(outcome.name, outcome.result), file=sys.stdout)
    elif outcome.error is not None:
        write_line(error_line(outcome.name, outcome.error), file=sys.stderr)


def outcome_of(name: str, result: ImageOutput | PreprocessError) -> Outcome:
    return Outcome(name, error=result) if isinstance(result, Exception) else Outcome(name, result=result)


def chunk_outcomes(name: str, chunks: Callable[[], Iterable[VideoChunkResult]], quiet: bool) -> list[Outcome]:
    """One outcome per chunk of a video (``name [chunk i]``), printed as each arrives, under a
    progress bar; an error ends the video with one error outcome."""
    from tqdm import tqdm

    outcomes = []
    with tqdm(desc=name, file=sys.stderr, unit="chunk", disable=quiet or not sys.stderr.isatty()) as progress:
        try:
            for index, chunk in enumerate(chunks()):
                outcome = Outcome(f"{name} [chunk {index}]", result=chunk)
                print_outcome(outcome, tqdm.write)
                outcomes.append(outcome)
                progress.update()
        except PreprocessError as exc:
            outcome = Outcome(name, error=exc)
            print_outcome(outcome, tqdm.write)
            outcomes.append(outcome)
    return outcomes
