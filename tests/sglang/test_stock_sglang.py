"""SGLang 0.5.23's own Kimi K2.5 and K3 processing, stock, on a CPU host, from tiny local checkpoints
(tests/sglang/checkpoints.py): what it makes of the corpus is tests/reference.py's, bit for bit, and
where SGLang takes its GPU branches instead.

Runs in an environment with SGLang (``python -m pytest -p no:cacheprovider --confcutdir=tests/sglang
tests/sglang``); elsewhere the module is skipped.

Shapes: SGLang holds one item per image, its ``feature`` the float32 patches ``(N, 3, 14, 14)``,
``N = grid_h * grid_w``, and ``image_grid_thw`` int64 ``(1, 3)``; :func:`sglang_side.run` concatenates
the items (``(ΣN, 3, 14, 14)``, ``(n, 3)``), the reference's layout, so they compare as they are.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest

# sglang.srt, not sglang: where SGLang is not installed, this folder itself imports as a namespace
# package "sglang" (tests/ is on sys.path in the main suite).
pytest.importorskip("sglang.srt", reason="SGLang is not installed in this environment")

import numpy as np
from PIL import Image

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent
sys.path[:0] = [str(HERE), str(TESTS)]
import checkpoints  # noqa: E402
import sglang_side  # noqa: E402
from reference import PRESETS, ref_size, reference_preprocess, reference_token_count, reference_verdict  # noqa: E402

CORPUS = TESTS / "data" / "corpus"
# A JPEG, a greyscale JPEG, a CMYK JPEG, a PNG with an alpha channel (LA), a palette PNG with a
# transparent colour (tRNS), an RGBA WebP.
FILES = (
    "pil__hopper.jpg",
    "pil__hopper_gray.jpg",
    "pil__pil_sample_cmyk.jpg",
    "pilx__uncompressed_la.png",
    "pilx__p_trns_single.png",
    "pilx__transparent.webp",
)
# Files Pillow (so the reference) refuses: a truncated JPEG, a PNG whose header is damaged, text.
REFUSED = ("pil__truncated_jpeg.jpg", "pilx__broken.png", "README.md")
# (preset, extra ServerArgs): K3 with its preprocess cache (SGLang's default for K3: the artifact
# path) and without (its older path through the processor wrapper).
SETUPS = {
    "k25": ("kimi-k2.5", {}),
    "k3": ("kimi-k3", {}),
    "k3-nocache": ("kimi-k3", {"mm_preprocess_cache_size_mb": 0}),
}


@pytest.fixture(scope="module")
def checkpoint_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return checkpoints.write_checkpoints(tmp_path_factory.mktemp("sglang_checkpoints"))


@pytest.fixture(scope="module")
def stocks(checkpoint_dirs: dict[str, Path]) -> dict[str, sglang_side.StockSGLang]:
    return {
        name: sglang_side.build_processor(checkpoint_dirs[preset], preset, **args)
        for name, (preset, args) in SETUPS.items()
    }


def expected_ids(stock: sglang_side.StockSGLang, datas: list[bytes]) -> np.ndarray:
    """The prompt ``describe`` + each image's reference prompt (spec section 9: K3's with the
    image's size), its placeholder expanded to the image's token count, tokenized."""
    parts = []
    for data in datas:
        _, tokens, prompt = reference_token_count(data, stock.preset)
        parts.append(prompt.replace("<|media_pad|>", "<|media_pad|>" * tokens))
    return np.asarray(stock.tokenizer.encode("describe " + " ".join(parts)), dtype=np.int64)


def check_against_reference(out: dict, stock: sglang_side.StockSGLang, datas: list[bytes]) -> None:
    refs = [reference_preprocess(data, stock.preset) for data in datas]
    assert out["deferred"] == [False] * len(datas)
    assert [f.dtype for f in out["features"]] == [np.dtype(np.float32)] * len(datas)
    assert [f.shape for f in out["features"]] == [r.pixel_values.shape for r in refs]
    assert out["pixel_values"].dtype == np.float32
    assert np.array_equal(out["pixel_values"], np.concatenate([r.pixel_values for r in refs]))
    assert out["image_grid_thw"].dtype == np.int64
    assert np.array_equal(out["image_grid_thw"], np.stack([r.grid_thw for r in refs]))
    assert np.array_equal(out["input_ids"], expected_ids(stock, datas))
    pad = checkpoints.MEDIA_PAD_ID
    for (first, last), ref in zip(out["offsets"], refs, strict=True):
        assert last - first + 1 == ref.num_tokens
        assert (out["input_ids"][first : last + 1] == pad).all()


@pytest.mark.parametrize("name", FILES)
@pytest.mark.parametrize("setup", SETUPS)
def test_stock_sglang_is_the_reference(stocks: dict, setup: str, name: str) -> None:
    """One image, as the chat path sends it (a ``data:`` URL): SGLang's pixel_values, grid and
    expanded prompt are the reference's."""
    data = (CORPUS / name).read_bytes()
    stock = stocks[setup]
    check_against_reference(sglang_side.run(stock, None, [data]), stock, [data])


@pytest.mark.parametrize("setup", SETUPS)
def test_several_images_in_one_prompt_and_raw_bytes(stocks: dict, setup: str) -> None:
    """Every file in one prompt, as ``data:`` URLs and as raw bytes (the Engine API's form): the
    same items in order, each the reference's."""
    datas = [(CORPUS / name).read_bytes() for name in FILES]
    stock = stocks[setup]
    for form in ("data_url", "bytes"):
        check_against_reference(sglang_side.run(stock, None, datas, image_form=form), stock, datas)


