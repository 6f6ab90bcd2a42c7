"""Normalize + pad + patchify in one pass, driven by a 256x3 lookup table (spec section 4).

The normalised value of a pixel depends only on (value, channel), so the reference's float64
arithmetic is evaluated once per table entry and every output element is a single table read:
the table is exact for any mean/std. Padded pixels are uint8 0, i.e. ``table[0, c]``.

The same holds split in two: :func:`patchify` pads and patchifies the uint8 pixels (the "uint8
wire", 4x smaller than float32), and :func:`expand_patches` applies the table later, possibly in
another process: ``expand_patches(patchify(img, ...), table)`` equals ``write_patches(img, table,
...)`` bit for bit, because both are the same table read of the same uint8 value.

Each op dispatches on its first argument (:mod:`kimi_vision_prep.kernels`): numpy arrays to numba
kernels, torch tensors (any device) to one gather plus a view/permute; twins take and return the
same dtypes.
"""

from __future__ import annotations

import platform
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from llvmlite import ir
from numba import njit, prange, types, uint64
from numba.core import cgutils
from numba.extending import intrinsic, overload

from kimi_vision_common.patches import expand_with_table, expand_with_table_torch

from ..buffers import empty_output
from ..kernels import NUMPY, TORCH, get_kernel, register_kernel
from ..numba_runtime import kernel_input, parallel_kernel

if TYPE_CHECKING:
    import torch


# ``table[v, c] == v``: the fused kernel with this table and a uint8 ``out`` pads and patchifies
# without normalising (numba compiles it as a second signature of the same kernel).
IDENTITY_TABLE = np.repeat(np.arange(256, dtype=np.uint8)[:, None], 3, axis=1)
IDENTITY_TABLE.setflags(write=False)


def write_patches(image: Any, table: np.ndarray, grid_h: int, grid_w: int, patch_size: int, *, out: Any = None) -> Any:
    """Pad (zeros, bottom/right), look up ``table`` and patchify in one pass.

    ``image``: uint8 ``(H, W, 3)`` with ``H <= grid_h*p`` and ``W <= grid_w*p`` (numpy, or torch on
    any device); ``table``: ``(256, 3)``, float32 from :func:`normalize_table` or uint8
    :data:`IDENTITY_TABLE`. Returns ``(grid_h*grid_w, 3, p, p)`` of the table's dtype, of the
    image's type (float32: the ``pixel_values``); written into ``out`` when given (C-contiguous,
    that shape and dtype: e.g. one frame's rows of a video chunk), else a new array.
    """
    return get_kernel("write_patches", image)(image, table, grid_h, grid_w, patch_size, out=out)


def patchify(image: Any, grid_h: int, grid_w: int, patch_size: int, *, out: Any = None) -> Any:
    """Pad and patchify without normalising: uint8 ``(H, W, 3)`` -> uint8 ``(grid_h*grid_w, 3, p, p)``
    in the :func:`write_patches` layout (into ``out`` when given); :func:`expand_patches` turns it
    into ``pixel_values``."""
    return get_kernel("patchify", image)(image, grid_h, grid_w, patch_size, out=out)


def _checked_out(out: Any, shape: tuple[int, ...], dtype: Any) -> None:
    if tuple(out.shape) != shape or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {dtype} array of shape {shape}, got {out.dtype} {tuple(out.shape)}")


def expand_patches(patches: Any, table: np.ndarray) -> Any:
    """uint8 ``(N, 3, p, p)`` patches (numpy, or torch on any device) -> float32 ``(N, 3, p, p)``
    normalised through ``table`` (float32 ``(256, 3)``), bit-equal to :func:`write_patches` on the
    same image."""
    return get_kernel("expand_patches", patches)(patches, table)


def empty_patches(like: Any, shape: tuple[int, ...], dtype: type) -> Any:
    """A new uninitialised array of ``shape`` and numpy ``dtype`` of ``like``'s type (and device)."""
    return get_kernel("empty", like)(like, shape, dtype)


@register_kernel("empty", NUMPY)
def _empty_numpy(like: np.ndarray, shape: tuple[int, ...], dtype: type) -> np.ndarray:
    return empty_output(shape, dtype)


@register_kernel("empty", TORCH)
def _empty_torch(like: torch.Tensor, shape: tuple[int, ...], dtype: type) -> torch.Tensor:
    import torch

    return torch.empty(shape, dtype=torch.from_numpy(np.empty(0, dtype)).dtype, device=like.device)


