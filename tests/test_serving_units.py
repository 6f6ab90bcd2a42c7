"""The serving layer without a server: configs, request/response logic, DLPack hand-off, launcher.

``pb_utils`` is replaced by a small fake that records what the models hand to Triton. The model
configs are the shipped ``model_repository/*/config.pbtxt`` files, parsed with Triton's own
protobuf schema (from tritonclient).
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
from google.protobuf import json_format, text_format
from PIL import Image
from reference import PRESETS as REF_PRESETS
from reference import k25_rgb, ref_size
from tritonclient.grpc import model_config_pb2

from kimi_vision_client.cli import build_parser
from kimi_vision_common.errors import InvalidPresetError, InvalidRequestError
from kimi_vision_common.wire import served_message
from kimi_vision_prep import (
    KIMI_K3,
    KIMI_K25,
    PreprocessError,
    Preset,
    buffer_stats,
    configure_buffers,
    pipeline,
    preprocess_bytes,
    preprocess_images,
    preset_from_parameters,
)
from kimi_vision_prep.kernels import register_kernel, type_key
from kimi_vision_prep.repeat_cache import RepeatCache
from kimi_vision_server import triton_install
from kimi_vision_server.launch import command, embedded
from kimi_vision_server.launch.access import AccessPolicy, access_args
from kimi_vision_server.models import components, tensors
from kimi_vision_server.models import requests as request_tensors
from kimi_vision_server.models.config import (
    DecoderSettings,
    buffer_caps,
    decoder_settings,
    model_parameters,
    numba_threads,
)
from kimi_vision_server.models.contract import ServingModel, TritonIO
from kimi_vision_server.models.images import DecodeModel, FusedVisionModel, PatchEmbedModel, PreprocessModel
from kimi_vision_server.models.patch_embed import make_patch_embed
from kimi_vision_server.models.requests import decoded_from_inputs, images_from_input
from kimi_vision_server.models.tensors import input_array, output_tensor
from kimi_vision_server.render.blocks import SERVING_DEFAULTS
from kimi_vision_server.render.repository import RenderOptions, render_repository
from kimi_vision_server.settings import Rendering, rendered_parameters

REPOSITORY = Path(__file__).resolve().parents[1] / "model_repository"
PRESET_KEYS = {"preset"} | {f.name for f in dataclasses.fields(Preset)} - {"name"}
DECODER_KEYS = {f.name for f in dataclasses.fields(DecoderSettings)}
FAMILIES = [("k25", KIMI_K25), ("k3", KIMI_K3)]


# -- the shipped configs --------------------------------------------------------------------------


def load_config(model: str, repository: Path = REPOSITORY) -> model_config_pb2.ModelConfig:
    return text_format.Parse((repository / model / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())


def config_dict(model: str) -> dict[str, Any]:
    """The config as Triton hands it to a Python model (JSON with proto field names)."""
    return json_format.MessageToDict(load_config(model), preserving_proto_field_name=True)


def model_args(model: str, kind: str = "CPU", device_id: int = 0) -> dict[str, str]:
    return {
        "model_config": json.dumps(config_dict(model)),
        "model_name": model,
        "model_instance_name": f"{model}_0_0",
        "model_instance_kind": kind,
        "model_instance_device_id": str(device_id),
    }


def all_models() -> list[str]:
    return sorted(p.parent.name for p in REPOSITORY.glob("*/config.pbtxt"))


@pytest.mark.parametrize(("family", "preset"), FAMILIES)
def test_decode_preprocess_and_fused_configs_carry_the_same_preset(family: str, preset: Preset) -> None:
    decode = model_parameters(config_dict(f"kimi_{family}_decode"))
    prep = model_parameters(config_dict(f"kimi_{family}_preprocess"))
    fused = model_parameters(config_dict(f"kimi_{family}_vision_fused"))
    blocks = [{k: v for k, v in params.items() if k in PRESET_KEYS} for params in (decode, prep, fused)]
    assert blocks[0] == blocks[1] == blocks[2]
    assert PRESET_KEYS <= decode.keys(), f"missing preset fields: {PRESET_KEYS - decode.keys()}"
    assert preset_from_parameters(decode) == preset_from_parameters(prep) == preset_from_parameters(fused) == preset


@pytest.mark.parametrize(("kind", "pixels"), [("vision_fused", "PIXEL_VALUES"), ("vision_fused_u8", "PIXEL_PATCHES")])
@pytest.mark.parametrize("family", [f for f, _ in FAMILIES])
def test_fused_config_carries_the_decode_and_preprocess_settings(family: str, kind: str, pixels: str) -> None:
    """The fused models' parameters are the decode model's (preset block and decoder settings, as
    the settings schema renders them; not the GPU repeat cache) plus the preprocess model's
    numba_threads and scratch cap (both return pixels), nothing else; their input
    and queue policy are the decode model's, their outputs the preprocess model's less the other
    pixel output (float32 for ``_vision_fused``, uint8 for ``_vision_fused_u8``)."""
    decode, prep, fused = (load_config(f"kimi_{family}_{k}") for k in ("decode", "preprocess", kind))
    decode_params, prep_params, fused_params = (model_parameters(config_dict(c.name)) for c in (decode, prep, fused))
    decode_only = {"repeat_cache_bytes"}  # a GPU decode step's: the fused models serve CPU hosts
    assert fused_params == {k: v for k, v in decode_params.items() if k not in decode_only} | {
        key: prep_params[key] for key in ("numba_threads", "scratch_cap_bytes")
    }
    assert DECODER_KEYS <= decode_params.keys(), f"missing decoder settings: {DECODER_KEYS - decode_params.keys()}"
    budget = SERVING_DEFAULTS.patch_budget(dict(FAMILIES)[family])
    expected = decoder_settings(rendered_parameters(Rendering("decode", 0, budget)))
    assert decoder_settings(fused_params) == decoder_settings(decode_params) == expected
    assert numba_threads(fused_params) == numba_threads(prep_params) == 0
    assert fused.backend == decode.backend == "python" and fused.max_batch_size == prep.max_batch_size == 1
    assert list(fused.input) == list(decode.input)
    assert fused.dynamic_batching == decode.dynamic_batching == prep.dynamic_batching
    assert list(fused.output) == [o for o in prep.output if o.name in {pixels, "GRID_THW", "NUM_TOKENS"}]
    assert [(g.count, g.kind) for g in fused.instance_group] == [(1, model_config_pb2.ModelInstanceGroup.KIND_AUTO)]


def test_every_config_parses_and_is_consistent() -> None:
    configs = {name: load_config(name) for name in all_models()}
    assert set(configs) == {
        "kimi_k25_decode", "kimi_k3_decode", "kimi_k25_preprocess", "kimi_k3_preprocess",
        "kimi_k25_vision", "kimi_k3_vision", "kimi_k25_vision_u8", "kimi_k3_vision_u8",
        "kimi_k25_vision_fused", "kimi_k3_vision_fused", "kimi_k25_vision_fused_u8", "kimi_k3_vision_fused_u8",
        "kimi_patch_embed", "kimi_k25_vision_embed",
        "kimi_k25_video", "kimi_k3_video", "kimi_k25_video_chunk", "kimi_k3_video_chunk",
        "kimi_k25_tokens", "kimi_k3_tokens",
    }  # fmt: skip
    for name in ("kimi_k25_video", "kimi_k3_video"):
        assert configs[name].model_transaction_policy.decoupled, name
    for name, config in configs.items():
        assert config.name == name and config.max_batch_size > 0
        if config.platform == "ensemble":
            for step in config.ensemble_scheduling.step:
                assert step.model_name in configs
                assert configs[step.model_name].max_batch_size >= config.max_batch_size
            continue
        assert config.backend == "python" and (REPOSITORY / name / "1" / "model.py").exists()
        for group in config.instance_group:  # auto or CPU, so GPU-less hosts load the repository
            assert group.kind in (
                model_config_pb2.ModelInstanceGroup.KIND_AUTO,
                model_config_pb2.ModelInstanceGroup.KIND_CPU,
            )
    for family in ("k25", "k3"):
        patch = preset_from_parameters(model_parameters(config_dict(f"kimi_{family}_preprocess"))).patch_size
        prep = {o.name: o for o in configs[f"kimi_{family}_preprocess"].output}
        assert list(prep["PIXEL_VALUES"].dims) == list(prep["PIXEL_PATCHES"].dims) == [-1, 3, patch, patch]
        assert prep["PIXEL_VALUES"].data_type == model_config_pb2.TYPE_FP32
        assert prep["PIXEL_PATCHES"].data_type == model_config_pb2.TYPE_UINT8
        vision, u8 = configs[f"kimi_{family}_vision"], configs[f"kimi_{family}_vision_u8"]
        assert {o.name: o for o in vision.output}["PIXEL_VALUES"] == prep["PIXEL_VALUES"]
        assert {o.name: o for o in u8.output}["PIXEL_PATCHES"] == prep["PIXEL_PATCHES"]
        # The uint8 ensemble is the float32 one with PIXEL_PATCHES in place of PIXEL_VALUES.
        swapped = model_config_pb2.ModelConfig()
        swapped.CopyFrom(vision)
        swapped.name = u8.name
        swapped.output[0].CopyFrom(prep["PIXEL_PATCHES"])
        swapped.ensemble_scheduling.step[1].output_map.pop("PIXEL_VALUES")
        swapped.ensemble_scheduling.step[1].output_map["PIXEL_PATCHES"] = "PIXEL_PATCHES"
        assert vision.output[0].name == "PIXEL_VALUES" and swapped == u8
    for name in ("kimi_k25_preprocess", "kimi_k3_preprocess", "kimi_patch_embed"):
        assert model_parameters(config_dict(name))["FORCE_CPU_ONLY_INPUT_TENSORS"] == "no"


def test_decoder_settings_from_the_shipped_config() -> None:
    settings = decoder_settings(model_parameters(config_dict("kimi_k25_decode")))
    assert settings.decoder_pool_size >= 1 and settings.max_pixels == 178956970 and not settings.strict_decode
    assert settings.gpu_route == "exact"


@pytest.mark.parametrize(
    ("raw", "route", "path"), [(None, "exact", "coefficients-cuda"), (" NVImgCodec ", "nvimgcodec", "nvimgcodec-cuda")]
)
def test_the_gpu_route_setting_reaches_a_models_decoder(raw: str | None, route: str, path: str) -> None:
    """A GPU decode model's decoder takes the exact route unless ``gpu_route`` says nvimgcodec (the
    served stub in a worktree imports /work/main's packages, so this is checked here, on the unit)."""
    settings = decoder_settings({} if raw is None else {"gpu_route": raw})
    decoder = components.settings_decoder(settings, "cuda:1")
    assert (settings.gpu_route, decoder.gpu_route, decoder.fast_path) == (route, route, path)
    assert components.settings_decoder(settings, "cpu").fast_path == "nvimgcodec-cpu"  # a CPU instance ignores it
    with pytest.raises(InvalidPresetError, match="gpu_route='fast' must be one of exact, nvimgcodec"):
        decoder_settings({"gpu_route": "fast"})


