"""One side of the vLLM comparison, run as its own process (the plugin patches vLLM's modules for the
life of a process): vLLM's own renderer, the API server's input path, processes every case and the
results are saved for the test to compare.

    python vllm_side.py CHECKPOINT CASES.json OUT.npz MEDIA_ROOT

The side is the environment's: ``KIMI_PREP_VLLM=off`` is stock vLLM, unset is the plugin. For each
of vLLM's two pixel modes (uint8, normalised on the device, its default; float32 with
``mm_device_do_normalize=False``) and each case of CASES.json (``kind`` ``pil``: paths opened with
``Image.open`` and handed over in ``multi_modal_data``; ``bytes``: K2.5 vision chunks of the files'
encoded bytes; ``chat``: image URLs, ``data:`` or
``file://`` under MEDIA_ROOT, in a chat message; ``chunk``: video chunks of PNG frames), the prompt's token ids,
``grid_thws`` and ``pixel_values`` are stored under ``{mode}/{case}/...``, or the error vLLM raised
(its class and message) under ``{mode}/{case}/error``; ``{mode}/profile/...``: vLLM's start-up
profiling input, processed;
``keys/{case}``: the processor cache's keys of a ``pil`` case's images opened and loaded twice by
vLLM's chat loader.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

os.environ.setdefault("HF_HUB_OFFLINE", "1")

MAX_MODEL_LEN = 32768
MODES = {"uint8": True, "float32": False}  # mode -> mm_device_do_normalize


def renderer(checkpoint: Path, device_normalize: bool, media_root: Path) -> Any:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.renderers.registry import renderer_from_config

    args = EngineArgs(
        model=str(checkpoint),
        max_model_len=MAX_MODEL_LEN,
        mm_device_do_normalize=device_normalize,
        mm_processor_cache_gb=0,  # each case processed, none answered from an earlier one's cache
        allowed_local_media_path=str(media_root),
    )
    return renderer_from_config(args.create_engine_config())


def media_modality(checkpoint: Path) -> str:
    """vLLM's modality of the checkpoint's media: K3's ``image``, K2.5's ``vision_chunk``."""
    model_type = json.loads((checkpoint / "config.json").read_text())["model_type"]
    return "image" if model_type == "kimi_k3" else "vision_chunk"


def placeholder(modality: str) -> str:
    if modality == "image":
        return "<|kimi_image_placeholder|>"
    return "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"


def mm_data(case: dict, modality: str) -> tuple[str, dict]:
    """The prompt and ``multi_modal_data`` of a ``pil``, ``bytes`` or ``chunk`` case, as a caller of
    vLLM builds them."""
    if case["kind"] in ("pil", "bytes"):
        opened = case["kind"] == "pil"
        images = [Image.open(path) if opened else Path(path).read_bytes() for path in case["paths"]]
        prompt = "describe " + " ".join(placeholder(modality) for _ in images)
        if modality == "image":
            return prompt, {"image": images}
        return prompt, {"vision_chunk": [{"type": "image", "image": im, "uuid": None} for im in images]}
    chunks = []
    for index, chunk in enumerate(case["chunks"]):
        frames = [Image.open(path).convert("RGB") for path in chunk["frames"]]
        chunks.append(
            {"type": "video_chunk", "video_chunk": frames, "uuid": None, "prompt": chunk["prompt"], "video_idx": index}
        )
    return "describe " + "".join(chunk["prompt"] for chunk in case["chunks"]), {"vision_chunk": chunks}


def engine_prompt(render: Any, case: dict, modality: str) -> dict:
    from vllm.renderers.params import ChatParams

    if case["kind"] == "chat":
        content = [{"type": "image_url", "image_url": {"url": url}} for url in case["urls"]]
        messages = [{"role": "user", "content": [*content, {"type": "text", "text": "describe this"}]}]
        _, prompts = render.render_chat([messages], ChatParams())
        return prompts[0]
    prompt, data = mm_data(case, modality)
    return render.render_cmpl([{"prompt": prompt, "multi_modal_data": data}])[0]


def as_numpy(tensor: Any) -> np.ndarray:
    """A tensor's values; bfloat16 (profiling's dummy input, in the model's dtype) as its bits."""
    import torch

    return (tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor).numpy()


def arrays(prompt: dict, modality: str) -> dict[str, np.ndarray]:
    """The prompt's token ids and its media's ``pixel_values`` / ``grid_thws``, concatenated."""
    items = prompt["mm_kwargs"][modality]
    return {
        "prompt_token_ids": np.asarray(prompt["prompt_token_ids"], dtype=np.int64),
        "pixel_values": np.concatenate([as_numpy(item["pixel_values"].data) for item in items]),
        "grid_thws": np.stack([item["grid_thws"].data.numpy() for item in items]),
    }


