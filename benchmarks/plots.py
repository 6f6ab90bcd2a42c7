"""The benchmarks' PNG plots: one figure's axes, saved and closed (matplotlib's Agg backend: no display)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def saved_axes(path: Path, figsize: tuple[float, float]) -> Iterator[Any]:
    """The axes of a new ``figsize`` figure; written to ``path`` (110 dpi) when the block exits."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=figsize)
    try:
        yield ax
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