# -- a fake pb_utils ------------------------------------------------------------------------------


class FakeTritonError:
    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG = "UNKNOWN", "INTERNAL", "NOT_FOUND", "INVALID_ARG"
    UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS, CANCELLED = "UNAVAILABLE", "UNSUPPORTED", "ALREADY_EXISTS", "CANCELLED"

    def __init__(self, message: str, code: str = "INTERNAL") -> None:
        self.message, self.code = message, code


class FakeTensor:
    """A ``pb_utils.Tensor``: host (numpy) or 'GPU' (any DLPack-capable object, e.g. a torch tensor)."""

    def __init__(self, name: str, value: Any, on_gpu: bool = False, via_dlpack: bool = False) -> None:
        self.name, self.value, self.on_gpu, self.via_dlpack = name, value, on_gpu, via_dlpack

    def is_cpu(self) -> bool:
        return not self.on_gpu

    def as_numpy(self) -> np.ndarray:
        assert not self.on_gpu, "as_numpy() on a GPU tensor"
        return self.value

    def to_dlpack(self) -> Any:
        return torch.utils.dlpack.to_dlpack(self.value)

    @staticmethod
    def from_dlpack(name: str, value: Any) -> FakeTensor:
        return FakeTensor(name, value, on_gpu=True, via_dlpack=True)


class FakeResponse:
    """A ``pb_utils.InferenceResponse``: host outputs are copied, as the stub copies them into its
    shared memory when execute returns (a model may hand out arena memory the next execute reuses)."""

    def __init__(self, output_tensors: list[FakeTensor], error: FakeTritonError | None = None) -> None:
        for tensor in output_tensors:
            if isinstance(tensor.value, np.ndarray):
                tensor.value = tensor.value.copy()
        self.outputs = {t.name: t for t in output_tensors}
        self.error = error


class FakeRequest:
    """A ``pb_utils.InferenceRequest``. ``requested``: the names ``requested_output_names()``
    returns; None leaves the method out (the model then produces every output)."""

    def __init__(self, cancelled: bool = False, requested: tuple[str, ...] | None = None, **inputs: Any) -> None:
        self.inputs = {name: v if isinstance(v, FakeTensor) else FakeTensor(name, v) for name, v in inputs.items()}
        self.cancelled = cancelled
        if requested is not None:
            self.requested_output_names = lambda: set(requested)

    def is_cancelled(self) -> bool:
        return self.cancelled


class FakeMetricFamily:
    COUNTER, GAUGE = "COUNTER", "GAUGE"
    values: ClassVar[dict[tuple[str, tuple], float]] = {}

    def __init__(self, name: str, description: str, kind: str) -> None:
        self.name = name

    def Metric(self, labels: dict[str, str]) -> Any:
        key = (self.name, tuple(sorted(labels.items())))
        values = FakeMetricFamily.values

        def increment(amount: float) -> None:
            values[key] = values.get(key, 0) + amount

        return SimpleNamespace(increment=increment)


class FakeLogger:
    lines: ClassVar[list[tuple[str, str]]] = []

    def __getattr__(self, name: str) -> Any:
        return lambda message: FakeLogger.lines.append((name, message))


@pytest.fixture
def pb() -> SimpleNamespace:
    FakeMetricFamily.values = {}
    FakeLogger.lines = []
    return SimpleNamespace(
        Tensor=FakeTensor,
        InferenceResponse=FakeResponse,
        TritonError=FakeTritonError,
        MetricFamily=FakeMetricFamily,
        Logger=FakeLogger(),
        get_input_tensor_by_name=lambda request, name: request.inputs.get(name),
    )


def counter(name: str, **labels: str) -> float:
    return sum(
        v for (n, key), v in FakeMetricFamily.values.items() if n == name and labels.items() <= dict(key).items()
    )


DECODED = ("IMAGE", "IMAGE_SHAPES", "MODE", "RESAMPLE", "STORED_SIZES")  # what a decode step hands the preprocess step


def mode_input(mode: str) -> np.ndarray:
    return np.array([[mode.encode()]], dtype=np.object_)


def many_request(items: list[bytes], **kwargs: Any) -> FakeRequest:
    """A request of K images: IMAGE_BYTES ``[1, K]``."""
    return FakeRequest(IMAGE_BYTES=np.array([items], dtype=np.object_), **kwargs)


def bytes_request(data: bytes, **kwargs: Any) -> FakeRequest:
    return FakeRequest(IMAGE_BYTES=np.array([[data]], dtype=np.object_), **kwargs)


def outputs_of(response: FakeResponse) -> dict[str, Any]:
    assert response.error is None, response.error.message
    return {name: tensor.value for name, tensor in response.outputs.items()}


@pytest.fixture(scope="module")
def images(corpus: Path) -> dict[str, bytes]:
    names = ["pil__hopper.jpg", "imagers__large_image.jpg", "pilx__p_trns_single.png", "pil__pil_sample_cmyk.jpg"]
    return {name: (corpus / name).read_bytes() for name in names}


# -- decode model ---------------------------------------------------------------------------------


def test_every_python_model_applies_its_buffer_caps(pb: SimpleNamespace) -> None:
    """Every Python model's config carries the served buffer caps (a 64 MiB scratch cap only where
    it returns pixels: preprocess and fused; no recycling), and a model built from it applies them
    to its process (its stub); a config without them keeps the library's caps."""
    for config in REPOSITORY.glob("*/config.pbtxt"):
        params = model_parameters(config_dict(config.parent.name))
        if 'backend: "python"' in config.read_text():
            returns_pixels = config.parent.name.endswith(("_preprocess", "_vision_fused", "_vision_fused_u8"))
            assert buffer_caps(params) == {
                "scratch_cap_bytes": 64 << 20 if returns_pixels else 0,
                "recycle_cap_bytes": 0,
            }, config.parent.name
    assert buffer_caps({}) == {}
    configure_buffers(scratch_cap_bytes=1 << 20, recycle_cap_bytes=1 << 20)
    PreprocessModel(pb, model_args("kimi_k25_preprocess"))
    stats = buffer_stats()
    assert (stats["scratch_cap_bytes"], stats["recycle_cap_bytes"]) == (64 << 20, 0)


def count_batch_decodes(model: Any, monkeypatch: pytest.MonkeyPatch, at_once: int) -> list[int]:
    """The sizes of ``model``'s batch decode calls (``at_once`` JPEGs decoded at once), checking
    that when a call starts, every stored-size image of the last one went through the resize and
    its pixels are gone, unless the resize returned them as they were (an image already at its
    NaViT size): no more than ``at_once`` stored-size images alive."""
    decoder, calls, stored_size, resize_outputs = model.decoding.decoder, [], [], []
    decoder.cpu_decode_threads = at_once
    real_decode_batch, real_resized = decoder.decode_batch, components.resized_decoded

    def decode_batch(items: Any, preset: Any) -> Any:
        alive = [pixels for ref in stored_size if (pixels := ref()) is not None]
        assert all(any(p is out for out in resize_outputs) for p in alive), "stored-size pixels outlived their resize"
        calls.append(len(items))
        results = real_decode_batch(items, preset)
        stored_size.extend(weakref.ref(r.pixels) for r in results if not isinstance(r, BaseException))
        return results

    def resized(image: Any, preset: Any) -> Any:
        result = real_resized(image, preset)
        resize_outputs.append(result.pixels)
        return result

    decoder.decode_batch = decode_batch
    monkeypatch.setattr(components, "resized_decoded", resized)
    return calls


