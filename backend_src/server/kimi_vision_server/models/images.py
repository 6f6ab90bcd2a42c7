"""The Python-backend models: each a :class:`~.contract.ServingModel` built from components.

The ``model.py`` files in ``model_repository/`` are two lines:
``TritonPythonModel = triton_python_model(<class>)``. Tensors: :mod:`.requests`; the execute
contract: :mod:`.contract`; decode and preprocess: :mod:`.components`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kimi_vision_common.presets import preset_from_parameters
from kimi_vision_common.wire import IMAGE, OPTIONAL_PREPROCESS_INPUT, PATCH_EMBEDS, PIXEL_VALUES, PREPROCESS_INPUTS
from kimi_vision_prep.pipeline import resized_decoded

from ..settings import parse_int, setting
from .components import ImageDecoding, ImagePreprocessing, apply_numba_threads
from .config import decoder_settings
from .contract import Result, ServingModel
from .requests import check_request_size, decode_outputs, decoded_from_inputs, pixel_values_from_input
from .tensors import cuda_device
from .warmup import warmup_decoded


class DecodeModel(ServingModel):
    """``kimi_*_decode``: encoded bytes -> pixels resized to their NaViT size
    (:func:`~kimi_vision_prep.pipeline.resized_decoded`: numba or torch, as the preprocess step
    would), each right after its decode (:meth:`~.components.ImageDecoding.decode_requests`)."""

    stage = "decode"

    def __init__(self, pb_utils: Any, args: Mapping[str, Any]) -> None:
        super().__init__(pb_utils, args)
        self.preset = preset_from_parameters(self.parameters)
        self.threads = apply_numba_threads(self.parameters)
        self.decoding = ImageDecoding(self, self.preset)
        for image in self.decoding.warmup:  # loads or compiles the resize kernels
            resized_decoded(image, self.preset)
        threads = self.threads or "default"
        settings = self.decoding.settings
        self.io.log(
            "info", f"{self.name}: preset {self.preset.name}, {self.device}, {settings}, numba_threads {threads}"
        )

    def handle(self, requests: Sequence[Any]) -> list[Result]:
        return self.per_request(self.decoding.decode_requests(requests, resize=True), decode_outputs)


class PreprocessModel(ServingModel):
    """``kimi_*_preprocess``: decoded pixels -> resize, pad, normalise, patchify (numba or torch)."""

    stage = "preprocess"

    def __init__(self, pb_utils: Any, args: Mapping[str, Any]) -> None:
        super().__init__(pb_utils, args)
        self.preset = preset_from_parameters(self.parameters)
        settings = decoder_settings(self.parameters)
        self.max_images, self.max_patches = settings.max_images_per_request, settings.max_patches_per_request
        # Warmed up from the inputs as this model receives them: the decode model's outputs, one
        # image a request and all of them in one.
        images = warmup_decoded(self.preset)
        warmup = [self.decoded_input(decode_outputs(batch)) for batch in ([[image] for image in images] + [images])]
        self.preprocessing = ImagePreprocessing(self, self.preset, warmup)
        self._logged_device_input = False
        threads = self.preprocessing.threads or "default"
        self.io.log("info", f"{self.name}: preset {self.preset}, device {self.device}, numba_threads {threads}")

    def decoded_input(self, inputs: Mapping[str, Any]) -> Any:
        named = (inputs[name] for name in PREPROCESS_INPUTS)
        decoded = decoded_from_inputs(*named, inputs.get(OPTIONAL_PREPROCESS_INPUT), self.preset)
        check_request_size(decoded, self.preset, self.max_images, self.max_patches)
        return decoded

    def process(self, request: Any) -> Result:
        inputs = {name: self.io.get_input(request, name) for name in PREPROCESS_INPUTS}
        inputs[OPTIONAL_PREPROCESS_INPUT] = self.io.get_optional_input(request, OPTIONAL_PREPROCESS_INPUT)
        self.note_image_memory(inputs[IMAGE])
        return self.preprocessing.outputs(self.decoded_input(inputs), request)

    def note_image_memory(self, image: Any) -> None:
        """Count the memory the IMAGE input arrived in; log the first device tensor's pointer (the
        zero-copy hand-off, checked on a GPU machine)."""
        device = cuda_device(image)
        self.metrics.count_image_input(device or "cpu")
        if device is not None and not self._logged_device_input:
            self._logged_device_input = True
            self.io.log("info", f"{self.name}: IMAGE input on {device} (is_cpu false), data_ptr {image.data_ptr():#x}")

    def handle(self, requests: Sequence[Any]) -> list[Result]:
        return self.per_request(requests, self.process)


class FusedVisionModel(ServingModel):
    """``kimi_*_vision_fused`` / ``_vision_fused_u8``: encoded bytes -> the preprocess outputs of
    its config (float32 or uint8 pixels, grid, tokens) in one model, for CPU hosts.

    The ``kimi_*_vision`` ensembles' work without their hop: no decoded image is copied into the
    stub's shared memory, read back by a second model and sent through a second stub round trip.
    All requests of one execute are decoded in one batch call, then each is preprocessed on its
    own, computing only its requested outputs (resized only where it asks for pixels).
    """

    stage = "vision"

    def __init__(self, pb_utils: Any, args: Mapping[str, Any]) -> None:
        super().__init__(pb_utils, args)
        self.preset = preset_from_parameters(self.parameters)
        self.decoding = ImageDecoding(self, self.preset)
        self.preprocessing = ImagePreprocessing(self, self.preset, [[image] for image in self.decoding.warmup])
        threads = self.preprocessing.threads or "default"
        settings = self.decoding.settings
        self.io.log("info", f"{self.name}: preset {self.preset}, {self.device}, {settings}, numba_threads {threads}")

    def handle(self, requests: Sequence[Any]) -> list[Result]:
        decoded = self.decoding.decode_requests(requests, resize=False)
        return [
            image if isinstance(image, BaseException) else self.attempt(self.preprocessing.outputs, image, request)
            for request, image in zip(requests, decoded, strict=True)
        ]


class PatchEmbedModel(ServingModel):
    """``kimi_patch_embed``: seeded Conv2d over the patches of every request in one call."""

    stage = "patch_embed"

    def __init__(self, pb_utils: Any, args: Mapping[str, Any]) -> None:
        super().__init__(pb_utils, args)
        from .patch_embed import make_patch_embed

        self.patch_size = parse_int("patch_size", self.parameters["patch_size"], 1)  # rendered with the model
        self.hidden_size = int(setting("hidden_size").parse(self.parameters))  # type: ignore[arg-type]
        self.seed = int(setting("seed").parse(self.parameters))  # type: ignore[arg-type]
        self.conv = make_patch_embed(self.seed, self.hidden_size, self.patch_size, self.device)
        self.io.log(
            "info", f"{self.name}: Conv2d(3, {self.hidden_size}, {self.patch_size}) seed {self.seed} on {self.device}"
        )

    def handle(self, requests: Sequence[Any]) -> list[Result]:
        import torch

        from .patch_embed import embed_patches

        inputs = self.per_request(
            requests,
            lambda r: pixel_values_from_input(self.io.get_input(r, PIXEL_VALUES), self.patch_size).to(self.device),
        )
        good = [x for x in inputs if not isinstance(x, BaseException)]
        embeds = iter(embed_patches(self.conv, torch.cat(good)).split([len(x) for x in good]) if good else ())
        return [x if isinstance(x, BaseException) else {PATCH_EMBEDS: next(embeds)[None]} for x in inputs]
