"""The public pipeline: bytes -> decoded pixels -> resized -> ``pixel_values``."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import numba
import numpy as np

from kimi_vision_common.errors import PreprocessError, detached
from kimi_vision_common.orientation import turned_size
from kimi_vision_common.patches import normalize_table
from kimi_vision_common.presets import Preset, get_preset
from kimi_vision_common.results import PIXEL_OUTPUTS, ImagesResult, PixelOutput
from kimi_vision_common.sizing import TargetSize, navit_target_size
from kimi_vision_common.wire import DEFAULT_MAX_IMAGES_PER_REQUEST, NUM_TOKENS_DTYPE

from .buffers import scratch_scope
from .decode.decoder import DecodedImage, ImageDecoder, default_decoder
from .decode.orientation import turned
from .patchify.composite import composite_on_chessboard
from .patchify.normalize import (
    IDENTITY_TABLE,
    concatenate_patches,
    expand_patches,
    patches_out,
    patchify,
    write_patch_rows,
    write_patches,
)
from .pixels import as_rgb_array, host_to_device
from .resize.resize import resize
from .tokens import check_image_count, check_patch_budget

# The patch work per image row against decoding the row, by output (where row bands split:
# jpeg_bands; measured, BENCHMARKS.md's history).
PATCH_ROW_WORK: dict[str, float] = {"pixel_values": 0.6, "pixel_patches": 0.5}


@dataclass
class PreprocessResult:
    """One image's processor output.

    ``pixel_values``: float32 ``(N, 3, p, p)`` with ``N = grid_h * grid_w`` (numpy on the CPU path,
    a torch tensor on CUDA); None when ``output="pixel_patches"`` was asked for.
    ``pixel_patches``: uint8 ``(N, 3, p, p)`` in the same layout (padded pixels 0), only with
    ``output="pixel_patches"`` (else None); :func:`pixel_values_from_patches` expands it into
    bit-equal ``pixel_values``. ``grid_thw``: int64 ``(3,)`` = ``(1, grid_h, grid_w)``.
    """

    pixel_values: Any
    grid_thw: np.ndarray
    num_tokens: int
    decode_path: str
    fallback_reason: str | None
    target: TargetSize
    pixel_patches: Any = None

    @property
    def width(self) -> int:
        return self.target.width

    @property
    def height(self) -> int:
        return self.target.height


def resize_to_target(decoded: DecodedImage, target: TargetSize, preset: Preset) -> Any:
    """Resized RGB uint8 ``(new_h, new_w, 3)`` (numpy or torch), alpha composited onto the
    chessboard (RGBA appears only under chessboard presets)."""
    pixels = as_rgb_array(resize(decoded.pixels, target.new_width, target.new_height, decoded.resample))
    if decoded.device != "cpu" and isinstance(pixels, np.ndarray):  # a source-mode image, resized by Pillow
        pixels = host_to_device(pixels, decoded.device)
    if tuple(pixels.shape[:2]) != (target.new_height, target.new_width):
        raise AssertionError(f"resize produced {tuple(pixels.shape)}, expected {target.new_height}x{target.new_width}")
    return composite_on_chessboard(pixels, preset) if pixels.shape[2] == 4 else pixels


def resized_decoded(decoded: DecodedImage, preset: str | Preset = "kimi-k2.5") -> DecodedImage:
    """``decoded`` with its pixels resized to their NaViT size as RGB uint8 ``(new_h, new_w, 3)``
    (composited under chessboard presets), the stored size kept: :func:`preprocess_decoded` then
    finds nothing left to resize and pads and patchifies them. A decode step that hands over these
    pixels hands over at most the preset's patch budget, not a 36 MB camera photo. Like
    :func:`~.resize.resize`'s, the pixels are the caller's outside a :func:`~.buffers.scratch_scope`
    (where a decode step calls it) and arena memory inside one."""
    preset = get_preset(preset)
    target = navit_target_size(decoded.width, decoded.height, preset)
    return dataclasses.replace(decoded, pixels=resize_to_target(decoded, target, preset))


def preprocess_decoded(
    decoded: DecodedImage, preset: str | Preset = "kimi-k2.5", *, output: PixelOutput = "pixel_values", out: Any = None
) -> PreprocessResult:
    """Resize, pad, normalise and patchify one decoded image (each op by the kernel for the pixels'
    type: numba for numpy, tensor ops for torch on its device, Pillow for a source-mode image).

    ``output="pixel_values"`` (default): float32 ``pixel_values`` in one fused pass.
    ``output="pixel_patches"``: uint8 ``pixel_patches`` only (pad + patchify, no normalisation; 4x
    smaller, e.g. to send over a wire and expand with :func:`pixel_values_from_patches` there).
    ``out``: the caller's array to write them into (C-contiguous, writable, ``(N, 3, p, p)`` of
    that dtype, of the pixels' type; ``N`` from :func:`~.sizing.navit_target_size` or
    :func:`~.tokens.count_tokens`), else a new one; a mismatch raises ValueError.
    Resize intermediates come from this thread's scratch arena (:mod:`.buffers`).
    """
    if output not in PIXEL_OUTPUTS:
        raise ValueError(f"output must be one of {PIXEL_OUTPUTS}, got {output!r}")
    preset = get_preset(preset)
    target = navit_target_size(decoded.width, decoded.height, preset)
    with scratch_scope():
        rgb = resize_to_target(decoded, target, preset)
        if output == "pixel_values":
            table = normalize_table(preset.image_mean, preset.image_std)
            pixels = write_patches(rgb, table, target.grid_h, target.grid_w, preset.patch_size, out=out)
        else:
            pixels = patchify(rgb, target.grid_h, target.grid_w, preset.patch_size, out=out)
    return _result(decoded, target, output, pixels)


def _result(decoded: DecodedImage, target: TargetSize, output: PixelOutput, pixels: Any) -> PreprocessResult:
    """The result of one image whose ``output`` (``pixel_values`` or ``pixel_patches``) is ``pixels``."""
    return PreprocessResult(
        pixel_values=pixels if output == "pixel_values" else None,
        grid_thw=np.asarray(target.grid_thw, dtype=np.int64),
        num_tokens=target.num_tokens,
        decode_path=decoded.decode_path,
        fallback_reason=decoded.fallback_reason,
        target=target,
        pixel_patches=pixels if output == "pixel_patches" else None,
    )


class PatchRows:
    """Patches written band by band while a JPEG is decoded in row bands (a
    :class:`~.decode.jpeg_bands.RowConsumer`): for an image the NaViT rule keeps at its stored size, each
    band pads, normalises and patchifies its own rows on its own thread right after decoding them,
    so the output's write overlaps the rest of the decode, and no parallel kernel wakes numba's
    threads after it. :meth:`rows_for` is the decoder's ``rows_for``; after a decode with
    ``rows_consumed``, :attr:`patches` holds the image's ``output`` (into ``out`` when given),
    equal to :func:`preprocess_decoded`'s."""

    def __init__(self, preset: Preset, output: PixelOutput, out: Any) -> None:
        self.preset, self.out = preset, out
        self.multiple, self.row_work = preset.patch_size, PATCH_ROW_WORK[output]
        float32 = output == "pixel_values"
        self.table = normalize_table(preset.image_mean, preset.image_std) if float32 else IDENTITY_TABLE
        self.target: TargetSize | None = None
        self.patches: np.ndarray | None = None

    def rows_for(self, width: int, height: int) -> PatchRows | None:
        """This consumer where the image needs no resize (numpy output), else None."""
        self.target = navit_target_size(width, height, self.preset)
        numpy_out = self.out is None or isinstance(self.out, np.ndarray)
        return self if numpy_out and not self.target.needs_resize else None

    def start(self) -> None:
        target, p = self.target, self.preset.patch_size
        assert target is not None
        self.patches = patches_out(self.out, (target.num_patches, 3, p, p), self.table.dtype)

    def write(self, pixels: np.ndarray, row_begin: int, row_end: int) -> None:
        assert self.patches is not None and self.target is not None
        write_patch_rows(pixels, self.table, self.patches, self.target.grid_w, rows=(row_begin, row_end))


