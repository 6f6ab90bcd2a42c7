"""The C step and the Python steps refuse a bad request in the same words: both fill the templates
of ``kimi_vision_common.messages`` (the C step through ``kimi_messages.h``, written by the build),
so a case here gets byte-equal messages from ``kimi_check_images`` and from the Python checks
(``check_image_count``, ``check_image_layout``, ``check_patch_total``)."""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import numpy as np
import pytest

from kimi_vision_common import messages
from kimi_vision_common.errors import ImageTooLargeError, InvalidRequestError, PreprocessError
from kimi_vision_prep.tokens import check_image_count, check_patch_total
from kimi_vision_server.models.requests import check_image_layout
from kimi_vision_server.triton_install import patchify_library

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fuzz"))
from fuzz_steps import I64, Image, Limits, load_library

pytestmark = pytest.mark.skipif(patchify_library() is None, reason="the C step was not built (no C compiler)")
MAX_IMAGES, MAX_PATCHES = 4, 100
LIMITS = Limits(14, 28, 512, 32768, MAX_IMAGES, MAX_PATCHES)  # K2.5's geometry, a small budget


def c_message(rows: list[list[int]], length: int) -> tuple[int, str]:
    """``kimi_check_images`` on one request's rows: its code and message."""
    table = np.ascontiguousarray(np.array(rows, np.int64).reshape(-1, 4))
    images = (Image * max(len(rows), 1))()
    total, message = ctypes.c_size_t(0), ctypes.create_string_buffer(1024)
    code = load_library().kimi_check_images(
        ctypes.byref(LIMITS), table.ctypes.data_as(I64), len(rows), length, images, ctypes.byref(total),
        message, len(message),
    )  # fmt: skip
    return code, message.value.decode()


def python_message(rows: list[list[int]], length: int) -> PreprocessError:
    """The Python steps' checks in the C step's order: count, layout, patch budget."""
    table = np.array(rows, np.int64).reshape(-1, 4)
    with pytest.raises(PreprocessError) as caught:
        check_image_count(len(rows), MAX_IMAGES)
        check_image_layout(table, length)
        patches = sum(-(-h // 28) * 28 // 14 * (-(-w // 28) * 28 // 14) for h, w, _, _ in rows)
        check_patch_total(patches, MAX_PATCHES)
    return caught.value


CASES = {
    "too many images": ([[1, 1, 3, i * 3] for i in range(5)], 15),
    "a side below one": ([[0, 4, 3, 0]], 0),
    "an image not next": ([[2, 2, 3, 0], [2, 2, 3, 13]], 25),
    "an image outside IMAGE": ([[4, 4, 3, 0]], 40),
    "bytes left over": ([[2, 2, 3, 0]], 20),
    "over the patch budget": ([[300, 300, 3, 0]], 270_000),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_c_and_python_refuse_in_the_same_words(case: str) -> None:
    rows, length = CASES[case]
    code, text = c_message(rows, length)
    error = python_message(rows, length)
    assert text == str(error)
    assert code == {InvalidRequestError: 1, ImageTooLargeError: 2}[type(error)]


def test_every_shared_template_is_in_the_c_header() -> None:
    header = messages.c_message_header()
    for name, template in messages.C_MESSAGES.items():
        assert f'#define KIMI_MSG_{name} "{template}"' in header
    assert "%ld" in messages.ROW_NOT_NEXT and "%lld" not in header  # the one field type both sides read
