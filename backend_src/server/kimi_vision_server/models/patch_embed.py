"""The chaining example's patch embedding: a seeded ``Conv2d(3, hidden, kernel=p, stride=p)``.

Weights are PyTorch's default ``Conv2d`` initialisation drawn right after ``torch.manual_seed(seed)``
(seed 0 in the shipped config), i.e. exactly what this produces in any process::

    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 1152, kernel_size=14, stride=14)

The global RNG state of the caller is restored afterwards. It stands in for MoonViT's patch
embedding to show the ensemble feeding ``pixel_values`` into a model without a host round trip.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def make_patch_embed(
    seed: int = 0, hidden_size: int = 1152, patch_size: int = 14, device: str = "cpu"
) -> torch.nn.Conv2d:
    """``Conv2d(3, hidden_size, patch_size, stride=patch_size)`` with seeded default init, in eval mode."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        conv = torch.nn.Conv2d(3, hidden_size, kernel_size=patch_size, stride=patch_size)
    return conv.to(device).eval().requires_grad_(False)


def embed_patches(conv: torch.nn.Conv2d, pixel_values: torch.Tensor) -> torch.Tensor:
    """float32 ``(N, 3, p, p)`` -> float32 ``(N, hidden_size)`` (one output position per patch)."""
    import torch

    with torch.inference_mode():
        return conv(pixel_values).flatten(1)
