"""Tiny local Kimi K2.5 and K3 checkpoint folders for SGLang: enough for SGLang 0.5.23's
``TokenizerManager.init_tokenizer_and_processor`` to build its real ``KimiK2_5VLImageProcessor`` /
``KimiK3ImageProcessor`` on a CPU host, offline.

The config, tokenizer and ``media_proc_cfg`` are those of the vLLM checkpoints (tests/vllm/checkpoints.py,
imported, not copied): the real model types with small dims, the real media token ids. What SGLang needs
beyond them:

- K3's text config with MLA head sizes (SGLang's ``ModelConfig`` reads them);
- remote code (``auto_map``, loaded with ``trust_remote_code``) of the interface SGLang's CPU path calls:
  ``processor.media_processor`` with ``media_proc_cfg`` and ``media_tokens_calculator(media)``,
  ``processor(text=..., medias=...)`` returning ``input_ids``, ``pixel_values`` and ``grid_thws``.
  transformers' own ``Kimi_K25Processor`` has no ``media_processor``. The remote code is written here from
  the spec: its pixels are tests/reference.py's functions (the file is copied next to it as
  ``kimi_reference.py`` and imported relatively), fed the PIL image SGLang's loader hands over: K2.5
  ``convert("RGB")`` then bicubic; K3 bicubic in the source mode, then the chessboard for alpha.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

from kimi_vision_common.presets import get_preset, media_proc_cfg

TESTS = Path(__file__).resolve().parents[1]


def _vllm_checkpoints():
    """tests/vllm/checkpoints.py under its own module name (this module is ``checkpoints`` too)."""
    spec = importlib.util.spec_from_file_location("kimi_vllm_checkpoints", TESTS / "vllm" / "checkpoints.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


VLLM = _vllm_checkpoints()
MEDIA_PAD_ID = VLLM.MEDIA_PAD_ID
SPECIAL_TOKENS = VLLM.SPECIAL_TOKENS
PRESETS = ("kimi-k2.5", "kimi-k3")
# SGLang's model classes, the ``architectures`` of the config.
ARCHITECTURES = {"kimi-k2.5": "KimiK25ForConditionalGeneration", "kimi-k3": "KimiK3ForConditionalGeneration"}
PROCESSOR_MODULE = "kimi_processing"
REFERENCE_MODULE = "kimi_reference"
IMAGE_PROCESSOR_CLASSES = {"kimi-k2.5": "KimiK25VisionProcessor", "kimi-k3": "KimiK3VisionProcessor"}
PROCESSOR_CLASS = "KimiProcessor"
# MLA head sizes of K3's text config, as K2.5's (tests/vllm/checkpoints.py) has them.
K3_MLA = {"kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 32, "qk_rope_head_dim": 64, "v_head_dim": 32}

# The checkpoint's remote code (kimi_processing.py). Its absolute imports are what transformers'
# check_imports requires installed: numpy, PIL, torch (BatchFeature's "pt"), transformers.
PROCESSOR_SOURCE = '''\
"""Remote code of a tiny test checkpoint: the Kimi processor interface SGLang's CPU path calls, the
pixels computed by kimi_reference (the project's plain reference, tests/reference.py)."""

from __future__ import annotations

import numpy as np
from PIL import Image
from transformers import BatchFeature
from transformers.image_processing_utils import BaseImageProcessor
from transformers.processing_utils import ProcessorMixin

from .kimi_reference import PRESETS, k3_rgb, k25_rgb, normalize_patchify, ref_size


class _KimiVisionProcessor(BaseImageProcessor):
    """The checkpoint's ``media_processor``: ``media_proc_cfg``, ``media_tokens_calculator``, ``preprocess``."""

    preset_name = ""
    model_input_names = ["pixel_values", "grid_thws"]

    def __init__(self, media_proc_cfg=None, **kwargs):
        super().__init__(**kwargs)
        self.media_proc_cfg = dict(media_proc_cfg or {})
        preset = dict(PRESETS[self.preset_name])
        preset.update({key: value for key, value in self.media_proc_cfg.items() if key in preset})
        self.preset = preset

    def _image(self, media):
        if media.get("type") != "image":
            raise NotImplementedError(f"this test checkpoint processes images only, not {media.get('type')!r}")
        image = media["image"]
        if not isinstance(image, Image.Image):
            raise TypeError(f"expected a PIL image, got {type(image).__name__}")
        return image

    def media_tokens_calculator(self, media):
        image = self._image(media)
        return ref_size(image.width, image.height, self.preset).num_tokens

    def _rgb(self, image, size):
        if self.preset["transparency"] == "convert_rgb":
            return k25_rgb(image, size)
        return k3_rgb(image, size)

    def preprocess(self, medias, return_tensors=None, **kwargs):
        patches, grids = [], []
        for media in medias:
            image = self._image(media)
            size = ref_size(image.width, image.height, self.preset)
            patches.append(normalize_patchify(self._rgb(image, size), size, self.preset))
            grids.append([1, size.grid_h, size.grid_w])
        p = self.preset["patch_size"]
        data = {
            "pixel_values": np.concatenate(patches) if patches else np.zeros((0, 3, p, p), np.float32),
            "grid_thws": np.array(grids, dtype=np.int64).reshape(-1, 3),
        }
        return BatchFeature(data=data, tensor_type=return_tensors)


class KimiK25VisionProcessor(_KimiVisionProcessor):
    preset_name = "kimi-k2.5"


class KimiK3VisionProcessor(_KimiVisionProcessor):
    preset_name = "kimi-k3"


class KimiProcessor(ProcessorMixin):
    """``processor(text=..., medias=...)``: the text tokenized as given (its media placeholders already
    expanded by the caller), the medias' ``pixel_values`` and ``grid_thws``."""

    attributes = ["image_processor", "tokenizer"]

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, chat_template=chat_template)
        self.media_processor = image_processor

    def __call__(self, text=None, medias=None, return_tensors="pt", **kwargs):
        data = {}
        if text is not None:
            data.update(self.tokenizer(text, return_tensors=return_tensors))
        if medias:
            data.update(self.media_processor.preprocess(medias, return_tensors=return_tensors))
        return BatchFeature(data=data, tensor_type=return_tensors)
