"""What an optional extra brings, asked for before any work: a call that needs torch in an
install without it fails at once, naming the extra (``pip install 'kimi-vision-prep[torch]'``)."""

from __future__ import annotations

import importlib.util

TORCH_EXTRA = "pip install 'kimi-vision-prep[torch]'"


def require_torch(what: str) -> None:
    """Raise ModuleNotFoundError (``name="torch"``) saying that ``what`` needs torch and how to get it."""
    if importlib.util.find_spec("torch") is None:
        raise ModuleNotFoundError(f"{what} needs torch, which this install lacks: {TORCH_EXTRA}", name="torch")
