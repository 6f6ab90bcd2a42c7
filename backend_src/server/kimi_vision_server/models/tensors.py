"""Tensors in and out of a Python-backend model: the DLPack hand-off between ensemble steps.

A host tensor is a numpy array; a GPU tensor (``FORCE_CPU_ONLY_INPUT_TENSORS: "no"`` on the
consumer) is wrapped as a torch tensor through DLPack, never copied to the host, and handed on
the same way. Each conversion is an op with a kernel per array type (:mod:`..kernels`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from kimi_vision_common.errors import InvalidRequestError
from kimi_vision_prep.kernels import NUMPY, TORCH, get_kernel, register_kernel

if TYPE_CHECKING:
    import torch


def input_array(pb_tensor: Any) -> Any:
    """A ``pb_utils.Tensor`` as a numpy array (host memory) or a torch tensor (GPU memory, no copy)."""
    if pb_tensor.is_cpu():
        return pb_tensor.as_numpy()
    import torch

    return torch.from_dlpack(pb_tensor.to_dlpack())


def output_tensor(pb_utils: Any, name: str, value: Any) -> Any:
    """``pb_utils.Tensor`` named ``name`` from a numpy array or a torch tensor (a CUDA tensor is
    handed over through DLPack, made contiguous first: the backend rejects strided DLPack
    tensors). Empty tensors are refused: the Python stub cannot pass them through an ensemble."""
    if 0 in tuple(value.shape):
        raise ValueError(f"output {name} would be empty (shape {tuple(value.shape)})")
    return get_kernel("output_tensor", value)(pb_utils, name, value)


@register_kernel("output_tensor", NUMPY)
def _numpy_output(pb_utils: Any, name: str, value: np.ndarray) -> Any:
    return pb_utils.Tensor(name, np.ascontiguousarray(value))


@register_kernel("output_tensor", TORCH)
def _torch_output(pb_utils: Any, name: str, value: torch.Tensor) -> Any:
    if value.device.type == "cpu":
        return pb_utils.Tensor(name, np.ascontiguousarray(value.numpy()))
    return pb_utils.Tensor.from_dlpack(name, value.contiguous())


def host_array(value: Any) -> np.ndarray:
    """numpy view (host copy for device tensors) of a small tensor: sizes, flags, raw bytes."""
    return get_kernel("host_array", value)(value)


@register_kernel("host_array", NUMPY)
def _numpy_host(value: np.ndarray) -> np.ndarray:
    return value


@register_kernel("host_array", TORCH)
def _torch_host(value: torch.Tensor) -> np.ndarray:
    return value.detach().cpu().numpy()


def as_torch(value: Any) -> torch.Tensor:
    """A torch tensor on the value's device (numpy: shares memory, copied when read-only)."""
    return get_kernel("as_torch", value)(value)


@register_kernel("as_torch", NUMPY)
def _numpy_as_torch(value: np.ndarray) -> torch.Tensor:
    import torch

    return torch.from_numpy(value if value.flags.writeable else value.copy())


@register_kernel("as_torch", TORCH)
def _torch_as_torch(value: torch.Tensor) -> torch.Tensor:
    return value


def cuda_device(value: Any) -> str | None:
    """``"cuda:N"`` for a tensor in GPU memory, else None."""
    return get_kernel("cuda_device", value)(value)


@register_kernel("cuda_device", NUMPY)
def _numpy_device(value: np.ndarray) -> None:
    return None


@register_kernel("cuda_device", TORCH)
def _torch_device(value: torch.Tensor) -> str | None:
    return f"cuda:{value.device.index or 0}" if value.device.type == "cuda" else None


def synchronize_cuda(values: Iterable[Any]) -> None:
    """Wait for the kernels that produce CUDA outputs (they run on torch's current stream; the
    backend reads the memory from another process through CUDA IPC without joining that stream)."""
    devices = sorted({device for device in map(cuda_device, values) if device is not None})
    if devices:
        import torch

        for device in devices:
            torch.cuda.synchronize(device)


def dtype_name(value: Any) -> str:
    """``"uint8"``, ``"float32"``, ... for a numpy array or a torch tensor."""
    return str(value.dtype).replace("torch.", "")


def check_dtype(name: str, value: Any, expected: str) -> None:
    if dtype_name(value) != expected:
        raise InvalidRequestError(f"{name} must be {expected}, got {dtype_name(value)}")