def concatenate_patches(parts: Sequence[Any]) -> Any:
    """Patches of several images or frames, ``(N_i, 3, p, p)`` each and all of one type, as one
    ``(ΣN_i, 3, p, p)`` array of that type (several media along dim 0, spec section 7)."""
    return get_kernel("concatenate", parts[0])(parts)


@register_kernel("concatenate", NUMPY)
def _concatenate_numpy(parts: Sequence[np.ndarray]) -> np.ndarray:
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


@register_kernel("concatenate", TORCH)
def _concatenate_torch(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    import torch

    return parts[0] if len(parts) == 1 else torch.cat(list(parts))


# --------------------------------------------------------------------------- numba kernels


# The patch-row kernels index with unsigned integers only: numba wraps a signed index that might be
# negative around the axis (a compare and select per access), which kept the inner loops scalar
# with scatters and cost 1.3-1.5x (BENCHMARKS.md's history). Each channel's table is a contiguous row of
# ``tables`` (the table transposed, :func:`_channel_tables`).


@intrinsic
def _split_pixels(  # noqa: PLR0917
    typingctx: Any,
    image: types.Array,
    i: types.Integer,
    out: types.Array,
    j: types.Integer,
    pixels: types.IntegerLiteral,
) -> Any:
    """``out.flat[j + c*n*n + x] = image.flat[i + 3*x + c]`` for ``x < n`` (``n = pixels``, a
    constant) and each channel ``c``: ``n`` RGB pixels split into the first row of each of a
    patch's three ``n x n`` planes. One ``3n``-byte load, a byte shuffle a channel and an
    ``n``-byte store each (LLVM lowers them to the host's vector permutes); uint8 C-contiguous
    arrays, offsets in bytes."""
    arrays_ok = all(isinstance(a, types.Array) and a.dtype == types.uint8 and a.layout == "C" for a in (image, out))
    if not (arrays_ok and isinstance(pixels, types.IntegerLiteral)):
        return None
    n = pixels.literal_value

    def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: Any) -> ir.Value:
        image_in, offset_in, out_in, offset_out, _ = args
        byte, index = ir.IntType(8), ir.IntType(32)
        source = context.make_array(signature.args[0])(context, builder, image_in).data
        target = context.make_array(signature.args[2])(context, builder, out_in).data
        row_type = ir.VectorType(byte, 3 * n).as_pointer()
        row = builder.load(builder.bitcast(builder.gep(source, [offset_in]), row_type), align=1)
        for c in range(3):
            plane = builder.shuffle_vector(
                row, row, ir.Constant(ir.VectorType(index, n), [3 * x + c for x in range(n)])
            )
            at = builder.add(offset_out, ir.Constant(offset_out.type, c * n * n))
            builder.store(
                plane, builder.bitcast(builder.gep(target, [at]), ir.VectorType(byte, n).as_pointer()), align=1
            )
        return context.get_dummy_value()

    return types.void(image, i, out, j, pixels), codegen


_X86_64 = platform.machine() in ("x86_64", "AMD64")  # numba compiles for the host


@intrinsic
def _store_streaming(typingctx: Any, row: types.Array, i: types.Integer, value: types.Number) -> Any:
    """``row[i] = value`` on a 1-D C-contiguous array, float32 ones by a non-temporal store: the
    float32 patches are four bytes for every byte read and are not read again here, so they go to
    memory without first being read into the cache (a 720p frame's 2.5 MB of patches on one
    thread: 0.70x the time of plain stores, medians of 60 alternating runs).
    :func:`_streaming_fence` orders them before the kernel returns. Other dtypes (the by-plane
    kernel compiled for uint8 beside the by-pixel one) store plainly."""
    if not (isinstance(row, types.Array) and row.ndim == 1 and row.layout == "C" and value == row.dtype):
        return None
    streaming = row.dtype == types.float32

    def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: Any) -> ir.Value:
        array, offset, number = args
        pointer = builder.gep(context.make_array(signature.args[0])(context, builder, array).data, [offset])
        if not streaming:
            builder.store(number, pointer)
            return context.get_dummy_value()
        word = ir.IntType(32)
        store = builder.store(builder.bitcast(number, word), builder.bitcast(pointer, word.as_pointer()), align=4)
        store.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(word, 1)]))
        return context.get_dummy_value()

    return types.void(row, i, value), codegen


