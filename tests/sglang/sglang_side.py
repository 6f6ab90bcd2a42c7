"""SGLang's own Kimi multimodal processing, stock, called as its serving path calls it.

    stock = build_processor(checkpoint_dir)          # the preset from the checkpoint's model_type
    out = run(stock, "describe <|media_pad|>", [open("a.jpg", "rb").read()])
    out["pixel_values"]     # float32 (ΣN, 3, 14, 14), the images' patches in order
    out["image_grid_thw"]   # int64 (n, 3)

:func:`build_processor` builds what SGLang 0.5.23's ``TokenizerManager`` builds on a CPU host: its
config published for the ``tokenizer`` role (``ServerArgs`` with ``trust_remote_code``, ``device="cpu"``,
and K3's ``disable_radix_cache``), then the manager's own ``init_model_config`` and
``init_tokenizer_and_processor``: SGLang's ``KimiK2_5VLImageProcessor`` / ``KimiK3ImageProcessor`` around
the checkpoint's remote-code processor (tests/sglang/checkpoints.py). The manager's other parts (its
ZMQ sockets, scheduler, metrics) are not started.

:func:`run` sends one request through the two steps ``TokenizerManager._tokenize_one_request`` takes
for it: the prompt tokenized by the manager's ``_tokenize_texts`` (Kimi processors prefer token ids),
then ``mm_processor.process_mm_data_async(image_data=..., input_text=ids, request_obj=...)`` with a
``GenerateReqInput``. Images go as the OpenAI chat path hands them over (``ImageData`` with a
``data:`` URL, ``image_form="data_url"``), or as raw bytes (``"bytes"``, the Python ``Engine`` API's
form).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PRESET_OF_MODEL_TYPE = {"kimi_k25": "kimi-k2.5", "kimi_k3": "kimi-k3"}
MAX_REQ_INPUT_LEN = 32768
# One image's placeholder in a prompt, as each checkpoint's chat template writes it: K2.5 the
# whole media span; K3 one <|media_pad|>, which SGLang frames itself (``image {W}x{H}``).
K25_IMAGE_PROMPT = "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"
K3_IMAGE_PROMPT = "<|media_pad|>"
_MIME = ((b"\xff\xd8", "image/jpeg"), (b"\x89PNG", "image/png"), (b"GIF8", "image/gif"), (b"BM", "image/bmp"))


@dataclass
class StockSGLang:
    """SGLang's processing of one checkpoint: the ``TokenizerManager`` (model config, tokenizer,
    ``mm_processor``, the checkpoint's ``processor``) and the ``ServerArgs`` published for it."""

    manager: Any
    server_args: Any
    preset: str

    @property
    def mm_processor(self) -> Any:
        return self.manager.mm_processor

    @property
    def tokenizer(self) -> Any:
        return self.manager.tokenizer

    def image_prompt(self) -> str:
        return K3_IMAGE_PROMPT if self.preset == "kimi-k3" else K25_IMAGE_PROMPT


def preset_of(checkpoint_dir: Path) -> str:
    return PRESET_OF_MODEL_TYPE[json.loads((Path(checkpoint_dir) / "config.json").read_text())["model_type"]]


def build_processor(checkpoint_dir: Path, model: str | None = None, **server_args: Any) -> StockSGLang:
    """SGLang's processing of ``checkpoint_dir`` as its ``TokenizerManager`` sets it up; ``model``: the
    preset (``"kimi-k2.5"`` / ``"kimi-k3"``; default: from the config's ``model_type``); ``server_args``:
    more ``ServerArgs`` fields (for example ``mm_preprocess_cache_size_mb=0``)."""
    from sglang.srt.managers.tokenizer_manager import TokenizerManager
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import ServerArgs

    preset = model or preset_of(checkpoint_dir)
    fields = {
        "model_path": str(checkpoint_dir),
        "trust_remote_code": True,
        "device": "cpu",
        # K3 is a hybrid linear-attention model: with the radix cache on, SGLang's ServerArgs asserts
        # "extra_buffer requires platform support for Mamba cache state snapshots" on a CPU host.
        "disable_radix_cache": preset == "kimi-k3",
        **server_args,
    }
    args = ServerArgs(**fields)
    publish(args, role="tokenizer")
    manager = TokenizerManager.__new__(TokenizerManager)
    manager.server_args = args
    manager.init_model_config()
    manager.init_tokenizer_and_processor()
    return StockSGLang(manager, args, preset)