@pytest.mark.parametrize("name", REFUSED)
@pytest.mark.parametrize("setup", SETUPS)
def test_a_refused_file_is_a_value_error(stocks: dict, setup: str, name: str) -> None:
    """A file Pillow cannot decode: SGLang's loader raises ``ValueError("Could not decode image:
    <Pillow's message>")``; K2.5 (and K3 without its cache) wrap it as ``An exception occurred while
    loading IMAGE data at index 0: Error while loading data <the first bytes>...: ...``; K3's
    artifact path passes it on as it is."""
    data = (CORPUS / name).read_bytes()
    assert reference_verdict(data, SETUPS[setup][0]) != "ok"
    with pytest.raises(ValueError, match="Could not decode image: ") as caught:
        sglang_side.run(stocks[setup], None, [data])
    wrapped = str(caught.value).startswith("An exception occurred while loading IMAGE data at index 0: ")
    assert wrapped == (setup != "k3")


def long_png() -> bytes:
    """A 60000 x 20 PNG: NaViT shrinks it to 7168 x 2 (the 512-patch side limit), so its decoded
    pixels (3.6 MB) outweigh its float32 patches (2.4 MB)."""
    out = io.BytesIO()
    Image.new("RGB", (60000, 20), (200, 30, 90)).save(out, "PNG")
    return out.getvalue()


def test_the_long_image_on_the_cpu_is_the_reference(stocks: dict) -> None:
    """The same image without the pretence: the CPU path, bit-equal to the reference."""
    data = long_png()
    for setup in ("k3", "k25"):
        check_against_reference(sglang_side.run(stocks[setup], None, [data]), stocks[setup], [data])


def test_k25_believing_in_cuda_takes_its_gpu_call_and_fails_at_the_first_cuda_tensor(stocks: dict) -> None:
    """With ``torch.cuda.is_available()`` and SGLang's ``is_cuda()`` True, K2.5's wrapper takes
    ``_gpu_call`` (after the loader's nvJPEG try fails and falls back to Pillow); its first CUDA
    tensor, the normalisation constants, raises torch's error for a host without a driver."""
    data = (CORPUS / "pil__hopper.jpg").read_bytes()
    with sglang_side.believe_cuda(), pytest.raises((RuntimeError, AssertionError)) as caught:
        sglang_side.run(stocks["k25"], None, [data])
    functions = [entry.name for entry in caught.traceback]
    assert "_gpu_call" in functions and "_get_gpu_norm_tensors" in functions
    assert "_cpu_call" not in functions


@pytest.mark.parametrize("setup", ("k3", "k3-nocache"))
def test_k3_believing_in_cuda_defers_to_the_model(stocks: dict, setup: str) -> None:
    """K3's deferred path runs without CUDA: each item is the decoded image, uint8 (C, H, W), RGB, or
    RGBA where it has alpha, with the resize the model's GPU pass is to do; grid and prompt are the
    reference's. Its ``transparent_bg_config`` is None (the checkpoint's ``media_proc_cfg`` has none:
    that pass would drop alpha)."""
    from sglang.srt.multimodal.kimi_k3_image_processing import DEFERRED_PREPROCESSING_KEY

    datas = [(CORPUS / name).read_bytes() for name in FILES]
    stock = stocks[setup]
    with sglang_side.believe_cuda():
        out = sglang_side.run(stock, None, datas)
    assert out["deferred"] == [True] * len(datas)
    assert out["pixel_values"] is None
    assert np.array_equal(out["input_ids"], expected_ids(stock, datas))
    items = out["output"].mm_items
    for data, feature, grid, item in zip(datas, out["features"], out["image_grid_thw"], items, strict=True):
        image = Image.open(io.BytesIO(data))
        alpha = image.mode != "RGB" and ("A" in image.getbands() or "transparency" in image.info)
        assert feature.dtype == np.uint8
        assert np.array_equal(feature, np.asarray(image.convert("RGBA" if alpha else "RGB")).transpose(2, 0, 1))
        assert np.array_equal(grid, reference_preprocess(data, stock.preset).grid_thw)
        deferred = item.model_specific_data[DEFERRED_PREPROCESSING_KEY]
        size = ref_size(image.width, image.height, PRESETS[stock.preset])
        assert deferred.backend == "gpu" and deferred.transparent_bg_config is None
        assert deferred.resize_config == {
            "num_tokens": size.num_tokens,
            "new_width": size.new_w,
            "new_height": size.new_h,
            "pad_width": size.pad_w,
            "pad_height": size.pad_h,
        }


@pytest.mark.parametrize("setup", ("k3", "k3-nocache"))
def test_k3_believing_in_cuda_preprocesses_a_shrunk_image_on_the_gpu_and_fails(stocks: dict, setup: str) -> None:
    """An image whose patches weigh less than its pixels is not deferred: K3 preprocesses it on the
    GPU now (``_gpu_preprocess_images``), whose first CUDA tensor raises."""
    with sglang_side.believe_cuda(), pytest.raises((RuntimeError, AssertionError)) as caught:
        sglang_side.run(stocks[setup], None, [long_png()])
    functions = [entry.name for entry in caught.traceback]
    assert "_get_gpu_norm_tensors" in functions
    assert "_cpu_call" not in functions