def test_decode_model_batches_and_isolates_errors(
    pb: SimpleNamespace, images: dict[str, bytes], corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = DecodeModel(pb, model_args("kimi_k3_decode"))
    calls = count_batch_decodes(model, monkeypatch, at_once=3)
    truncated = (corpus / "pil__truncated_jpeg.jpg").read_bytes()
    requests = [
        bytes_request(images["pil__hopper.jpg"]),
        bytes_request(truncated),
        bytes_request(images["pilx__p_trns_single.png"], cancelled=True),
        FakeRequest(IMAGE_BYTES=np.array([[b"x"], [b"y"]], dtype=np.object_)),  # two images in one request
        bytes_request(images["pilx__p_trns_single.png"]),
        FakeRequest(),  # input missing
        many_request([images["pil__hopper.jpg"], images["pilx__p_trns_single.png"]]),  # K = 2
        many_request([images["pil__hopper.jpg"], truncated]),  # the second of two is bad
    ]
    responses = model.execute(requests)
    assert len(responses) == len(requests) and calls == [3, 3, 1]  # 7 images of 6 requests, 3 at once
    codes = [r.error.code if r.error else None for r in responses]
    assert codes == [None, "INVALID_ARG", "CANCELLED", "INVALID_ARG", None, "INVALID_ARG", None, "INVALID_ARG"]
    assert "image 0: " in responses[1].error.message and "truncated" in responses[1].error.message
    assert "one request per batch element" in responses[3].error.message
    assert "image 1: " in responses[7].error.message
    jpeg = outputs_of(responses[0])
    expected = model.decoding.decoder.decode(images["pil__hopper.jpg"], KIMI_K3)
    np.testing.assert_array_equal(jpeg["IMAGE"], expected.pixels.reshape(1, -1))
    assert jpeg["IMAGE_SHAPES"].tolist() == [[[128, 128, 3, 0]]] and jpeg["MODE"].tolist() == [[b"RGB"]]
    assert jpeg["RESAMPLE"].tolist() == [[0]] and jpeg["DECODE_PATH"][0, 0] == expected.decode_path.encode()
    assert jpeg["STORED_SIZES"].tolist() == [[[128, 128]]]
    palette = outputs_of(responses[4])  # RGBA with a transparent key: composited onto K3's chessboard
    assert palette["IMAGE_SHAPES"].tolist() == [[[64, 64, 3, 0]]] and palette["RESAMPLE"].tolist() == [[1]]
    assert palette["MODE"].tolist() == [[b"RGB"]] and palette["STORED_SIZES"].tolist() == [[[64, 64]]]
    both = outputs_of(responses[6])
    assert both["IMAGE_SHAPES"].tolist() == [[[128, 128, 3, 0], [64, 64, 3, 128 * 128 * 3]]]
    assert both["IMAGE"].shape == (1, (128 * 128 + 64 * 64) * 3) and both["RESAMPLE"].tolist() == [[0, 1]]
    assert both["MODE"].tolist() == [[b"RGB", b"RGB"]]
    assert counter("kimi_prep_decodes_total", path="pillow", model="kimi_k3_decode") == 2
    assert counter("kimi_prep_errors_total", reason="invalid_image") == 2
    assert counter("kimi_prep_errors_total", reason="cancelled") == 1
    assert counter("kimi_prep_errors_total", reason="invalid_request") == 2
    assert counter("kimi_prep_stage_seconds_total", stage="decode") > 0


def test_decode_model_frees_stored_size_pixels_before_the_next_batch_call(
    pb: SimpleNamespace, images: dict[str, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A photo over K2.5's patch budget, three requests, one JPEG decoded at a time: when a batch
    call starts, no stored-size pixels of the last one are referenced any more."""
    model = DecodeModel(pb, model_args("kimi_k25_decode"))
    calls = count_batch_decodes(model, monkeypatch, at_once=1)
    photo = images["imagers__large_image.jpg"]
    responses = model.execute([bytes_request(photo) for _ in range(3)])
    assert calls == [1, 1, 1] and all(r.error is None for r in responses)
    width, height = Image.open(io.BytesIO(photo)).size
    (shape,) = outputs_of(responses[0])["IMAGE_SHAPES"][0]
    assert shape[0] * shape[1] < width * height  # resized: the stored-size pixels were another array


def test_a_decode_step_with_a_repeat_cache_decodes_a_repeat_once(
    pb: SimpleNamespace, images: dict[str, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The repeat cache a GPU decode instance keeps (forced on here, on the host): a repeat is not
    decoded again and answers the same outputs; other bytes and a bad image are looked up and
    missed; the lookups are counted."""
    model = DecodeModel(pb, model_args("kimi_k25_decode"))
    assert model.decoding.repeats is None  # a CPU instance: tritonserver's response cache serves repeats
    model.decoding.repeats = RepeatCache(64 << 20)
    calls = count_batch_decodes(model, monkeypatch, at_once=8)
    photo, other = images["pil__hopper.jpg"], images["imagers__large_image.jpg"]
    first = outputs_of(model.execute([bytes_request(photo)])[0])
    truncated = photo[: len(photo) // 2]  # its header reads, its decode fails
    (again, different, bad) = model.execute([bytes_request(photo), bytes_request(other), bytes_request(truncated)])

    assert calls == [1, 2]
    assert {k: v.tolist() for k, v in outputs_of(again).items()} == {k: v.tolist() for k, v in first.items()}
    assert outputs_of(different)["STORED_SIZES"].tolist() != first["STORED_SIZES"].tolist()
    assert bad.error is not None and len(model.decoding.repeats) == 2
    lookups = [counter("kimi_prep_repeat_cache_total", outcome=outcome) for outcome in ("hit", "miss")]
    assert lookups == [1, 3]


def test_execute_never_raises(pb: SimpleNamespace, images: dict[str, bytes]) -> None:
    model = DecodeModel(pb, model_args("kimi_k25_decode"))

    def broken(items: Any, preset: Any) -> Any:
        raise RuntimeError("boom")

    model.decoding.decoder.decode_batch = broken
    responses = model.execute([bytes_request(images["pil__hopper.jpg"]), bytes_request(b"", cancelled=True)])
    assert [r.error.code for r in responses] == ["INTERNAL", "CANCELLED"]
    assert "boom" in responses[0].error.message
    assert any(level == "log_error" and "boom" in line for level, line in FakeLogger.lines)


@pytest.mark.parametrize(
    ("model_class", "name"), [(DecodeModel, "kimi_k25_decode"), (FusedVisionModel, "kimi_k25_vision_fused")]
)
def test_decoding_models_count_and_log_fallbacks_once(
    pb: SimpleNamespace, images: dict[str, bytes], model_class: type[ServingModel], name: str
) -> None:
    model = model_class(pb, model_args(name))
    decoder = model.decoding.decoder
    decoder._codec_error, decoder._codec = "nvImageCodec unavailable (test)", None
    decoder._nvimgcodec = lambda: None  # the planned fast decoder is gone
    decoder.cpu_routes = ("nvimgcodec-cpu",)  # and libjpeg would take the JPEG before it
    for _ in range(2):
        (response,) = model.execute([bytes_request(images["pil__hopper.jpg"])])
        outputs = outputs_of(response)
        if "DECODE_PATH" in outputs:
            assert outputs["DECODE_PATH"][0, 0] == b"pillow"
        else:  # the fused model: Pillow's pixels are the same pixels
            np.testing.assert_array_equal(
                outputs["PIXEL_VALUES"][0], preprocess_bytes(images["pil__hopper.jpg"]).pixel_values
            )
    assert counter("kimi_prep_decodes_total", model=name, path="pillow") == 2
    assert counter("kimi_prep_decode_fallbacks_total", reason="nvImageCodec unavailable (test)") == 2
    assert sum("fallback" in line for level, line in FakeLogger.lines if level == "log_warn") == 1


# -- preprocess model -----------------------------------------------------------------------------


@pytest.mark.parametrize(("family", "preset"), [("k25", "kimi-k2.5"), ("k3", "kimi-k3")])
def test_decode_then_preprocess_equals_library(
    pb: SimpleNamespace, images: dict[str, bytes], family: str, preset: str
) -> None:
    decode = DecodeModel(pb, model_args(f"kimi_{family}_decode"))
    prep = PreprocessModel(pb, model_args(f"kimi_{family}_preprocess"))
    decoded = [outputs_of(r) for r in decode.execute([bytes_request(d) for d in images.values()])]
    handed_over = [FakeRequest(**{name: d[name] for name in DECODED}) for d in decoded]
    for data, hop in zip(images.values(), decoded, strict=True):  # the hop carries each image at its NaViT size
        width, height = Image.open(io.BytesIO(data)).size
        size = ref_size(width, height, REF_PRESETS[preset])  # the reference's size rule
        assert hop["STORED_SIZES"].tolist() == [[[height, width]]]
        assert hop["IMAGE_SHAPES"].tolist() == [[[size.new_h, size.new_w, 3, 0]]]
    for data, response in zip(images.values(), prep.execute(handed_over), strict=True):
        outputs, expected = outputs_of(response), preprocess_bytes(data, preset)
        np.testing.assert_array_equal(outputs["PIXEL_VALUES"], expected.pixel_values[None])
        np.testing.assert_array_equal(outputs["GRID_THW"], expected.grid_thw[None, None])
        assert outputs["NUM_TOKENS"].dtype == np.int32 and outputs["NUM_TOKENS"].tolist() == [[expected.num_tokens]]


@pytest.mark.parametrize("kind", ["preprocess", "vision_fused", "vision_fused_u8"])
def test_pixel_outputs_reuse_one_arena_buffer_from_execute_to_execute(
    pb: SimpleNamespace, images: dict[str, bytes], kind: str
) -> None:
    """A stub's pixel output is written into its thread's scratch arena, so the next execute's output
    lands on the same pages (no fresh pages to fault in per request: a smaller image's output
    reuses a larger one's buffer); each response is exact, and so is a request of two images
    (written in place, not concatenated)."""
    handed_out: list[int] = []

    def tensor(name: str, value: Any) -> FakeTensor:
        if name.startswith("PIXEL_"):
            handed_out.append(value.__array_interface__["data"][0])
        return FakeTensor(name, value)  # FakeResponse then copies it, as the stub does

    pb.Tensor = tensor
    model = f"kimi_k25_{kind}"
    output = "pixel_patches" if kind.endswith("_u8") else "pixel_values"
    name = output.upper()
    photos = [images["imagers__large_image.jpg"], images["pil__hopper.jpg"]]
    requests = [bytes_request(photo) for photo in photos] + [many_request(photos)]
    if kind == "preprocess":  # the decode step on a thread of its own: its own arena, as in its own stub
        decode = DecodeModel(pb, model_args("kimi_k25_decode"))
        with ThreadPoolExecutor(1) as step:
            decoded = [outputs_of(r) for r in step.submit(decode.execute, requests).result()]
        requests = [FakeRequest(**{n: d[n] for n in DECODED}, requested=(name,)) for d in decoded]
        handed_out.clear()
        served = PreprocessModel(pb, model_args(model))
    else:
        served = FusedVisionModel(pb, model_args(model))
        handed_out.clear()
    expected = [getattr(preprocess_bytes(photo, "kimi-k2.5", output=output), output) for photo in photos]
    with ThreadPoolExecutor(1) as stub:  # a fresh thread: no arena buffers of earlier tests' models
        for request, pixels in zip(requests, [*expected, np.concatenate(expected)], strict=True):
            (response,) = stub.submit(served.execute, [request]).result()
            np.testing.assert_array_equal(outputs_of(response)[name], pixels[None])
    assert len(handed_out) == 3 and handed_out[0] == handed_out[1]


@pytest.mark.parametrize("kind", ["preprocess", "vision_fused", "vision_fused_u8"])
def test_preprocess_computes_only_the_requested_outputs(
    pb: SimpleNamespace, images: dict[str, bytes], monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """Each request gets exactly the outputs it names among the model's (as Triton passes them: an
    ensemble step its output_map, a client its list or, naming none, all of the config's), and
    only their kernels run; in the preprocess model and in the fused models alike (one pixel
    output each, so naming none computes that one only)."""
    decode = DecodeModel(pb, model_args("kimi_k3_decode"))
    model_class = PreprocessModel if kind == "preprocess" else FusedVisionModel
    model = model_class(pb, model_args(f"kimi_k3_{kind}"))
    offered = {output["name"] for output in model.config["output"]}

    def request(data: bytes, decoded: dict[str, Any], requested: tuple[str, ...] | None) -> Any:
        if kind != "preprocess":
            return model.execute([bytes_request(data, requested=requested)])[0]
        inputs = {key: decoded[key] for key in DECODED}
        return model.execute([FakeRequest(requested=requested, **inputs)])[0]

    calls: list[str] = []
    for module, name in [
        (pipeline, "write_patches"),
        (pipeline, "patchify"),
        (pipeline, "resize"),
        (request_tensors, "pixel_values_from_patches"),
    ]:
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    everything = ("PIXEL_VALUES", "PIXEL_PATCHES", "GRID_THW", "NUM_TOKENS")
    selections: list[tuple[tuple[str, ...], list[str]]] = [
        (("PIXEL_VALUES", "GRID_THW", "NUM_TOKENS"), ["resize", "write_patches"]),  # kimi_*_vision step
        (("PIXEL_PATCHES", "GRID_THW", "NUM_TOKENS"), ["resize", "patchify"]),  # kimi_*_vision_u8 step
        (("PIXEL_VALUES",), ["resize", "write_patches"]),  # kimi_k25_vision_embed step
        (everything, ["resize", "patchify", "pixel_values_from_patches"]),  # kimi_*_preprocess, none named
        (("GRID_THW",), []),  # no pixels asked for: no resize either
    ]
    asked = [(requested, kernels) for requested, kernels in selections if set(requested) <= offered]
    # A request that cannot say gets the config's outputs, with the kernels of that selection.
    asked.append((None, next(kernels for requested, kernels in selections if set(requested) == offered)))
    for name in ("pilx__p_trns_single.png", "imagers__large_image.jpg"):
        data = images[name]
        (decoded,) = [outputs_of(r) for r in decode.execute([bytes_request(data)])]
        expected = preprocess_bytes(data, "kimi-k3")
        patches = preprocess_bytes(data, "kimi-k3", output="pixel_patches").pixel_patches
        for requested, kernels in asked:
            calls.clear()
            outputs = outputs_of(request(data, decoded, requested))
            assert set(outputs) == set(requested or offered), (name, requested)
            assert calls == kernels, (name, requested)
            if "PIXEL_VALUES" in outputs:
                assert outputs["PIXEL_VALUES"].dtype == np.float32
                assert outputs["PIXEL_VALUES"][0].tobytes() == expected.pixel_values.tobytes()
            if "PIXEL_PATCHES" in outputs:
                assert outputs["PIXEL_PATCHES"].dtype == np.uint8
                np.testing.assert_array_equal(outputs["PIXEL_PATCHES"], patches[None])
            if "GRID_THW" in outputs:
                np.testing.assert_array_equal(outputs["GRID_THW"], expected.grid_thw[None, None])
            if "NUM_TOKENS" in outputs:
                assert outputs["NUM_TOKENS"].tolist() == [[expected.num_tokens]]


def handed_over(*images: np.ndarray, modes: tuple[str, ...] = (), resample: tuple[int, ...] = ()) -> dict:
    """The preprocess inputs a decode step hands over for ``images`` (uint8 ``(H, W, C)`` each)."""
    offsets = np.cumsum([0] + [image.size for image in images[:-1]])
    return {
        "IMAGE": np.concatenate([image.reshape(-1) for image in images])[None],
        "IMAGE_SHAPES": np.array([[[*image.shape, o] for image, o in zip(images, offsets, strict=True)]], np.int64),
        "MODE": np.array([[m.encode() for m in (modes or ("RGB",) * len(images))]], dtype=np.object_),
        "RESAMPLE": np.array([list(resample or (0,) * len(images))], np.uint8),
    }


def test_preprocess_rejects_bad_inputs_per_request(pb: SimpleNamespace, images: dict[str, bytes]) -> None:
    prep = PreprocessModel(pb, model_args("kimi_k25_preprocess"))
    good = np.asarray(Image.open(io.BytesIO(images["pil__hopper.jpg"])).convert("RGB"))
    outside = handed_over(good)
    outside["IMAGE_SHAPES"] = np.array([[[128, 129, 3, 0]]], np.int64)  # one row more than IMAGE holds
    bad_requests = [
        FakeRequest(**handed_over(good)),
        FakeRequest(**handed_over(np.zeros((8, 8, 4), np.uint8), modes=("RGBA",))),  # RGBA under K2.5
        FakeRequest(**outside),
        FakeRequest(**handed_over(good, resample=(7,))),  # unknown filter
        FakeRequest(**{**handed_over(good), "IMAGE": good.reshape(1, -1).astype(np.float32)}),
        FakeRequest(**handed_over(good), cancelled=True),
        FakeRequest(**handed_over(good, good[:50, :70])),  # two images, different sizes
    ]
    responses = prep.execute(bad_requests)
    assert [r.error.code if r.error else None for r in responses] == [
        None, "INVALID_ARG", "INVALID_ARG", "INVALID_ARG", "INVALID_ARG", "CANCELLED", None,
    ]  # fmt: skip
    assert "MODE 'RGBA'" in responses[1].error.message and "outside IMAGE" in responses[2].error.message
    assert "uint8" in responses[4].error.message
    expected = preprocess_images([images["pil__hopper.jpg"]])
    np.testing.assert_array_equal(outputs_of(responses[0])["PIXEL_VALUES"][0], expected.pixel_values)
    two = outputs_of(responses[6])
    first = preprocess_bytes(images["pil__hopper.jpg"]).pixel_values
    assert np.array_equal(two["PIXEL_VALUES"][0, : len(first)], first)
    # 70x50 pads to 84x56 (spec section 3): a 4x6 grid, 2x3 = 6 tokens
    assert two["GRID_THW"].tolist() == [[[1, 10, 10], [1, 4, 6]]] and two["NUM_TOKENS"].tolist() == [[25, 6]]


def test_preprocess_takes_images_at_their_navit_size_only_with_their_stored_size(
    pb: SimpleNamespace, images: dict[str, bytes]
) -> None:
    """STORED_SIZES says which size each IMAGE is at: an image Pillow itself resized to the NaViT
    size of its stored size gives the processor's pixel_values; any other size, a presized image
    that is not RGB, or a STORED_SIZES of the wrong shape is the client's error."""
    prep = PreprocessModel(pb, model_args("kimi_k25_preprocess"))
    data = images["imagers__large_image.jpg"]  # 2268x1512: K2.5 resizes it
    stored = Image.open(io.BytesIO(data)).convert("RGB")
    size = ref_size(stored.width, stored.height, REF_PRESETS["kimi-k2.5"])
    presized = k25_rgb(stored, size)  # the reference's Pillow resize
    sizes = np.array([[[stored.height, stored.width]]], np.int64)
    wrong = np.asarray(stored.resize((size.new_w - 1, size.new_h), Image.Resampling.BICUBIC))
    requests = [
        FakeRequest(**handed_over(presized), STORED_SIZES=sizes),
        FakeRequest(**handed_over(np.asarray(stored)), STORED_SIZES=sizes),  # at its stored size
        FakeRequest(**handed_over(presized)),  # no STORED_SIZES: taken as a stored-size image
        FakeRequest(**handed_over(wrong), STORED_SIZES=sizes),
        FakeRequest(**handed_over(presized), STORED_SIZES=sizes[:, :, :1]),
        FakeRequest(**handed_over(presized), STORED_SIZES=np.zeros((1, 1, 2), np.int64)),
    ]
    responses = prep.execute(requests)
    assert [r.error.code if r.error else None for r in responses] == [None, None, None, *["INVALID_ARG"] * 3]
    assert f"neither its stored size {stored.width}x{stored.height} nor its NaViT size" in responses[3].error.message
    assert "STORED_SIZES must have shape [1, 1, 2]" in responses[4].error.message
    expected = preprocess_bytes(data)
    for response in responses[:2]:
        np.testing.assert_array_equal(outputs_of(response)["PIXEL_VALUES"][0], expected.pixel_values)
        np.testing.assert_array_equal(outputs_of(response)["GRID_THW"][0, 0], expected.grid_thw)
    k3 = PreprocessModel(pb, model_args("kimi_k3_preprocess"))
    k3_size = ref_size(8000, 6000, REF_PRESETS["kimi-k3"])  # an RGBA source K3 resizes
    rgba = np.zeros((k3_size.new_h, k3_size.new_w, 4), np.uint8)
    k3_sizes = np.array([[[6000, 8000]]], np.int64)
    (refused,) = k3.execute([FakeRequest(**handed_over(rgba, modes=("RGBA",)), STORED_SIZES=k3_sizes)])
    assert refused.error.code == "INVALID_ARG" and "RGBA, neither" in refused.error.message


def test_preprocess_takes_gpu_input_through_dlpack(pb: SimpleNamespace, images: dict[str, bytes]) -> None:
    """A tensor that is not on the host is wrapped via DLPack (no as_numpy) and processed with torch."""
    prep = PreprocessModel(pb, model_args("kimi_k25_preprocess"))
    pixels = torch.from_numpy(np.asarray(Image.open(io.BytesIO(images["pil__hopper.jpg"])).convert("RGB")).copy())[None]
    inputs = handed_over(pixels[0].numpy())
    request = FakeRequest(**{**inputs, "IMAGE": FakeTensor("IMAGE", pixels.reshape(1, -1), on_gpu=True)})
    (response,) = prep.execute([request])
    np.testing.assert_array_equal(
        outputs_of(response)["PIXEL_VALUES"][0], preprocess_bytes(images["pil__hopper.jpg"]).pixel_values
    )


# -- fused model ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["vision_fused", "vision_fused_u8"])
@pytest.mark.parametrize(("family", "preset"), [("k25", "kimi-k2.5"), ("k3", "kimi-k3")])
def test_fused_model_equals_library(
    pb: SimpleNamespace, images: dict[str, bytes], family: str, preset: str, kind: str
) -> None:
    """One batch decode per execute, then each image preprocessed: PIXEL_VALUES (``_vision_fused``)
    or PIXEL_PATCHES (``_u8``), the only pixel output computed when none is named, bit-equal to
    in-process preprocessing (downscaled JPEG, palette PNG: chessboard under K3, CMYK)."""
    name = f"kimi_{family}_{kind}"
    pixels = "PIXEL_PATCHES" if kind.endswith("_u8") else "PIXEL_VALUES"
    model = FusedVisionModel(pb, model_args(name))
    calls: list[int] = []
    real_decode_batch = model.decoding.decoder.decode_batch
    model.decoding.decoder.decode_batch = lambda items, p: calls.append(len(items)) or real_decode_batch(items, p)
    responses = model.execute([bytes_request(data) for data in images.values()])
    assert calls == [len(images)]
    for data, response in zip(images.values(), responses, strict=True):
        outputs, expected = outputs_of(response), preprocess_bytes(data, preset)
        patches = preprocess_bytes(data, preset, output="pixel_patches").pixel_patches
        assert set(outputs) == {pixels, "GRID_THW", "NUM_TOKENS"}  # none named: the config's
        wanted = patches if pixels == "PIXEL_PATCHES" else expected.pixel_values
        assert outputs[pixels].dtype == wanted.dtype and np.array_equal(outputs[pixels], wanted[None])
        np.testing.assert_array_equal(outputs["GRID_THW"], expected.grid_thw[None, None])
        assert outputs["NUM_TOKENS"].dtype == np.int32 and outputs["NUM_TOKENS"].tolist() == [[expected.num_tokens]]
    assert counter("kimi_prep_decodes_total", model=name) == len(images)
    assert counter("kimi_prep_decodes_total", model=name, path="pillow") >= 2  # palette PNG, CMYK JPEG
    assert counter("kimi_prep_stage_seconds_total", model=name, stage="vision") > 0
    assert not counter("kimi_prep_errors_total")


def test_fused_model_isolates_errors_per_request(
    pb: SimpleNamespace, images: dict[str, bytes], corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bad bytes, a malformed request, a cancelled one and a bug in one image's preprocess each
    fail their own request only, with the library's message; the others are bit-exact."""
    model = FusedVisionModel(pb, model_args("kimi_k3_vision_fused"))
    truncated = (corpus / "pil__truncated_jpeg.jpg").read_bytes()
    real_outputs = components.preprocess_outputs

    def buggy(decoded: Any, preset: Any, requested: Any = None) -> Any:
        if any(image.width == 2268 for image in decoded):  # imagers__large_image.jpg
            raise RuntimeError("preprocess bug (test)")
        return real_outputs(decoded, preset, requested)

    monkeypatch.setattr(components, "preprocess_outputs", buggy)
    batch = [
        bytes_request(images["pil__hopper.jpg"], requested=("PIXEL_PATCHES", "GRID_THW", "NUM_TOKENS")),
        bytes_request(truncated),
        bytes_request(images["pilx__p_trns_single.png"], cancelled=True),
        FakeRequest(IMAGE_BYTES=np.array([[b"x"], [b"y"]], dtype=np.object_)),  # two images in one request
        bytes_request(images["imagers__large_image.jpg"]),
        bytes_request(images["pilx__p_trns_single.png"], requested=("PIXEL_VALUES",)),
        FakeRequest(),  # input missing
    ]
    responses = model.execute(batch)
    codes = [r.error.code if r.error else None for r in responses]
    assert codes == [None, "INVALID_ARG", "CANCELLED", "INVALID_ARG", "INTERNAL", None, "INVALID_ARG"]
    with pytest.raises(PreprocessError) as raised:
        preprocess_images([truncated], "kimi-k3")
    assert responses[1].error.message == served_message(raised.value)  # the class tag, then the library's text
    assert "one request per batch element" in responses[3].error.message
    assert "missing input" in responses[6].error.message
    assert "preprocess bug (test)" in responses[4].error.message
    assert any(level == "log_error" and "preprocess bug (test)" in line for level, line in FakeLogger.lines)
    hopper = outputs_of(responses[0])
    assert set(hopper) == {"PIXEL_PATCHES", "GRID_THW", "NUM_TOKENS"}
    expected = preprocess_bytes(images["pil__hopper.jpg"], "kimi-k3", output="pixel_patches")
    assert np.array_equal(hopper["PIXEL_PATCHES"][0], expected.pixel_patches)
    palette = outputs_of(responses[5])
    assert set(palette) == {"PIXEL_VALUES"}
    assert np.array_equal(
        palette["PIXEL_VALUES"][0], preprocess_bytes(images["pilx__p_trns_single.png"], "kimi-k3").pixel_values
    )
    assert counter("kimi_prep_decodes_total", model="kimi_k3_vision_fused") == 3  # hopper, large, palette
    assert counter("kimi_prep_errors_total", reason="invalid_image") == 1
    assert counter("kimi_prep_errors_total", reason="cancelled") == 1
    assert counter("kimi_prep_errors_total", reason="invalid_request") == 2
    assert counter("kimi_prep_errors_total", reason="internal") == 1


# -- tensors in and out ---------------------------------------------------------------------------


class FakeCudaTensor:
    """A torch tensor that says it lives on a CUDA device (enough for ``output_tensor``)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.device = SimpleNamespace(type="cuda", index=0)

    @property
    def shape(self) -> torch.Size:
        return self.tensor.shape

    def numel(self) -> int:
        return self.tensor.numel()

    def contiguous(self) -> FakeCudaTensor:
        return FakeCudaTensor(self.tensor.contiguous())


# The fake takes torch's kernels (they only read .device, .shape and .contiguous()).
register_kernel("output_tensor", type_key(FakeCudaTensor))(tensors._torch_output)
register_kernel("cuda_device", type_key(FakeCudaTensor))(tensors._torch_device)


def test_input_array_wraps_device_tensors_without_copy() -> None:
    source = torch.arange(12, dtype=torch.uint8).reshape(1, 2, 2, 3)
    wrapped = input_array(FakeTensor("IMAGE", source, on_gpu=True))
    assert isinstance(wrapped, torch.Tensor) and wrapped.data_ptr() == source.data_ptr()
    host = np.zeros((1, 2), dtype=np.int64)
    assert input_array(FakeTensor("ORIGINAL_SIZE", host)) is host


def test_output_tensor_hands_cuda_tensors_over_by_dlpack(pb: SimpleNamespace) -> None:
    strided = torch.arange(24, dtype=torch.float32).reshape(4, 6).t()  # not contiguous
    tensor = output_tensor(pb, "PIXEL_VALUES", FakeCudaTensor(strided))
    assert tensor.via_dlpack and tensor.name == "PIXEL_VALUES"
    assert tensor.value.tensor.is_contiguous() and torch.equal(tensor.value.tensor, strided)
    host = output_tensor(pb, "X", torch.ones(2, 3)[:, ::2])
    assert not host.via_dlpack and isinstance(host.value, np.ndarray) and host.value.flags.c_contiguous
    for empty in (np.zeros((1, 0, 3)), torch.zeros(0), FakeCudaTensor(torch.zeros(1, 0))):
        with pytest.raises(ValueError, match="empty"):
            output_tensor(pb, "IMAGE", empty)


def test_cuda_outputs_are_synchronized_before_hand_over(pb: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    synchronized: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", synchronized.append)
    response = TritonIO(pb).response(
        {"PIXEL_VALUES": FakeCudaTensor(torch.zeros(1, 2)), "GRID_THW": np.ones((1, 3), np.int64)}
    )
    assert synchronized == ["cuda:0"] and response.outputs["PIXEL_VALUES"].via_dlpack
    TritonIO(pb).response({"GRID_THW": np.ones((1, 3), np.int64)})
    assert synchronized == ["cuda:0"]  # host-only responses never touch CUDA


def test_gpu_instances_pick_their_device(pb: SimpleNamespace) -> None:
    assert ServingModel(pb, model_args("kimi_k25_decode", kind="GPU", device_id=1)).device == "cuda:1"
    assert ServingModel(pb, model_args("kimi_k25_decode", kind="CPU", device_id=1)).device == "cpu"


def source_mode_pngs() -> dict[str, bytes]:
    """K3 sources resized in their own mode, sized past the 512-patch side limit (so resized)."""
    rng = np.random.default_rng(5)
    grey16 = Image.frombytes("I;16", (7300, 30), rng.integers(0, 65536, 7300 * 30, dtype=np.uint16).tobytes())
    keyed = Image.fromarray(rng.integers(0, 256, (40, 7300), dtype=np.uint8), "L")
    pngs = {}
    for name, image, options in (("I;16", grey16, {}), ("L transparency=17", keyed, {"transparency": 17})):
        buffer = io.BytesIO()
        image.save(buffer, "PNG", **options)
        pngs[name] = buffer.getvalue()
    return pngs


def test_source_mode_images_are_resized_in_their_mode_by_either_step(
    pb: SimpleNamespace, images: dict[str, bytes]
) -> None:
    """K3's source-mode images (CMYK, I;16, L with a transparency key) are resized with Pillow in
    their own mode: by the decode step, which hands them over as RGB at their NaViT size, and by
    the preprocess step when an upstream decoder sends them at the stored size as raw bytes with
    their MODE (which it rebuilds); both equal the library."""
    decode = DecodeModel(pb, model_args("kimi_k3_decode"))
    prep = PreprocessModel(pb, model_args("kimi_k3_preprocess"))
    sources = {"CMYK": images["pil__pil_sample_cmyk.jpg"], **source_mode_pngs()}
    for mode, data in sources.items():
        (hop,) = [outputs_of(r) for r in decode.execute([bytes_request(data)])]
        width, height = Image.open(io.BytesIO(data)).size
        assert hop["MODE"][0, 0] == b"RGB" and hop["STORED_SIZES"].tolist() == [[[height, width]]]
        upstream = request_tensors.decode_outputs([decode.decoding.decoder.decode(data, KIMI_K3)])
        assert upstream["MODE"][0, 0] == mode.encode()
        (shape,) = upstream["IMAGE_SHAPES"][0].tolist()
        assert shape[:2] == [height, width] and upstream["IMAGE"].shape == (1, height * width * shape[2])
        expected = preprocess_bytes(data, "kimi-k3")
        for inputs in (hop, upstream):
            (response,) = prep.execute([FakeRequest(**{name: inputs[name] for name in DECODED})])
            assert outputs_of(response)["PIXEL_VALUES"][0].tobytes() == expected.pixel_values.tobytes(), mode
    raw = handed_over(np.zeros((4, 4, 2), np.uint8), modes=("CMYK",))  # 2 bytes a pixel, CMYK has 4
    inputs = [raw[name] for name in DECODED if name != "STORED_SIZES"]
    with pytest.raises(InvalidRequestError, match="not raw 'CMYK'"):
        decoded_from_inputs(*inputs, None, KIMI_K3)
    with pytest.raises(InvalidRequestError, match="MODE 'CMYK'"):
        decoded_from_inputs(*inputs, None, KIMI_K25)


def test_images_from_input() -> None:
    assert images_from_input(np.array([[b"abc"]], dtype=np.object_), 16) == [b"abc"]
    assert images_from_input(np.array([[b"a", b"b", b"c"]], dtype=np.object_), 3) == [b"a", b"b", b"c"]
    with pytest.raises(InvalidRequestError, match="bytes"):
        images_from_input(np.array([[3]], dtype=np.object_), 16)
    with pytest.raises(InvalidRequestError, match="one request per batch element"):
        images_from_input(np.array([[b"a"], [b"b"]], dtype=np.object_), 16)
    with pytest.raises(InvalidRequestError, match=r"at most 2 \(max_images_per_request\)"):
        images_from_input(np.array([[b"a"] * 3], dtype=np.object_), 2)


# -- patch embed ----------------------------------------------------------------------------------


def test_patch_embed_model_equals_seeded_conv(pb: SimpleNamespace) -> None:
    model = PatchEmbedModel(pb, model_args("kimi_patch_embed"))
    torch.manual_seed(0)
    reference = torch.nn.Conv2d(3, 1152, kernel_size=14, stride=14)
    assert torch.equal(model.conv.weight, reference.weight) and torch.equal(model.conv.bias, reference.bias)
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((1, n, 3, 14, 14)).astype(np.float32) for n in (4, 9))
    responses = model.execute(
        [FakeRequest(PIXEL_VALUES=a), FakeRequest(PIXEL_VALUES=a[:, :, :2]), FakeRequest(PIXEL_VALUES=b)]
    )
    assert responses[1].error.code == "INVALID_ARG"
    with torch.inference_mode():
        for x, response in ((a, responses[0]), (b, responses[2])):
            expected = reference(torch.from_numpy(x[0])).flatten(1).numpy()
            np.testing.assert_allclose(outputs_of(response)["PATCH_EMBEDS"][0], expected, rtol=1e-5, atol=1e-5)
    state = torch.random.get_rng_state()
    make_patch_embed(0)
    assert torch.equal(state, torch.random.get_rng_state())  # the caller's RNG is left alone


# -- launcher -------------------------------------------------------------------------------------


def rendered_files(root: Path) -> dict[str, str]:
    """Relative path -> text of every file under ``root`` (``__pycache__`` ignored)."""
    return {
        str(path.relative_to(root)): path.read_text()
        for path in sorted(root.rglob("*"))
        if path.is_file() and "__pycache__" not in path.parts
    }


def test_checked_in_repository_is_a_fresh_rendering(tmp_path: Path) -> None:
    """model_repository/ is `make repository`'s output: a fresh rendering has the same tracked files."""
    tracked = subprocess.run(
        ["git", "ls-files", "model_repository"], cwd=REPOSITORY.parent, capture_output=True, text=True, check=False
    )
    rendered = rendered_files(render_repository(tmp_path / "repo"))
    if tracked.returncode == 0 and tracked.stdout:
        names = {line.removeprefix("model_repository/") for line in tracked.stdout.splitlines()}
        assert names == set(rendered), "run `make repository`"
    assert rendered == rendered_files(REPOSITORY), "model_repository/ differs from a fresh rendering: `make repository`"


# The import lines of the model.py files a repository rendered before the server's models/ folder
# holds (an operator's own rendering, a KServe volume): they must keep loading the same classes.
RENDERED_BEFORE_MODELS_FOLDER = (
    "from kimi_vision_server.contract import triton_python_model",
    "from kimi_vision_server.models import DecodeModel",
    "from kimi_vision_server.models import PreprocessModel",
    "from kimi_vision_server.models import FusedVisionModel",
    "from kimi_vision_server.models import PatchEmbedModel",
    "from kimi_vision_server.media_models import TokensModel",
    "from kimi_vision_server.media_models import VideoChunkModel",
    "from kimi_vision_server.media_models import VideoModel",
)


@pytest.mark.parametrize("line", RENDERED_BEFORE_MODELS_FOLDER)
def test_a_repository_rendered_before_the_models_folder_still_loads(line: str) -> None:
    """Each old import line gives the very class (or function) today's rendering names."""
    name = line.rsplit(" ", 1)[1]
    today = {
        "triton_python_model": "kimi_vision_server.models.contract",
        "TokensModel": "kimi_vision_server.models.media",
        "VideoChunkModel": "kimi_vision_server.models.media",
        "VideoModel": "kimi_vision_server.models.media",
    }.get(name, "kimi_vision_server.models.images")
    rendered_today = "\n".join(
        (REPOSITORY / model / "1" / "model.py").read_text()
        for model in all_models()
        if (REPOSITORY / model / "1" / "model.py").is_file()
    )
    assert f"from {today} import {name}" in rendered_today
    old, new = {}, {}
    exec(line, old)
    exec(f"from {today} import {name}", new)
    assert old[name] is new[name]


def test_rendering_is_derived_from_the_presets(tmp_path: Path) -> None:
    """Every served preset gets its models by the naming rule, with its parameters and its patch size
    in the output dims; kimi-k2.6 (kimi-k2.5's preset) is not served twice; the embed chain is K2.5's."""
    configs = {name: load_config(name) for name in all_models()}
    for prefix, preset in (("kimi_k25", KIMI_K25), ("kimi_k3", KIMI_K3)):
        for kind in ("decode", "preprocess", "vision_fused", "vision_fused_u8"):
            assert preset_from_parameters(model_parameters(config_dict(f"{prefix}_{kind}"))) == preset
        for kind in ("preprocess", "vision", "vision_u8", "vision_fused", "vision_fused_u8"):
            dims = {o.name: list(o.dims) for o in configs[f"{prefix}_{kind}"].output}
            for name in {"PIXEL_VALUES", "PIXEL_PATCHES"} & dims.keys():
                assert dims[name] == [-1, 3, preset.patch_size, preset.patch_size]
    assert not any(name.startswith("kimi_k26") for name in configs)
    assert [name for name in configs if name.endswith("_vision_embed")] == ["kimi_k25_vision_embed"]


def test_render_options_change_only_their_fields(tmp_path: Path) -> None:
    rendered = render_repository(tmp_path / "repo", RenderOptions(instances=3, threads=1, kind="cpu"))
    threaded = 0
    for name in all_models():
        config, original = load_config(name, rendered), load_config(name)
        if config.platform == "ensemble" and any(step.model_name.endswith("_patchify") for step in
                                                 config.ensemble_scheduling.step):  # fmt: skip
            continue  # a CPU rendering's pixel step: tests/test_patchify_backend.py
        for key in ("numba_threads", "codec_threads", "cpu_decode_threads", "ffmpeg_threads"):
            if key in original.parameters:
                assert config.parameters[key].string_value == "1"
                original.parameters[key].string_value = "1"
                threaded += 1
        for group in original.instance_group:
            group.count, group.kind = 3, model_config_pb2.ModelInstanceGroup.KIND_CPU
        if name.endswith("_decode"):  # CPU instances decode one request an execute (repository.decode_model)
            assert config.max_batch_size == SERVING_DEFAULTS.pixel_batch_size
            original.max_batch_size = config.max_batch_size
            original.dynamic_batching.CopyFrom(config.dynamic_batching)
        assert config == original, name  # nothing else changed
    # codec_threads and cpu_decode_threads: decode, 2 fused, video_chunk; ffmpeg_threads: video;
    # numba_threads: decode, preprocess, 2 fused, video, video_chunk
    assert threaded == 2 * (2 * 4 + 1 + 6)  # x2 presets
    args = build_parser().parse_args(["serve", "--instances", "2", "--threads", "1", "--kind", "gpu"])
    assert (args.instances, args.threads, args.kind) == (2, 1, "gpu")
    for bad in ({"instances": 0}, {"threads": -1}, {"kind": "tpu"}):
        with pytest.raises(ValueError):
            RenderOptions(**bad)


def test_server_args_and_embedded_layout(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    pytest.importorskip("pytriton")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep + "/usr/bin:/bin")
    install = triton_install.find_tritonserver()
    assert install.embedded and install.backend_directory is not None
    assert install.backend_directory.is_relative_to(tmp_path / "kimi_vision_prep" / "triton")
    python = install.backend_directory / "python"
    assert {p.name for p in python.iterdir()} == {
        "libtriton_python.so", "triton_python_backend_utils.py", "triton_python_backend_stub", "bin",
    }  # fmt: skip
    assert (python / "triton_python_backend_stub").read_text() == triton_install.STUB_WRAPPER
    assert os.access(python / "bin" / "triton_python_backend_stub", os.X_OK)
    assert triton_install.find_tritonserver().backend_directory == install.backend_directory  # laid out once
    assert install.env["PATH"].split(os.pathsep)[0] == os.path.dirname(sys.executable)
    assert install.env["LD_LIBRARY_PATH"].startswith(
        str(Path(sys.modules["pytriton"].__file__).parent.parent / "nvidia_pytriton.libs")
    )
    assert install.env["NUMBA_CACHE_DIR"].startswith(str(tmp_path))  # the stubs' numba cache, set by the launcher
    access = AccessPolicy("k" * 24)
    args = command.server_args(install, tmp_path, command.Ports(1, 2, 3), access)
    assert set(access_args(access)) <= set(args)  # loopback listeners, restricted admin APIs
    assert "--model-control-mode=explicit" in args and "--load-model=*" in args
    assert "--disable-auto-complete-config" in args  # no config-completing stub on every (re)load
    assert f"--backend-directory={install.backend_directory}" in args
    shm = next(a for a in args if "shm-default-byte-size" in a)
    assert int(shm.rsplit("=", 1)[1]) > 24 << 20  # a 1920x1080 PIXEL_VALUES (~25 MiB) fits the first region
    ours = f"--grpc-infer-allocation-pool-size={command.GRPC_INFER_POOL_SIZE}"
    operators = "--grpc-infer-allocation-pool-size=8"
    overridden = command.server_args(install, tmp_path, command.Ports(1, 2, 3), access, extra_args=[operators])
    assert overridden.index(ours) < overridden.index(operators)  # the operator's comes last: it wins


@pytest.mark.parametrize("folder", ["64 MiB", "cap(default)", "a;b"])
def test_a_repository_path_no_stub_can_start_from_is_refused_at_once(tmp_path: Path, folder: str) -> None:
    """Triton 2.51 starts stubs through `bash -c` with the path unquoted: such a repository would only
    time out, so the launcher refuses it before starting tritonserver."""
    repository = render_repository(tmp_path / folder, names=["kimi_k25_tokens"])
    server = embedded.EmbeddedServer(repository, startup_timeout_s=5)
    with pytest.raises(ValueError, match="cannot start a stub"), server:
        pass
    assert server.process is None  # no tritonserver was started
    assert command.checked_repository_path(tmp_path / "plain_name-1.0") == tmp_path / "plain_name-1.0"


def test_serve_forwards_sigterm_and_returns_the_exit_code(tmp_path: Path) -> None:
    """``serve`` runs the server in the foreground, forwards SIGTERM and returns its exit code."""
    fake_server = tmp_path / "tritonserver"
    fake_server.write_text(
        textwrap.dedent(f"""\
        #!{sys.executable}
        import signal, sys, time
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))
        open({str(tmp_path / "args")!r}, "w").write("\\n".join(sys.argv[1:]))
        while True:
            time.sleep(0.05)
    """)
    )
    fake_server.chmod(0o755)
    script = textwrap.dedent(f"""\
        import sys
        from pathlib import Path
        from kimi_vision_server.launch import command, launcher, serve
        from kimi_vision_server.render.repository import RenderOptions
        from kimi_vision_server.triton_install import TritonInstall
        launcher.find_tritonserver = lambda: TritonInstall(Path({str(fake_server)!r}), None, {{}}, False)
        spec = launcher.LaunchSpec(
            command.Ports(18000, 18001, 18002), render=RenderOptions(instances=2), extra_args=["--log-verbose=1"]
        )
        sys.exit(serve.serve(spec))
    """)
    process = subprocess.Popen([sys.executable, "-c", script])
    args_file = tmp_path / "args"
    for _ in range(600):  # until the fake server has started
        if args_file.exists() and args_file.read_text():
            break
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 7
    args = args_file.read_text().splitlines()
    assert "--http-port=18000" in args and "--grpc-port=18001" in args and "--metrics-port=18002" in args
    assert args[-1] == "--log-verbose=1"
    repository = next(a.split("=", 1)[1] for a in args if a.startswith("--model-repository="))
    assert repository != str(REPOSITORY) and not Path(repository).exists()  # rendered to a temp dir, cleaned up


def server_ignoring_sigint() -> subprocess.Popen[bytes]:
    """A stand-in for a tritonserver that does not exit on SIGINT, as one waiting for a version
    that never unloads."""
    code = "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); print('up', flush=True); time.sleep(600)"
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert process.stdout is not None and process.stdout.readline() == b"up\n"
    return process


def test_a_stopping_server_left_only_with_a_pinned_version_is_ended_as_stopped() -> None:
    """Asked to stop, running no stub and waiting only for a version a crashed stub pinned: ended,
    and that counts as a clean stop (0), not tritonserver's exit-timeout failure."""
    from kimi_vision_server.launch import process as server_process

    process = server_ignoring_sigint()
    assert server_process.stop_process(process, timeout_s=600, pinned=lambda: ["kimi_k25_decode"]) == 0
    assert process.returncode == -signal.SIGKILL


def test_a_stopping_server_is_waited_for_while_it_runs_a_stub(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a pinned version, a server that still runs a stub (a request in flight, a model not yet
    unloaded) is waited for; it is ended only after it has run none for PINNED_ONLY_AFTER_S."""
    from kimi_vision_server.launch import process as server_process

    scans: list[float] = []

    def stubs(server_pid: int) -> list[str]:
        scans.append(time.monotonic())
        return ["a stub"] if len(scans) <= 8 else []

    monkeypatch.setattr(server_process, "stub_processes", stubs)
    process = server_ignoring_sigint()
    assert server_process.stop_process(process, timeout_s=600, pinned=lambda: ["kimi_k25_decode"]) == 0
    assert len(scans) > 8 and scans[-1] - scans[8] >= server_process.PINNED_ONLY_AFTER_S


def test_without_a_pinned_version_a_server_that_does_not_stop_is_killed_at_the_timeout() -> None:
    from kimi_vision_server.launch import process as server_process

    process = server_ignoring_sigint()
    assert server_process.stop_process(process, timeout_s=1.0) == -signal.SIGKILL


@pytest.mark.parametrize("kind", ["decode+preprocess", "fused", "video", "video_chunk"])
def test_warmup_leaves_nothing_to_compile(corpus: Path, kind: str) -> None:
    """After initialize(), real requests (writable or read-only buffers, any selection of outputs)
    hit no new numba signature: the preprocess model's (the decode model's outputs, as Triton hands
    them over), the fused model's (its own decoder's), the video model's (clips of every codec,
    frame size and row padding of the media tests, planned or decoded whole) and the video-chunk
    model's (corpus images as frames), each warmed up on its own.

    Runs in a fresh interpreter so earlier tests' compilations cannot hide a missing warm-up."""
    script = textwrap.dedent(f"""\
        import itertools
        import sys
        import numba
        import numpy as np
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import test_serving_units as t
        from kimi_vision_prep.patchify import normalize
        from kimi_vision_prep.resize import resize_numba
        from kimi_vision_prep.video import digest
        from kimi_vision_server.models.media import VideoChunkModel, VideoModel
        from make_inputs import video_clips
        from types import SimpleNamespace

        def signatures():
            return {{
                (mod.__name__, name): len(fn.signatures)
                for mod in (normalize, resize_numba, digest)
                for name, fn in vars(mod).items()
                if isinstance(fn, numba.core.registry.CPUDispatcher)
            }}

        def check(family, before, after):
            assert before == after, (family, {{k: (before[k], after[k]) for k in after if before.get(k) != after[k]}})

        pb = SimpleNamespace(
            Tensor=t.FakeTensor, InferenceResponse=t.FakeResponse, TritonError=t.FakeTritonError,
            Logger=t.FakeLogger(), get_input_tensor_by_name=lambda request, name: request.inputs.get(name),
        )
        names = ["imagers__large_image.jpg", "pil__hopper.jpg", "pilx__uncompressed_la.png",
                 "pilx__transparent.webp", "pilx__p_trns_single.png", "pil__pil_sample_cmyk.jpg"]
        # float32 ensembles, uint8 ensembles, the embed chain, and a client naming no outputs (all)
        selections = [("PIXEL_VALUES", "GRID_THW", "NUM_TOKENS"), ("PIXEL_PATCHES", "GRID_THW", "NUM_TOKENS"),
                      ("PIXEL_VALUES",), None]
        clips = list(video_clips().values()) if {kind!r} == "video" else []
        for family in ("k25", "k3"):
            if {kind!r} == "video":
                video = VideoModel(pb, t.model_args(f"kimi_{{family}}_video"))
                before = signatures()
                for clip, requested in itertools.product(clips, selections):
                    request = t.FakeRequest(VIDEO_BYTES=np.array([[clip]], dtype=np.object_), requested=requested)
                    for _ in video.stream(request):
                        pass
                check(family, before, signatures())
                continue
            if {kind!r} == "video_chunk":
                chunk = VideoChunkModel(pb, t.model_args(f"kimi_{{family}}_video_chunk"))
                before = signatures()
                for name, requested in itertools.product(names, selections):
                    data = open({str(corpus)!r} + "/" + name, "rb").read()
                    frames = np.array([[data, data]], dtype=np.object_)
                    chunk.chunk(t.FakeRequest(FRAME_BYTES=frames, requested=requested))
                check(family, before, signatures())
                continue
            if {kind!r} == "fused":
                fused = t.FusedVisionModel(pb, t.model_args(f"kimi_{{family}}_vision_fused"))
                before = signatures()
                for name, requested in itertools.product(names, selections):
                    data = open({str(corpus)!r} + "/" + name, "rb").read()
                    t.outputs_of(fused.execute([t.bytes_request(data, requested=requested)])[0])
                check(family, before, signatures())
                continue
            decode = t.DecodeModel(pb, t.model_args(f"kimi_{{family}}_decode"))
            prep = t.PreprocessModel(pb, t.model_args(f"kimi_{{family}}_preprocess"))
            before = signatures()
            for name in names:
                (response,) = decode.execute([t.bytes_request(open({str(corpus)!r} + "/" + name, "rb").read())])
                out = t.outputs_of(response)
                for writable, requested in itertools.product((True, False), selections):
                    image = out["IMAGE"].copy()
                    image.setflags(write=writable)
                    inputs = dict(out, IMAGE=image)
                    t.outputs_of(prep.execute([t.FakeRequest(requested=requested, **inputs)])[0])
            check(family, before, signatures())
    """)
    result = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


def test_a_broken_metrics_backend_never_fails_requests(
    pb: SimpleNamespace, images: dict[str, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(self: Any, labels: dict[str, str]) -> Any:
        raise RuntimeError("metrics registry gone")

    monkeypatch.setattr(FakeMetricFamily, "Metric", broken)
    model = DecodeModel(pb, model_args("kimi_k25_decode"))
    (response,) = model.execute([bytes_request(images["pil__hopper.jpg"])])
    assert outputs_of(response)["IMAGE_SHAPES"].tolist() == [[[128, 128, 3, 0]]]
    assert not model.metrics.enabled and "metrics registry gone" in model.metrics.error


def test_library_warnings_are_logged_with_the_model_and_the_request(pb: SimpleNamespace, corpus: Path) -> None:
    """Pillow's warning about a palette PNG with byte transparency reaches the log once, naming
    the model and the request, instead of the stub's stderr; the image is still served."""
    model = DecodeModel(pb, model_args("kimi_k25_decode"))
    FakeLogger.lines = []
    (response,) = model.execute([bytes_request((corpus / "pilx__pil123p.png").read_bytes())])
    assert response.error is None
    warned = [line for level, line in FakeLogger.lines if level == "log_warn" and "Palette images" in line]
    assert len(warned) == 1, FakeLogger.lines
    assert warned[0].startswith("kimi_k25_decode: request gen-") and "UserWarning: Palette images" in warned[0]
