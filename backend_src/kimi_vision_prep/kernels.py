"""One dispatch point per op: kernels registered by the array type they take.

As in torchvision's ``transforms.v2.functional`` (``_utils._KERNEL_REGISTRY``), a public op
(``resize``, ``composite_on_chessboard``, ``write_patches``, ``patchify``, ``expand_patches``)
looks up the kernel for the type of its first argument; every kernel takes and returns that type
with the same dtypes as its twins. Types are keyed by qualified name (``"numpy.ndarray"``,
``"torch.Tensor"``, ``"PIL.Image.Image"``), so registering the torch kernels imports no torch:
torch loads only when a tensor arrives. The table is filled at import and never changes after.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

KernelT = TypeVar("KernelT", bound=Callable[..., Any])

NUMPY = "numpy.ndarray"
TORCH = "torch.Tensor"
PIL_IMAGE = "PIL.Image.Image"

_KERNELS: dict[str, dict[str, Callable[..., Any]]] = {}


def type_key(cls: type) -> str:
    """``"module.QualName"`` of a class: the registry key of the arrays of that class."""
    return f"{cls.__module__}.{cls.__qualname__}"


def register_kernel(op: str, array_type: str) -> Callable[[KernelT], KernelT]:
    """Decorator: the kernel of ``op`` for arrays of ``array_type`` (a :func:`type_key`)."""

    def register(kernel: KernelT) -> KernelT:
        kernels = _KERNELS.setdefault(op, {})
        if array_type in kernels:
            raise ValueError(f"{op} already has a kernel for {array_type}")
        kernels[array_type] = kernel
        return kernel

    return register


def get_kernel(op: str, value: Any) -> Callable[..., Any]:
    """The kernel of ``op`` for ``value``'s type or its nearest registered base class."""
    kernels = _KERNELS[op]
    for cls in type(value).__mro__:
        kernel = kernels.get(type_key(cls))
        if kernel is not None:
            return kernel
    raise TypeError(f"{op} takes {' or '.join(kernels)}, got {type_key(type(value))}")