'''


def _config(preset: str) -> dict:
    config = VLLM._k25_config() if preset == "kimi-k2.5" else VLLM._k3_config()
    config["architectures"] = [ARCHITECTURES[preset]]
    if preset == "kimi-k3":
        config["text_config"].update(K3_MLA)
    config["auto_map"] = {"AutoProcessor": f"{PROCESSOR_MODULE}.{PROCESSOR_CLASS}"}
    return config


def write_checkpoint(folder: Path, preset: str) -> Path:
    """``folder`` filled with a tiny SGLang checkpoint of ``preset`` ("kimi-k2.5" or "kimi-k3")."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(_config(preset), indent=1))
    auto_map = {
        "AutoImageProcessor": f"{PROCESSOR_MODULE}.{IMAGE_PROCESSOR_CLASSES[preset]}",
        "AutoProcessor": f"{PROCESSOR_MODULE}.{PROCESSOR_CLASS}",
    }
    preprocessor = {
        "auto_map": auto_map,
        "processor_class": PROCESSOR_CLASS,
        "image_processor_type": IMAGE_PROCESSOR_CLASSES[preset],
        "media_proc_cfg": media_proc_cfg(get_preset(preset)),
    }
    (folder / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=1))
    (folder / "processor_config.json").write_text(
        json.dumps({"auto_map": {"AutoProcessor": auto_map["AutoProcessor"]}, "processor_class": PROCESSOR_CLASS})
    )
    (folder / f"{PROCESSOR_MODULE}.py").write_text(PROCESSOR_SOURCE)
    shutil.copyfile(TESTS / "reference.py", folder / f"{REFERENCE_MODULE}.py")
    VLLM._tokenizer(folder)
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    tokenizer_config["auto_map"] = {"AutoProcessor": auto_map["AutoProcessor"]}
    tokenizer_config["processor_class"] = PROCESSOR_CLASS
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return folder


def write_checkpoints(root: Path) -> dict[str, Path]:
    """Both presets' checkpoints under ``root``: ``{preset: folder}``."""
    return {preset: write_checkpoint(root / VLLM.MODELS[preset], preset) for preset in PRESETS}