@intrinsic
def _streaming_fence(typingctx: Any) -> Any:
    """Orders the non-temporal stores before it before every store after it, as ordinary stores
    are ordered: ``sfence`` on x86-64 (LLVM's seq_cst fence is a locked instruction there, which
    does not order non-temporal stores), a full fence elsewhere."""

    def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: Any) -> ir.Value:
        if _X86_64:
            signature_type = ir.FunctionType(ir.VoidType(), [])
            builder.call(cgutils.get_or_insert_function(builder.module, signature_type, "llvm.x86.sse.sfence"), [])
        else:
            builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.void(), codegen


SPLIT_SIDE = 14  # the Kimi presets' patch_size: the side whose whole patches :func:`_split_patch` writes


def _split_patch(image: np.ndarray, out: np.ndarray, n: int, y0: int, x0: int) -> bool:
    """Patch ``n`` of ``out`` with no lookup, ``out[n, c, y, x] = image[y0 + y, x0 + x, c]`` for the
    whole ``14 x 14`` patch, a row of pixels at a time (:func:`_split_pixels`); True. An ``out``
    of another dtype than uint8 is left alone: False. (Compiled by numba from the overload below,
    so that a kernel of any dtype compiles with the call in it.)"""
    raise NotImplementedError("numba compiles _split_patch from its overload")


# numba requires the implementations' parameters to be the typing function's, annotations included.
@overload(_split_patch, inline="always")
def _split_patch_overload(image: Any, out: Any, n: Any, y0: Any, x0: Any) -> Any:
    def leave(image: Any, out: Any, n: Any, y0: Any, x0: Any) -> bool:
        return False

    def split(image: Any, out: Any, n: Any, y0: Any, x0: Any) -> bool:
        side, width = uint64(SPLIT_SIDE), uint64(image.shape[1])
        for y in range(side):
            _split_pixels(
                image, ((y0 + y) * width + x0) * uint64(3), out, (n * uint64(3) * side + y) * side, SPLIT_SIDE
            )
        return True

    return split if out.dtype == types.uint8 else leave


@njit(cache=True, nogil=True)
def _patch_row_by_pixel(  # noqa: PLR0917
    image: np.ndarray, tables: np.ndarray, out: np.ndarray, grid_w: int, gy: int, identity: bool
) -> None:
    """Patch row ``gy``: ``out[gy*grid_w + gx, c, y, x] = tables[c, image[gy*p + y, gx*p + x, c]]``
    (``tables[c, 0]`` past the edge), each pixel's three bytes read once: the faster order for
    uint8 patches. With ``identity`` (``tables[c, v] == v``) whole 14x14 patches are split without
    the lookup (:func:`_split_patch`: 6.5x faster on a 7 MB uint8 output, one thread).

    The edge test is per patch row, not per element: the inner loops are branch-free (measured
    1.1-2x faster than a per-element bounds test)."""
    zero, p, height, width = uint64(0), uint64(out.shape[2]), uint64(image.shape[0]), uint64(image.shape[1])
    y0, grid_w_u = uint64(gy) * p, uint64(grid_w)
    rows = min(p, height - y0) if height > y0 else zero
    split = identity and p == SPLIT_SIDE and rows == p
    t0, t1, t2 = tables[0], tables[1], tables[2]
    for gx in range(grid_w_u):
        n, x0 = uint64(gy) * grid_w_u + gx, gx * p
        cols = min(p, width - x0) if width > x0 else zero
        if split and cols == p and _split_patch(image, out, n, y0, x0):
            continue
        for y in range(p):
            filled = cols if y < rows else zero
            src = image[y0 + y] if y < rows else image[0]
            o0, o1, o2 = out[n, 0, y], out[n, 1, y], out[n, 2, y]
            for x in range(filled):
                o0[x] = t0[src[x0 + x, 0]]
                o1[x] = t1[src[x0 + x, 1]]
                o2[x] = t2[src[x0 + x, 2]]
            for x in range(filled, p):
                o0[x] = t0[0]
                o1[x] = t1[0]
                o2[x] = t2[0]