def _publish(stock: StockSGLang) -> None:
    """The process holds one published config (last publish wins): ``stock``'s, before it runs."""
    from sglang.srt.runtime_context import get_server_args, publish

    with contextlib.suppress(Exception):
        if get_server_args() is stock.server_args:
            return
    publish(stock.server_args, role="tokenizer")


def data_url(data: bytes) -> str:
    mime = next((m for magic, m in _MIME if data.startswith(magic)), "application/octet-stream")
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        mime = "image/webp"
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def image_data(images: Sequence[bytes], image_form: str) -> list[Any]:
    """``images`` as a request's ``image_data``: ``data_url`` (the chat path's ``ImageData``) or ``bytes``."""
    from sglang.srt.utils import ImageData

    if image_form == "data_url":
        return [ImageData(url=data_url(data)) for data in images]
    if image_form == "bytes":
        return list(images)
    raise ValueError(f"unknown image_form {image_form!r}")


def default_prompt(stock: StockSGLang, count: int) -> str:
    return "describe " + " ".join(stock.image_prompt() for _ in range(count))


def run(
    stock: StockSGLang,
    prompt: str | Sequence[int] | None,
    images: Sequence[bytes],
    *,
    image_form: str = "data_url",
    fresh: bool = True,
) -> dict[str, Any]:
    """One request through SGLang's processor: ``prompt`` (text with one image placeholder per image,
    :func:`default_prompt` when None, or token ids) and ``images`` (encoded files).

    Returns ``input_ids`` (int64, the prompt with each image's tokens expanded), ``offsets`` (each
    image's ``(first, last)`` index of its tokens in ``input_ids``), ``image_grid_thw`` (int64 (n, 3)),
    ``features`` (each item's feature as SGLang holds it, numpy, dtype kept), ``pixel_values`` (those
    concatenated, when all are float patches ``(N, 3, p, p)``, else None), ``deferred`` (per item,
    whether SGLang left its preprocessing to the model, K3's deferred GPU path) and ``output`` (SGLang's
    ``MultimodalProcessorOutput``). SGLang's exceptions propagate. ``fresh``: SGLang's preprocess
    cache (K3's, on by default, keyed by the file's bytes) emptied first, so that every image is
    processed by this call rather than answered from an earlier one."""
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.multimodal.kimi_k3_image_processing import DEFERRED_PREPROCESSING_KEY

    _publish(stock)
    if fresh:
        stock.mm_processor.mm_preprocess_cache.clear()
    if prompt is None:
        prompt = default_prompt(stock, len(images))
    if isinstance(prompt, str):
        input_ids, _ = asyncio.run(stock.manager._tokenize_texts(prompt))
    else:
        input_ids = list(prompt)
    request = GenerateReqInput(input_ids=input_ids, image_data=image_data(images, image_form))
    output = asyncio.run(
        stock.mm_processor.process_mm_data_async(
            image_data=request.image_data,
            input_text=input_ids,
            request_obj=request,
            max_req_input_len=MAX_REQ_INPUT_LEN,
        )
    )
    items = list(output.mm_items)
    features = [_numpy(item.feature) for item in items]
    grids = [_numpy(item.model_specific_data["image_grid_thw"]).reshape(-1, 3) for item in items]
    patches = all(f.ndim == 4 and f.dtype == np.float32 for f in features)
    return {
        "input_ids": np.asarray(output.input_ids, dtype=np.int64),
        "offsets": [tuple(int(v) for v in offset) for item in items for offset in item.offsets],
        "image_grid_thw": np.concatenate(grids) if grids else np.zeros((0, 3), np.int64),
        "features": features,
        "pixel_values": (np.concatenate(features) if features else None) if patches else None,
        "deferred": [DEFERRED_PREPROCESSING_KEY in item.model_specific_data for item in items],
        "output": output,
    }


def _numpy(value: Any) -> np.ndarray:
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    return np.asarray(value)


@contextlib.contextmanager
def believe_cuda() -> Iterator[None]:
    """SGLang made to believe a CUDA device is there: ``torch.cuda.is_available()`` and SGLang's
    ``is_cuda()`` answer True (the image loader's, in ``sglang.srt.utils.common``, and the name K3's
    processor module imported). Nothing else changes: a ``.cuda()`` still meets this host."""
    import torch
    from sglang.srt.multimodal.processors import kimi_k3
    from sglang.srt.utils import common

    saved = (torch.cuda.is_available, common.is_cuda, kimi_k3.is_cuda)
    torch.cuda.is_available = common.is_cuda = kimi_k3.is_cuda = lambda: True
    try:
        yield
    finally:
        torch.cuda.is_available, common.is_cuda, kimi_k3.is_cuda = saved