def pixel_values_from_patches(pixel_patches: Any, preset: str | Preset = "kimi-k2.5") -> Any:
    """uint8 ``(N, 3, p, p)`` patches (numpy or torch, any device) -> float32 ``(N, 3, p, p)``
    ``pixel_values`` under ``preset``'s mean/std, bit-equal to the fused ``output="pixel_values"``."""
    preset = get_preset(preset)
    return expand_patches(pixel_patches, normalize_table(preset.image_mean, preset.image_std))


def preprocess_bytes(
    data: bytes,
    preset: str | Preset = "kimi-k2.5",
    *,
    decoder: ImageDecoder | None = None,
    output: PixelOutput = "pixel_values",
    out: Any = None,
) -> PreprocessResult:
    """Encoded image bytes -> :class:`PreprocessResult`; raises a typed :class:`PreprocessError`.
    ``output`` and ``out`` as for :func:`preprocess_decoded`; the decoded pixels live in this
    thread's scratch arena for the call."""
    preset = get_preset(preset)
    if output not in PIXEL_OUTPUTS:
        raise ValueError(f"output must be one of {PIXEL_OUTPUTS}, got {output!r}")
    patch_rows = PatchRows(preset, output, out)
    decoder = decoder or default_decoder()
    with scratch_scope(), decoder.claim():
        decoded = decoder.decode(data, preset, rows_for=patch_rows.rows_for)
        if decoded.rows_consumed:
            assert patch_rows.target is not None
            return _result(decoded, patch_rows.target, output, patch_rows.patches)
        return preprocess_decoded(decoded, preset, output=output, out=out)


