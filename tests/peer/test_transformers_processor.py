"""transformers' own ``Kimi_K25Processor`` built with ``KimiVisionProcessor`` as its image processor.

Run in ``.venv-peer`` (``make peer-venv``: torch 2.14.1 with torchvision 0.29.1, transformers,
the library), where transformers' processor classes import; ``make test`` runs it there. A small
local word-level tokenizer holds the media tokens; transformers' native video processor takes the
video slot it requires. The prompt's image placeholder is expanded to the reference's token count
and the pixels are the reference's (``tests/reference.py``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.models.kimi_k25 import Kimi_K25Processor
from transformers.models.kimi_k25.video_processing_kimi_k25 import Kimi_K25VideoProcessor

from kimi_vision_prep import KimiVisionProcessor

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))
from reference import reference_preprocess  # noqa: E402

SPECIAL = ["<unk>", "<|media_begin|>", "<|media_content|>", "<|media_pad|>", "<|media_end|>"]
VOCAB = {token: i for i, token in enumerate([*SPECIAL, "<|kimi_k25_video_placeholder|>", "image", "describe"])}
PROMPT = "describe <|media_begin|>image<|media_content|><|media_pad|><|media_end|>"
PHOTOS = ["pil__hopper.jpg", "pil__xmp_test.jpg", "pil__iptc.jpg", "imagers__large_image.jpg"]


@pytest.fixture(scope="module")
def processor() -> Kimi_K25Processor:
    words = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    specials = {"unk_token": "<unk>", "additional_special_tokens": SPECIAL[1:]}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, **specials)
    return Kimi_K25Processor(
        image_processor=KimiVisionProcessor(), tokenizer=tokenizer, video_processor=Kimi_K25VideoProcessor()
    )


@pytest.mark.parametrize("name", PHOTOS)
def test_the_prompt_gets_the_references_tokens_and_pixels(processor: Kimi_K25Processor, name: str) -> None:
    path = TESTS / "data" / "corpus" / name
    out = processor(text=[PROMPT], images=[Image.open(path)], return_tensors="np")
    expected = reference_preprocess(path.read_bytes(), "kimi-k2.5")
    assert np.array_equal(out["pixel_values"], expected.pixel_values)
    assert out["image_grid_thw"].tolist() == [expected.grid_thw.tolist()]
    assert int((out["input_ids"] == VOCAB["<|media_pad|>"]).sum()) == expected.num_tokens


@pytest.mark.parametrize("name", PHOTOS)
def test_transformers_counts_the_tokens_of_an_image_size(processor: Kimi_K25Processor, name: str) -> None:
    """``_get_num_multimodal_tokens(image_sizes=...)`` (vLLM's transformers backend calls it) reads
    ``merge_size`` from the image processor's standardized kwargs: the reference's counts."""
    path = TESTS / "data" / "corpus" / name
    with Image.open(path) as image:
        height, width = image.height, image.width
    counted = processor._get_num_multimodal_tokens(image_sizes=[(height, width)])
    expected = reference_preprocess(path.read_bytes(), "kimi-k2.5")
    assert counted["num_image_tokens"] == [expected.num_tokens]
    assert counted["num_image_patches"] == [expected.num_tokens * 4]