def profile(render: Any, modality: str) -> dict[str, np.ndarray]:
    """vLLM's start-up profiling input (its dummy media, the largest it admits), processed."""
    inputs = render.get_mm_processor().get_dummy_mm_inputs({modality: 1})
    return arrays(inputs, modality)


class Observed:
    """What one case made happen: the float32 or uint8 arrays the image processor itself returned
    (vLLM then casts float32 ones to the model's dtype) and the JPEGs Pillow decoded on the way."""

    def __init__(self) -> None:
        self.pixel_values: list[np.ndarray] = []
        self.pillow_jpeg_decodes = 0

    def watch(self, render: Any) -> None:
        from PIL import ImageFile

        processor = render.get_mm_processor().info.image_processor
        preprocess = processor.preprocess
        load = ImageFile.ImageFile.load

        def recorded(*args: Any, **kwargs: Any) -> Any:
            out = preprocess(*args, **kwargs)
            self.pixel_values.append(out["pixel_values"].numpy())
            return out

        def counted(image: Any) -> Any:
            if image.format == "JPEG" and image.tile:
                self.pillow_jpeg_decodes += 1
            return load(image)

        processor.preprocess = recorded
        ImageFile.ImageFile.load = counted

    def take(self) -> dict[str, np.ndarray]:
        found = {
            "processor_pixel_values": np.concatenate(self.pixel_values),
            "pillow_jpeg_decodes": np.asarray(self.pillow_jpeg_decodes),
        }
        self.reset()
        return found

    def reset(self) -> None:
        self.pixel_values, self.pillow_jpeg_decodes = [], 0


def cache_keys(render: Any, case: dict, modality: str, model_id: str) -> np.ndarray:
    """The processor cache's keys of a ``pil`` case's images, and of the same files loaded by vLLM's
    chat loader (twice): what vLLM's parser and hasher make of them (blake3, vLLM's default)."""
    from vllm.multimodal.media.image import ImageMediaIO
    from vllm.multimodal.processing.inputs import ProcessorInputs

    info = render.get_mm_processor().info
    image_mode = "RGB" if modality == "vision_chunk" else None  # K3's renderer keeps the mode

    def keys(images: list) -> list[str]:
        items = images if modality == "image" else [{"type": "image", "image": im, "uuid": None} for im in images]
        parsed = info.parse_mm_data({modality: items})
        return ProcessorInputs([], parsed).get_mm_hashes(model_id, "blake3")[modality]

    def loaded() -> list:
        media = [ImageMediaIO(image_mode=image_mode).load_bytes(Path(path).read_bytes()) for path in case["paths"]]
        # the chat path hands a vision chunk the loaded image itself (vLLM's _resolve_vision_chunk_items)
        return media if modality == "image" else [m.media for m in media]

    opened = keys([Image.open(path) for path in case["paths"]])
    return np.asarray([opened, keys(loaded()), keys(loaded())])


def main(checkpoint: Path, cases_file: Path, out: Path, media_root: Path) -> None:
    cases = json.loads(cases_file.read_text())
    modality = media_modality(checkpoint)
    results: dict[str, np.ndarray] = {}
    for mode, device_normalize in MODES.items():
        render = renderer(checkpoint, device_normalize, media_root)
        observed = Observed()
        observed.watch(render)
        kind = type(render.get_mm_processor().info.image_processor)
        results[f"{mode}/processor"] = np.asarray(f"{kind.__module__}.{kind.__qualname__}")
        for key, value in {**profile(render, modality), **observed.take()}.items():
            results[f"{mode}/profile/{key}"] = value
        for name, case in cases.items():
            try:
                found = arrays(engine_prompt(render, case, modality), modality)
                for key, value in {**found, **observed.take()}.items():
                    results[f"{mode}/{name}/{key}"] = value
            except Exception as exc:  # vLLM's verdict on a bad image, as a server would answer it
                results[f"{mode}/{name}/error"] = np.asarray(f"{type(exc).__name__}: {exc}")
            observed.reset()
            if mode == "uint8" and case["kind"] == "pil":  # after the case: its decodes are counted apart
                try:
                    results[f"keys/{name}"] = cache_keys(render, case, modality, str(checkpoint))
                except ValueError:  # vLLM's loader refuses the file
                    pass
                observed.reset()
    np.savez(out, **results)


if __name__ == "__main__":
    main(*map(Path, sys.argv[1:5]))