def preprocess_turned(
    data: bytes,
    orientation: int,
    preset: str | Preset = "kimi-k2.5",
    *,
    decoder: ImageDecoder | None = None,
    output: PixelOutput = "pixel_values",
) -> PreprocessResult:
    """:func:`preprocess_bytes` of the image EXIF ``orientation`` makes of ``data`` (Pillow's
    ``exif_transpose``, as engines load photos): the decoded pixels turned before the resize, the
    NaViT size that of the turned image."""
    preset = get_preset(preset)
    decoder = decoder or default_decoder()
    with scratch_scope(), decoder.claim():
        decoded = decoder.decode(data, preset)
        pixels = turned(decoded.pixels, orientation)
        width, height = turned_size(decoded.width, decoded.height, orientation)
        return preprocess_decoded(
            dataclasses.replace(decoded, pixels=pixels, width=width, height=height), preset, output=output
        )


def preprocess_batch(
    items: Sequence[bytes],
    preset: str | Preset = "kimi-k2.5",
    *,
    decoder: ImageDecoder | None = None,
    output: PixelOutput = "pixel_values",
    workers: int | None = None,
) -> list[PreprocessResult | PreprocessError]:
    """Many images; one result or one typed error per item, in order. ``output`` as for
    :func:`preprocess_decoded`.

    On the CPU, ``workers`` threads (default :func:`batch_workers`) each take whole images by
    :func:`preprocess_bytes`, so one image's decode (the decoders release the GIL) overlaps
    another's resize and patchify; an image is decoded in row bands only while the other workers
    are idle (:meth:`~.decode.decoder.ImageDecoder.claim`: the batch's last one). The caller's numba
    threads are shared out among the workers (at least one each): the workers fill the cores
    already, and a worker's parallel kernels would otherwise wake threads that then compete with
    the other worker (under the omp layer they also spin for milliseconds after each kernel).
    On the 2-core host that measured 1.17x and 1.25x the throughput of every worker keeping all
    the threads (medians of 5 and 4 alternating rounds; BENCHMARKS.md's history). On a GPU the images are
    decoded in one nvImageCodec batch call, then processed in order."""
    preset = get_preset(preset)
    decoder = decoder or default_decoder()
    if decoder.device_kind == "cuda":
        return [_preprocess_or_error(decoded, preset, output) for decoded in decoder.decode_batch(items, preset)]
    workers = min(workers or batch_workers(), len(items))
    if workers <= 1:
        return [_decode_and_preprocess(data, preset, decoder, output) for data in items]
    # numba's setting is per thread: each worker takes its share of the caller's.
    kernel_threads = max(1, numba.get_num_threads() // workers)

    def work(data: bytes) -> PreprocessResult | PreprocessError:
        numba.set_num_threads(kernel_threads)
        return _decode_and_preprocess(data, preset, decoder, output)

    return list(_batch_pool(workers).map(work, items))


@functools.lru_cache(maxsize=4)  # a few worker counts a process
def _batch_pool(workers: int) -> ThreadPoolExecutor:
    """The threads of :func:`preprocess_batch` with ``workers`` workers, kept from call to call:
    each keeps its scratch arena (:mod:`.buffers`) warm, where fresh threads per call paid the
    first-touch page faults of their arenas on every call. Not for a batch inside a batch's item."""
    return ThreadPoolExecutor(workers, thread_name_prefix="kimi-prep-batch")


# A forked child has none of the parent's threads: it makes its own pools.
os.register_at_fork(after_in_child=_batch_pool.cache_clear)


def batch_workers() -> int:
    """:func:`preprocess_batch`'s default workers: 2 where there are 2 cores or more (one decoding
    while the other runs kernels), else 1."""
    return 2 if (os.cpu_count() or 1) >= 2 else 1


def _decode_and_preprocess(
    data: bytes, preset: Preset, decoder: ImageDecoder, output: PixelOutput
) -> PreprocessResult | PreprocessError:
    try:
        return preprocess_bytes(data, preset, decoder=decoder, output=output)
    except PreprocessError as exc:
        return detached(exc)


def _preprocess_or_error(
    decoded: DecodedImage | PreprocessError, preset: Preset, output: PixelOutput
) -> PreprocessResult | PreprocessError:
    if isinstance(decoded, PreprocessError):
        return decoded
    try:
        return preprocess_decoded(decoded, preset, output=output)
    except PreprocessError as exc:
        return detached(exc)


def stack_results(
    results: Sequence[PreprocessResult], preset: Preset, output: PixelOutput, pixels: Any = None
) -> ImagesResult:
    """Single results (images or video chunks) as one :class:`ImagesResult`; empty arrays of the
    right shapes and dtypes for none. ``pixels``: the results' pixels already in one array (they
    were written into its rows), else they are concatenated."""
    p = preset.patch_size
    attribute = output  # "pixel_values" or "pixel_patches": the field that holds the pixels
    if pixels is None and results:
        pixels = concatenate_patches([getattr(r, attribute) for r in results])
    elif pixels is None:
        pixels = np.zeros((0, 3, p, p), np.float32 if output == "pixel_values" else np.uint8)
    grid_thws = np.array([r.grid_thw for r in results], dtype=np.int64).reshape(-1, 3)
    num_tokens = np.array([r.num_tokens for r in results], dtype=NUM_TOKENS_DTYPE)
    paths = tuple(r.decode_path for r in results)
    if output == "pixel_values":
        return ImagesResult(pixels, grid_thws, num_tokens, paths)
    return ImagesResult(None, grid_thws, num_tokens, paths, pixel_patches=pixels)


def with_index(exc: PreprocessError, what: str, index: int) -> PreprocessError:
    """``exc``'s class with ``"{what} {index}: "`` before its message (which item of a list failed)."""
    return detached(type(exc)(f"{what} {index}: {exc}"))


Item = TypeVar("Item")
Mapped = TypeVar("Mapped")


def map_indexed(fn: Callable[[Item], Mapped], items: Iterable[Item], what: str) -> list[Mapped]:
    """``[fn(item) for item in items]``; the first :class:`PreprocessError` is raised again with its
    item's index (:func:`with_index`): one list, one verdict."""
    results = []
    for index, item in enumerate(items):
        try:
            results.append(fn(item))
        except PreprocessError as exc:
            raise with_index(exc, what, index) from None
    return results


def preprocess_images(
    images: Sequence[bytes],
    preset: str | Preset = "kimi-k2.5",
    *,
    decoder: ImageDecoder | None = None,
    output: PixelOutput = "pixel_values",
    max_images_per_request: int = DEFAULT_MAX_IMAGES_PER_REQUEST,
    max_patches_per_request: int | None = None,
    out: Any = None,
) -> ImagesResult:
    """A list of encoded images -> one :class:`ImagesResult`, the concatenation of the single-image
    results (``[]``: empty arrays). Like the reference, one call has one verdict: the first bad
    image raises its typed error, its index in the message. More than ``max_images_per_request``
    (default 16) raises :class:`ImageTooLargeError` before anything is decoded, and so do more
    NaViT patches in all than ``max_patches_per_request`` (None: no limit; counted from the
    headers, :func:`~.tokens.check_patch_budget`). ``out``: the
    caller's ``(ΣN, 3, p, p)`` array (as for :func:`preprocess_decoded`; ``ΣN`` from
    :func:`~.tokens.count_tokens`), each image written into its rows without a concatenation."""
    preset = get_preset(preset)
    check_image_count(len(images), max_images_per_request)
    decoder = decoder or default_decoder()
    check_patch_budget(images, preset, max_patches_per_request, limits=decoder.limits)
    decoded = decoder.decode_batch(images, preset)
    rows = out_rows(decoded, preset, out)

    def preprocess_item(pair: tuple[DecodedImage | PreprocessError, Any]) -> PreprocessResult:
        item, rows_of_item = pair
        if isinstance(item, PreprocessError):
            raise item
        return preprocess_decoded(item, preset, output=output, out=rows_of_item)

    results = map_indexed(preprocess_item, zip(decoded, rows, strict=True), "image")
    return stack_results(results, preset, output, pixels=out)


def out_rows(decoded: Sequence[DecodedImage | PreprocessError], preset: Preset, out: Any) -> list[Any]:
    """Each decoded image's rows of ``out`` (None each without ``out``); ValueError when ``out``
    does not have the ΣN rows the images need."""
    if out is None:
        return [None] * len(decoded)
    counts = [
        0 if isinstance(item, PreprocessError) else navit_target_size(item.width, item.height, preset).num_patches
        for item in decoded
    ]
    if out.shape[0] != sum(counts):
        raise ValueError(f"out has {out.shape[0]} rows, the images need {sum(counts)}")
    offsets = np.cumsum([0, *counts])
    return [out[int(start) : int(end)] for start, end in itertools.pairwise(offsets)]
