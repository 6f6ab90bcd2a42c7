"""``KimiVisionProcessor``: the checkpoint processor's interface, bit-equal to the spec's reference.

Every expected array comes from ``tests/reference.py`` (Pillow and numpy, no library code) on the
same inputs; the corpus's accepted files are given as bytes, as a PIL image, as a ``data:`` URL
and as a path.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import pytest
from make_inputs import corpus_names, photo_frames
from PIL import Image
from reference import reference_chunk, reference_frames_chunk, reference_images, reference_token_count

from kimi_vision_common.errors import InvalidImageError, InvalidRequestError
from kimi_vision_prep import ImageDecoder, KimiVisionProcessor

PRESETS = ("kimi-k2.5", "kimi-k3")
ACCEPTED = corpus_names(accepted=True)
PHOTO = "pil__xmp_test.jpg"  # a real photo the clips of make_inputs pan across too


def as_source(data: bytes, kind: str, tmp_path: Path) -> object:
    """``data`` as the processor may be given it: bytes, a PIL image, a data: URL or a path."""
    if kind == "bytes":
        return data
    if kind == "pil":
        return Image.open(io.BytesIO(data))
    if kind == "data_url":
        return "data:image/octet-stream;base64," + base64.b64encode(data).decode()
    path = tmp_path / "image"
    path.write_bytes(data)
    return str(path)


@pytest.mark.parametrize("kind", ["bytes", "pil", "data_url", "path"])
@pytest.mark.parametrize("preset", PRESETS)
def test_corpus_images_equal_the_reference_in_one_call(corpus: Path, preset: str, kind: str, tmp_path: Path) -> None:
    datas = [(corpus / name).read_bytes() for name in ACCEPTED]
    for i in range(len(datas)):
        (tmp_path / str(i)).mkdir()
    medias = [{"type": "image", "image": as_source(data, kind, tmp_path / str(i))} for i, data in enumerate(datas)]
    out = KimiVisionProcessor(preset=preset).preprocess(medias, return_tensors="np")
    pixel_values, grid_thws, _ = reference_images(datas, preset)
    assert np.array_equal(out["pixel_values"], pixel_values)
    assert np.array_equal(out["grid_thws"], grid_thws) and out["grid_thws"].dtype == np.int64


@pytest.mark.parametrize("preset", PRESETS)
def test_images_and_video_chunks_in_one_call_equal_the_reference(corpus: Path, preset: str) -> None:
    image = (corpus / ACCEPTED[0]).read_bytes()
    frames = photo_frames(PHOTO, 320, 200, 4)
    encoded = [_png(frame) for frame in frames]
    medias = [
        {"type": "image", "image": image},
        {"type": "video_chunk", "video_chunk": [Image.fromarray(frame) for frame in frames]},
        {"type": "video_chunk", "video_chunk": encoded},
    ]
    out = KimiVisionProcessor(preset=preset).preprocess(medias)
    ref_image = reference_images([image], preset)
    chunks = [reference_chunk(frames, preset), reference_frames_chunk(encoded, preset)]
    assert np.array_equal(out["pixel_values"], np.concatenate([ref_image[0], *(c.pixel_values for c in chunks)]))
    assert np.array_equal(out["grid_thws"], np.concatenate([ref_image[1], *(c.grid_thw[None] for c in chunks)]))


@pytest.mark.parametrize("preset", PRESETS)
def test_media_tokens_calculator_equals_the_reference_counts(corpus: Path, preset: str) -> None:
    processor = KimiVisionProcessor(preset=preset)
    for name in ACCEPTED:
        data = (corpus / name).read_bytes()
        expected = reference_token_count(data, preset)[1]
        assert processor.media_tokens_calculator({"type": "image", "image": data}) == expected
        assert processor.media_tokens_calculator({"type": "image", "image": Image.open(io.BytesIO(data))}) == expected
    frames = photo_frames(PHOTO, 900, 500, 4)
    chunk = {"type": "video_chunk", "video_chunk": [Image.fromarray(frame) for frame in frames]}
    assert processor.media_tokens_calculator(chunk) == reference_chunk(frames, preset).num_tokens


def test_return_tensors_pt_gives_torch_tensors_of_the_same_values(corpus: Path) -> None:
    torch = pytest.importorskip("torch")
    medias = [{"type": "image", "image": (corpus / name).read_bytes()} for name in ACCEPTED[:3]]
    processor = KimiVisionProcessor(preset="kimi-k2.5")
    as_numpy, as_torch = processor.preprocess(medias), processor.preprocess(medias, return_tensors="pt")
    assert isinstance(as_torch["pixel_values"], torch.Tensor) and as_torch["pixel_values"].dtype == torch.float32
    assert as_torch["grid_thws"].dtype == torch.int64
    assert np.array_equal(as_torch["pixel_values"].numpy(), as_numpy["pixel_values"])


def test_return_tensors_pt_without_torch_names_the_extra_before_any_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """An install without torch (the library door) refuses "pt" up front: a bad image in the call
    is not even looked at, and the message names the extra that brings torch."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else find_spec(name, *a))
    with pytest.raises(ModuleNotFoundError, match=r"kimi-vision-prep\[torch\]"):
        KimiVisionProcessor().preprocess([{"type": "image", "image": b"not an image"}], return_tensors="pt")
    with pytest.raises(ModuleNotFoundError, match=r"ImageDecoder\('cuda:0'\) .*kimi-vision-prep\[torch\]"):
        KimiVisionProcessor(decoder=ImageDecoder("cuda:0"))


def test_is_a_transformers_image_processor_where_transformers_is_installed() -> None:
    image_processing = pytest.importorskip("transformers.image_processing_utils")
    processor = KimiVisionProcessor(preset="kimi-k3")
    assert isinstance(processor, image_processing.BaseImageProcessor)
    out = processor.preprocess({"type": "image", "image": _png(photo_frames(PHOTO, 64, 40, 1)[0])})
    assert isinstance(out, image_processing.BatchFeature) and out["grid_thws"].tolist() == [[1, 4, 6]]


def test_an_empty_list_returns_nothing() -> None:
    assert dict(KimiVisionProcessor().preprocess([])) == {}


def test_bad_items_raise_typed_errors_naming_what_was_sent(tmp_path: Path) -> None:
    processor = KimiVisionProcessor()
    with pytest.raises(InvalidRequestError, match="type image or video_chunk"):
        processor.preprocess([{"type": "audio", "audio": b""}])
    with pytest.raises(InvalidRequestError, match="list of frames"):
        processor.preprocess([{"type": "video_chunk", "video_chunk": b"frames"}])
    with pytest.raises(InvalidImageError, match="cannot read"):
        processor.preprocess([{"type": "image", "image": str(tmp_path / "missing.jpg")}])
    with pytest.raises(InvalidImageError, match="base64"):
        processor.preprocess([{"type": "image", "image": "data:image/png;base64,@@@"}])
    with pytest.raises(InvalidImageError, match="expected a PIL image"):
        processor.preprocess([{"type": "image", "image": 42}])


def _png(frame: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(frame).save(buffer, format="PNG")
    return buffer.getvalue()