@njit(cache=True, nogil=True)
def _patch_row_by_plane(image: np.ndarray, tables: np.ndarray, out: np.ndarray, grid_w: int, gy: int) -> None:
    """As :func:`_patch_row_by_pixel`, one channel plane of a patch after the other: each patch
    is written as one ascending stream, the faster order for float32 patches of large images
    (1.4x at 3 MP, BENCHMARKS.md's history). The two repeat the patch loop on purpose: one loop calling a
    per-patch function of either order measured 0.73-0.95x."""
    zero, p, height, width = uint64(0), uint64(out.shape[2]), uint64(image.shape[0]), uint64(image.shape[1])
    y0, grid_w_u = uint64(gy) * p, uint64(grid_w)
    rows = min(p, height - y0) if height > y0 else zero
    for gx in range(grid_w_u):
        n, x0 = uint64(gy) * grid_w_u + gx, gx * p
        cols = min(p, width - x0) if width > x0 else zero
        for c in range(uint64(3)):
            table = tables[c]
            for y in range(p):
                filled = cols if y < rows else zero
                src = image[y0 + y] if y < rows else image[0]
                o = out[n, c, y]
                for x in range(filled):
                    _store_streaming(o, x, table[src[x0 + x, c]])
                for x in range(filled, p):
                    _store_streaming(o, x, table[0])
    _streaming_fence()


@njit(cache=True, nogil=True)
def _is_identity(tables: np.ndarray) -> bool:
    """Whether ``tables[c, v] == v`` for every channel ``c`` and value ``v`` (:data:`IDENTITY_TABLE`)."""
    for c in range(tables.shape[0]):
        for v in range(tables.shape[1]):
            if tables[c, v] != v:
                return False
    return True


