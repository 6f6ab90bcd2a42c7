"""``KimiVisionProcessor``'s two interfaces, driven the way engines drive them.

The checkpoint's remote-code calls, in the order vLLM's Kimi-K2.5 model file makes them (the
start-up profiling input from ``num_frames_per_chunk`` and 3000x3000 frames, the prompt
replacement's ``media_tokens_calculator``, ``preprocess``, ``split_video_chunks``), the
``media_proc_cfg`` constructor and its JSON round trip, transformers' native calls
(``__call__``, ``get_number_of_image_patches``), and PIL JPEGs opened but not decoded taking the
fast route. Every expected array comes from ``tests/reference.py`` (Pillow and numpy, no library
code); a preset of other values is registered there for the test that changes them.
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import numpy as np
import pytest
import reference
from make_inputs import CORPUS, corpus_names
from PIL import Image
from reference import ref_size, reference_chunk, reference_images, reference_video

from kimi_vision_common.errors import InvalidImageError
from kimi_vision_common.pillow_open import unloaded_jpeg_bytes
from kimi_vision_common.presets import MEDIA_PROC_CFG_KEYS, get_preset, media_proc_cfg
from kimi_vision_prep import KimiVisionProcessor

ACCEPTED = corpus_names(accepted=True)

def is_jpeg(name: str) -> bool:
    """Pillow opens it as a JPEG (whatever its file name says)."""
    with Image.open(CORPUS / name) as image:
        return image.format == "JPEG"


JPEGS = [name for name in ACCEPTED if is_jpeg(name)]
CLIP = "video/torchcodec__av1_video.mkv"


def opened(path: Path, how: str, keep: list) -> Image.Image:
    """``path`` opened by ``Image.open`` (not decoded) from its path, a file object or bytes."""
    if how == "path":
        return Image.open(path)
    if how == "file":
        keep.append(path.open("rb"))  # open until the processor has read it
        return Image.open(keep[-1])
    return Image.open(io.BytesIO(path.read_bytes()))


@pytest.mark.parametrize("how", ["path", "file", "bytes"])
@pytest.mark.parametrize("preset", ["kimi-k2.5", "kimi-k3"])
def test_opened_pil_images_equal_the_reference(corpus: Path, preset: str, how: str) -> None:
    """Every accepted corpus image, opened from a path, a file object or bytes and handed over
    undecoded: the JPEGs take the fast route from their file's bytes, the rest Pillow's pixels."""
    keep: list = []
    images = [opened(corpus / name, how, keep) for name in ACCEPTED]
    routed = [name for name, im in zip(ACCEPTED, images, strict=True) if unloaded_jpeg_bytes(im) is not None]
    assert routed == JPEGS  # every JPEG goes to the decoders from its file's bytes
    out = KimiVisionProcessor(preset=preset).preprocess([{"type": "image", "image": im} for im in images])
    for f in keep:
        f.close()
    pixel_values, grid_thws, _ = reference_images([(corpus / name).read_bytes() for name in ACCEPTED], preset)
    assert np.array_equal(out["pixel_values"], pixel_values)
    assert np.array_equal(out["grid_thws"], grid_thws)


def test_only_an_unloaded_unchanged_jpeg_gives_its_file_bytes(corpus: Path) -> None:
    """Opened: the file's bytes (and a file object's position is left where it was); after
    ``load()``, after ``draft()``, or for another format: None (Pillow's pixels are used)."""
    path = corpus / JPEGS[0]
    assert unloaded_jpeg_bytes(Image.open(path)) == path.read_bytes()
    with path.open("rb") as f:
        image = Image.open(f)
        position = f.tell()
        assert unloaded_jpeg_bytes(image) == path.read_bytes() and f.tell() == position
    loaded = Image.open(path)
    loaded.load()
    drafted = Image.open(path)
    drafted.draft("RGB", (drafted.width // 4, drafted.height // 4))
    png = Image.open(io.BytesIO(_png(np.zeros((8, 8, 3), np.uint8))))
    assert [unloaded_jpeg_bytes(im) for im in (loaded, drafted, png)] == [None, None, None]


def test_a_drafted_jpeg_keeps_pillows_pixels(corpus: Path) -> None:
    """A JPEG drafted to a quarter is processed as Pillow decodes it then, not from its file."""
    drafted = Image.open(corpus / JPEGS[0])
    drafted.draft("RGB", (drafted.width // 4, drafted.height // 4))
    out = KimiVisionProcessor().preprocess({"type": "image", "image": drafted})
    expected = reference_images([_png(np.asarray(drafted.convert("RGB")))], "kimi-k2.5")
    assert np.array_equal(out["pixel_values"], expected[0])


def test_media_proc_cfg_values_are_honoured(corpus: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint whose media_proc_cfg differs (a smaller budget and side, 2 frames a chunk):
    the pixels, grids and chunk size follow it; a key it does not read is kept as given."""
    cfg = {**media_proc_cfg(get_preset("kimi-k2.5")), "in_patch_limit": 1024, "patch_limit_on_one_side": 24}
    cfg |= {"temporal_merge_kernel_size": 2, "config_type": "kimi_k25"}
    monkeypatch.setitem(reference.PRESETS, "custom", {**reference.PRESETS["kimi-k2.5"], **cfg})
    monkeypatch.setitem(reference.IMAGE_PROMPTS, "custom", reference.IMAGE_PROMPTS["kimi-k2.5"])
    processor = KimiVisionProcessor(cfg)
    datas = [(corpus / name).read_bytes() for name in ACCEPTED[:6]]
    out = processor.preprocess([{"type": "image", "image": data} for data in datas])
    pixel_values, grid_thws, _ = reference_images(datas, "custom")
    assert np.array_equal(out["pixel_values"], pixel_values) and np.array_equal(out["grid_thws"], grid_thws)
    assert processor.num_frames_per_chunk == 2 and processor.media_proc_cfg == cfg


def test_the_config_round_trips_through_json_and_a_checkpoint_folder(tmp_path: Path) -> None:
    """A checkpoint's preprocessor_config.json (remote-code keys included) is read by
    ``from_pretrained``; ``save_pretrained`` / ``to_dict`` / ``from_dict`` give it back."""
    cfg = {**media_proc_cfg(get_preset("kimi-k2.5")), "sample_fps": 4, "max_num_frames_each_video": 64}
    checkpoint = {
        "auto_map": {"AutoImageProcessor": "kimi_k25_processor.KimiK25VisionProcessor"},
        "image_processor_type": "KimiK25VisionProcessor",
        "media_proc_cfg": cfg,
    }
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(checkpoint))
    processor = KimiVisionProcessor.from_pretrained(tmp_path)
    assert processor.preset.sample_fps == 4.0 and processor.preset.max_num_frames_each_video == 64
    assert set(processor.media_proc_cfg) == set(MEDIA_PROC_CFG_KEYS)
    saved = processor.save_pretrained(tmp_path / "saved")
    again = KimiVisionProcessor.from_pretrained(tmp_path / "saved")
    assert again.preset == processor.preset and Path(saved[0]).name == "preprocessor_config.json"
    assert KimiVisionProcessor.from_dict(processor.to_dict()).preset == processor.preset
    assert KimiVisionProcessor.from_pretrained(tmp_path, preset="kimi-k3").preset.transparency == "chessboard"


def test_the_calls_of_vllms_model_file(corpus: Path) -> None:
    """Start-up: ``num_frames_per_chunk`` dummy 3000x3000 frames and one such image, their token
    counts (the larger is profiled); then a request's prompt replacement and ``preprocess``."""
    processor = KimiVisionProcessor()
    preset = reference.PRESETS["kimi-k2.5"]
    frames = [Image.new("RGB", (3000, 3000)) for _ in range(processor.num_frames_per_chunk)]
    video_item = {"type": "video_chunk", "video_chunk": frames}
    image_item = {"type": "image", "image": Image.new("RGB", (3000, 3000))}
    chunk_size = ref_size(3000, 3000, preset, preset["in_patch_limit_each_frame"])
    assert processor.media_tokens_calculator(video_item) == chunk_size.num_tokens
    assert processor.media_tokens_calculator(image_item) == ref_size(3000, 3000, preset).num_tokens
    config = processor.get_resize_config(video_item)
    assert config == {
        "num_tokens": chunk_size.num_tokens, "new_width": chunk_size.new_w, "new_height": chunk_size.new_h,
        "pad_width": chunk_size.pad_w, "pad_height": chunk_size.pad_h, "sampled_nframes": len(frames),
    }  # fmt: skip
    data = (corpus / JPEGS[0]).read_bytes()
    request = [{"type": "image", "image": Image.open(io.BytesIO(data))}, video_item]
    out = processor.preprocess(request)
    expected = [reference_images([data], "kimi-k2.5")[0], reference_chunk([np.asarray(f) for f in frames], "kimi-k2.5")]
    assert np.array_equal(out["pixel_values"], np.concatenate([expected[0], expected[1].pixel_values]))


@pytest.mark.parametrize("form", ["bytes", "base64", "data_url"])
def test_split_video_chunks_gives_the_reference_chunks(corpus: Path, form: str) -> None:
    """The AV1 clip split as the reference splits it (frames, prompts), then preprocessed: the
    reference's pixels."""
    data = (corpus / CLIP).read_bytes()
    text = base64.b64encode(data).decode()
    video = {"bytes": data, "base64": text, "data_url": "data:video/x-matroska;base64," + text}[form]
    processor = KimiVisionProcessor()
    chunks = processor.split_video_chunks(video)
    expected = reference_video(data, "kimi-k2.5")
    assert [chunk["prompt"] for chunk in chunks] == [chunk.prompt for chunk in expected]
    assert [chunk["type"] for chunk in chunks] == ["video_chunk"] * len(expected)
    out = processor.preprocess(chunks)
    assert np.array_equal(out["pixel_values"], np.concatenate([chunk.pixel_values for chunk in expected]))
    assert [processor.media_tokens_calculator(chunk) for chunk in chunks] == [chunk.num_tokens for chunk in expected]


def test_transformers_native_calls_give_the_reference(corpus: Path) -> None:
    """``__call__(images=...)`` -> ``pixel_values`` and ``image_grid_thw``; per-sample lists are
    flattened; ``get_number_of_image_patches`` is the grid's patch count; a keyword that would
    change the preprocessing is refused."""
    processor = KimiVisionProcessor()
    datas = [(corpus / name).read_bytes() for name in JPEGS[:4]]
    out = processor(images=[[Image.open(io.BytesIO(datas[0]))], datas[1:]], return_tensors="np")
    pixel_values, grid_thws, _ = reference_images(datas, "kimi-k2.5")
    assert np.array_equal(out["pixel_values"], pixel_values) and np.array_equal(out["image_grid_thw"], grid_thws)
    for height, width in ((3000, 3000), (1080, 1920), (37, 5000)):
        size = ref_size(width, height, reference.PRESETS["kimi-k2.5"])
        assert processor.get_number_of_image_patches(height, width) == size.grid_h * size.grid_w
    assert (processor.merge_size, processor.patch_size) == (2, 14)
    with pytest.raises(ValueError, match="max_patches"):
        processor(images=datas[:1], max_patches=1024)


def test_bad_video_text_is_a_typed_error() -> None:
    with pytest.raises(InvalidImageError, match="base64"):
        KimiVisionProcessor().split_video_chunks("not base64 @@")


def _png(frame: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(frame).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.mark.parametrize("preset", ["kimi-k2.5", "kimi-k3"])
def test_vllms_flags_give_the_references_patches_before_normalisation(corpus: Path, preset: str) -> None:
    """vLLM normalising on its device: ``do_rescale=False, do_normalize=False`` -> uint8 patches,
    which the checkpoint's mean and std turn into the reference's float32 (images and a chunk);
    both True is the float32 of the plain call; one without the other is refused."""
    from kimi_vision_prep import pixel_values_from_patches

    processor = KimiVisionProcessor(preset=preset)
    datas = [(corpus / name).read_bytes() for name in ACCEPTED[:8]]
    items = [{"type": "image", "image": data} for data in datas]
    patches = processor.preprocess(items, return_tensors="np", do_rescale=False, do_normalize=False)
    pixel_values, grid_thws, _ = reference_images(datas, preset)
    assert patches["pixel_values"].dtype == np.uint8
    assert np.array_equal(pixel_values_from_patches(patches["pixel_values"], preset), pixel_values)
    assert np.array_equal(patches["grid_thws"], grid_thws)
    full = processor.preprocess(items, do_rescale=True, do_normalize=True)
    assert np.array_equal(full["pixel_values"], pixel_values)
    frames = [Image.fromarray(np.full((90, 120, 3), 40 * i, np.uint8)) for i in range(4)]
    chunk = processor.preprocess({"type": "video_chunk", "video_chunk": frames}, do_rescale=False, do_normalize=False)
    expected = reference_chunk([np.asarray(f) for f in frames], preset)
    assert np.array_equal(pixel_values_from_patches(chunk["pixel_values"], preset), expected.pixel_values)
    for flags in ({"do_rescale": False}, {"do_normalize": False}, {"do_rescale": True, "do_normalize": False}):
        with pytest.raises(ValueError, match="both False"):
            processor.preprocess(items[:1], **flags)


class Wrapped:
    """An engine's loaded image beside its file (vLLM's ``MediaWithBytes``: ``.media``, ``.original_bytes``)."""

    def __init__(self, media: Image.Image, original_bytes: bytes) -> None:
        self.media, self.original_bytes = media, original_bytes


def test_an_engines_wrapped_image_is_its_loaded_pixels(corpus: Path) -> None:
    """A wrapper holding a loaded image (here turned, as vLLM's loader turns EXIF-rotated photos)
    is processed from that image, not from the file beside it."""
    path = corpus / "pil__hopper_orientation_6.jpg"
    turned = Image.open(path).transpose(Image.Transpose.ROTATE_270)
    out = KimiVisionProcessor().preprocess([{"type": "image", "image": Wrapped(turned, path.read_bytes())}])
    as_png = io.BytesIO()
    turned.save(as_png, "PNG")
    expected = reference_images([as_png.getvalue()], "kimi-k2.5")[0]
    assert np.array_equal(out["pixel_values"], expected)
    assert KimiVisionProcessor().media_tokens_calculator({"type": "image", "image": Wrapped(turned, b"")}) > 0


def test_make_chunk_prompt_on_the_class_and_on_an_instance() -> None:
    """The checkpoint's ``make_chunk_prompt`` is a classmethod: ours answers on the class (the
    class's default preset) and on an instance (its preset)."""
    on_class = KimiVisionProcessor.make_chunk_prompt("00:00:01.500")
    assert on_class == "00:00:01.500<|media_begin|>video<|media_content|><|media_pad|><|media_end|>"
    k3 = KimiVisionProcessor(preset="kimi-k3")
    assert k3.make_chunk_prompt("00:00:01.500") == get_preset("kimi-k3").video_prompt.format(timestamp="00:00:01.500")


def test_from_pretrained_takes_transformers_loading_arguments_and_knows_k3(tmp_path: Path) -> None:
    """vLLM's call ``from_pretrained(folder, revision=None, trust_remote_code=...)``; a K3
    checkpoint's config (its processor class named K3) gives the K3 preset."""
    cfg = media_proc_cfg(get_preset("kimi-k3"))
    auto_map = {"AutoImageProcessor": "kimi_k3_vision_processing.KimiK3VisionProcessor"}
    checkpoint = {"auto_map": auto_map, "media_proc_cfg": cfg}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(checkpoint))
    processor = KimiVisionProcessor.from_pretrained(tmp_path, revision=None, trust_remote_code=True)
    assert processor.preset.transparency == "chessboard" and processor.media_proc_cfg == cfg
    assert KimiVisionProcessor.from_pretrained(tmp_path, preset="kimi-k2.5").preset.transparency == "convert_rgb"
    with pytest.raises(OSError, match=r"preprocessor_config\.json"):
        KimiVisionProcessor.from_pretrained(tmp_path / "missing")


ORIENTED = [name for name in ACCEPTED if "orientation" in name]


@pytest.mark.parametrize("name", ORIENTED)
def test_a_turned_jpeg_is_the_reference_of_its_exif_transposed_image(corpus: Path, name: str) -> None:
    """A JPEG standing for its EXIF-turned image (as vLLM's loader turns photos): the turned size,
    the library's decoders then the turn of the decoded pixels, equal to the reference of Pillow's
    ``exif_transpose`` image; read by Pillow, it gives that image's pixels."""
    from PIL import ImageOps

    from kimi_vision_common.orientation import TurnedJpeg, exif_orientation

    data = (corpus / name).read_bytes()
    expected_image = ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB")
    as_png = io.BytesIO()
    expected_image.save(as_png, "PNG")
    opened = Image.open(io.BytesIO(data))
    orientation = exif_orientation(opened)
    assert orientation != 1
    turned = TurnedJpeg(data, opened, orientation)
    assert turned.size == expected_image.size
    for preset in ("kimi-k2.5", "kimi-k3"):
        out = KimiVisionProcessor(preset=preset).preprocess([{"type": "image", "image": turned}])
        assert not turned.loaded  # decoded by the library from its bytes, not by Pillow
        assert np.array_equal(out["pixel_values"], reference_images([as_png.getvalue()], preset)[0]), preset
    assert np.array_equal(np.asarray(TurnedJpeg(data, opened, orientation).convert("RGB")), np.asarray(expected_image))


@pytest.mark.parametrize("name", ORIENTED)
def test_a_turned_jpeg_carries_no_orientation_to_apply_again(corpus: Path, name: str) -> None:
    """Its ``info`` is the one ``exif_transpose`` gives the turned image (the EXIF and XMP without the
    orientation), so ``exif_transpose`` of it turns nothing more: Pillow's turned pixels, once."""
    from PIL import ImageOps

    from kimi_vision_common.orientation import TurnedJpeg, exif_orientation

    data = (corpus / name).read_bytes()
    transposed = ImageOps.exif_transpose(Image.open(io.BytesIO(data)))
    opened = Image.open(io.BytesIO(data))
    turned = TurnedJpeg(data, opened, exif_orientation(opened))
    assert turned.info == transposed.info
    assert exif_orientation(turned) == 1 and not turned.loaded
    again = ImageOps.exif_transpose(turned)
    assert again.size == transposed.size
    assert np.array_equal(np.asarray(again), np.asarray(transposed))


@pytest.mark.parametrize("name", ORIENTED)
def test_a_pickled_turned_jpeg_keeps_its_file_undecoded(corpus: Path, name: str) -> None:
    """Pickled and unpickled (as an engine's worker processes receive it): a TurnedJpeg of the same
    bytes, size, mode and info, still undecoded, whose pixels the library and Pillow give as before."""
    import pickle

    from kimi_vision_common.orientation import TurnedJpeg, exif_orientation

    data = (corpus / name).read_bytes()
    opened = Image.open(io.BytesIO(data))
    turned = TurnedJpeg(data, opened, exif_orientation(opened))
    back = pickle.loads(pickle.dumps(turned))
    assert type(back) is TurnedJpeg and back.data == data and back.orientation == turned.orientation
    assert (back.size, back.mode, back.info) == (turned.size, turned.mode, turned.info)
    assert not back.loaded
    processor = KimiVisionProcessor()
    expected = processor.preprocess([{"type": "image", "image": turned}])["pixel_values"]
    assert np.array_equal(processor.preprocess([{"type": "image", "image": back}])["pixel_values"], expected)
    assert not back.loaded
    assert np.array_equal(np.asarray(pickle.loads(pickle.dumps(turned))), np.asarray(turned))


@pytest.mark.parametrize("orientation", range(1, 9))
def test_the_turn_is_pillows_for_every_orientation_and_array_type(orientation: int) -> None:
    """``turned`` of a non-square RGB array, as numpy, as a PIL image and (where torch is installed)
    as a torch tensor: the pixels of Pillow's transposition that ``exif_transpose`` applies."""
    from kimi_vision_common.orientation import TRANSPOSITIONS
    from kimi_vision_prep.decode.orientation import turned

    pixels = np.random.default_rng(orientation).integers(0, 256, (5, 7, 3), dtype=np.uint8)
    image = Image.fromarray(pixels)
    expected = np.asarray(image if orientation == 1 else image.transpose(TRANSPOSITIONS[orientation]))
    assert np.array_equal(turned(pixels, orientation), expected)
    assert np.array_equal(np.asarray(turned(image, orientation)), expected)
    try:
        import torch
    except ImportError:  # the library door has no torch
        return
    found = turned(torch.from_numpy(pixels), orientation)
    assert found.is_contiguous() and np.array_equal(found.numpy(), expected)