@njit(parallel=True, cache=True, nogil=True)
def _write_patches_by_pixel(image: np.ndarray, tables: np.ndarray, out: np.ndarray, grid_w: int) -> None:
    """Every patch row of ``out`` (:func:`_patch_row_by_pixel`), on numba's threads."""
    identity = _is_identity(tables)
    for gy in prange(out.shape[0] // grid_w):
        _patch_row_by_pixel(image, tables, out, grid_w, gy, identity)


@njit(parallel=True, cache=True, nogil=True)
def _write_patches_by_plane(image: np.ndarray, tables: np.ndarray, out: np.ndarray, grid_w: int) -> None:
    """Every patch row of ``out`` (:func:`_patch_row_by_plane`), on numba's threads."""
    for gy in prange(out.shape[0] // grid_w):
        _patch_row_by_plane(image, tables, out, grid_w, gy)


@njit(cache=True, nogil=True)
def _write_patches_here(image: np.ndarray, tables: np.ndarray, out: np.ndarray, grid_w: int) -> None:
    """Every patch row of ``out`` on the calling thread, in the order its dtype prefers: no
    threading layer is entered, so several threads may run it at once (row bands)."""
    by_plane, identity = out.itemsize >= 4, _is_identity(tables)
    for gy in range(out.shape[0] // grid_w):
        if by_plane:
            _patch_row_by_plane(image, tables, out, grid_w, gy)
        else:
            _patch_row_by_pixel(image, tables, out, grid_w, gy, identity)


@register_kernel("write_patches", NUMPY)
def write_patches_numpy(
    image: np.ndarray, table: np.ndarray, grid_h: int, grid_w: int, patch_size: int, *, out: np.ndarray | None = None
) -> np.ndarray:
    """:func:`write_patches` for numpy (numba, parallel)."""
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"expected uint8 (H, W, 3), got {image.dtype} {image.shape}")
    if image.shape[0] > grid_h * patch_size or image.shape[1] > grid_w * patch_size:
        raise ValueError(f"image {image.shape[:2]} larger than the {grid_h}x{grid_w} patch grid")
    out = patches_out(out, (grid_h * grid_w, 3, patch_size, patch_size), table.dtype)
    kernel = _write_patches_by_plane if out.itemsize >= 4 else _write_patches_by_pixel
    with parallel_kernel(out.size):
        kernel(kernel_input(image), _channel_tables(table), out, grid_w)
    return out


def patches_out(out: np.ndarray | None, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """``out`` checked (writable, C-contiguous, ``shape`` and ``dtype``; else ValueError), or a new
    :func:`~kimi_vision_prep.buffers.empty_output` array when None: where the numba kernels write
    patches."""
    if out is None:
        return empty_output(shape, dtype)
    if out.shape != shape or out.dtype != dtype or not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(f"out must be a writable C-contiguous {dtype} array of shape {shape}")
    return out


def write_patch_rows(
    image: np.ndarray, table: np.ndarray, out: np.ndarray, grid_w: int, *, rows: tuple[int, int]
) -> None:
    """The patch rows of image ``rows`` ``[row_begin, row_end)`` into ``out``, on the calling thread.

    ``image``: uint8 ``(H, W, 3)``; ``out``: :func:`write_patches`'s ``(grid_h*grid_w, 3, p, p)``
    of ``table``'s dtype, from :func:`patches_out`. ``row_begin`` is a multiple of ``p``, and so is
    ``row_end`` unless it is ``H``: that last band also writes the padding rows below the image.
    Bands of one image may run on several threads at once (no threading layer is entered), and
    together they write exactly what :func:`write_patches` writes."""
    p, (row_begin, row_end) = out.shape[2], rows
    first = row_begin // p * grid_w
    last = out.shape[0] if row_end == image.shape[0] else row_end // p * grid_w
    _write_patches_here(kernel_input(image[row_begin:row_end]), _channel_tables(table), out[first:last], grid_w)


def _channel_tables(table: np.ndarray) -> np.ndarray:
    """``table`` ``(256, 3)`` as the kernels read it: ``(3, 256)``, C-contiguous, read-only."""
    return kernel_input(table.T)


@register_kernel("patchify", NUMPY)
def patchify_numpy(
    image: np.ndarray, grid_h: int, grid_w: int, patch_size: int, *, out: np.ndarray | None = None
) -> np.ndarray:
    """:func:`patchify` for numpy: the numba pass with :data:`IDENTITY_TABLE`."""
    return write_patches_numpy(image, IDENTITY_TABLE, grid_h, grid_w, patch_size, out=out)


# The kernels of expand_patches are the client's table lookups (one implementation each).
register_kernel("expand_patches", NUMPY)(expand_with_table)
register_kernel("expand_patches", TORCH)(expand_with_table_torch)


# --------------------------------------------------------------------------- torch kernels


def _pad_torch(image: torch.Tensor, grid_h: int, grid_w: int, patch_size: int) -> torch.Tensor:
    """uint8 ``(H, W, 3)`` zero-padded at the bottom/right to ``(grid_h*p, grid_w*p, 3)``."""
    import torch

    p = patch_size
    height, width = image.shape[0], image.shape[1]
    if (height, width) == (grid_h * p, grid_w * p):
        return image
    padded = torch.zeros((grid_h * p, grid_w * p, 3), dtype=torch.uint8, device=image.device)
    padded[:height, :width] = image
    return padded


def _to_patches_torch(values: torch.Tensor, grid_h: int, grid_w: int, patch_size: int) -> torch.Tensor:
    """``(grid_h*p, grid_w*p, 3)`` -> contiguous ``(grid_h*grid_w, 3, p, p)`` (any dtype)."""
    p = patch_size
    patches = values.view(grid_h, p, grid_w, p, 3).permute(0, 2, 4, 1, 3).reshape(grid_h * grid_w, 3, p, p)
    return patches.contiguous()  # reshape copies except for a single patch row/column (a strided view)


def _torch_table(table: np.ndarray, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The table on ``device`` (a copy: the cached table is read-only) and the channel indices."""
    import torch

    return torch.tensor(table, device=device), torch.arange(3, device=device)


@register_kernel("write_patches", TORCH)
def write_patches_torch(
    image: torch.Tensor, table: np.ndarray, grid_h: int, grid_w: int, patch_size: int, *, out: Any = None
) -> torch.Tensor:
    """:func:`write_patches` for torch: one gather from the table, then a view/permute into
    patches, on the image's device (copied into ``out`` when given)."""
    padded = _pad_torch(image, grid_h, grid_w, patch_size)
    lut, channel = _torch_table(table, image.device)
    values = lut[padded.long(), channel]  # (Hp, Wp, 3) of the table's dtype
    return _into(out, _to_patches_torch(values, grid_h, grid_w, patch_size))


def _into(out: Any, result: torch.Tensor) -> torch.Tensor:
    if out is None:
        return result
    _checked_out(out, tuple(result.shape), result.dtype)
    return out.copy_(result)


@register_kernel("patchify", TORCH)
def patchify_torch(image: torch.Tensor, grid_h: int, grid_w: int, patch_size: int, *, out: Any = None) -> torch.Tensor:
    """:func:`patchify` for torch, on the image's device (copied into ``out`` when given)."""
    return _into(out, _to_patches_torch(_pad_torch(image, grid_h, grid_w, patch_size), grid_h, grid_w, patch_size))
