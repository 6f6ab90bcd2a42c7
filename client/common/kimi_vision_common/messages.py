"""The words of the request checks that a Python step and the C step both make, as printf
templates: Python fills them with ``%``, and the C step gets them from ``kimi_messages.h``, which
the build writes from this module (:func:`c_message_header`), so neither side restates the other.

Every field is ``%ld`` (a C ``long`` is 64 bits on the Linux hosts the C step builds on, and
Python's ``%`` reads it as ``%d``). This module imports nothing: the build loads it from its file.
"""

# One request's image count and patch budget (the library, every image step, the C step).
TOO_MANY_IMAGES = "%ld images in one request: at most %ld (max_images_per_request); send them in several requests"
PATCHES_OVER_BUDGET = (
    "the images of this request need %ld patches, over max_patches_per_request=%ld "
    "(send fewer or smaller images per request)"
)
# The layout of IMAGE / IMAGE_SHAPES (the preprocess step's check_image_layout, the C step): K rows
# of (height, width, channels, offset) that tile IMAGE in order; the row is printed in full.
ROW_BELOW_ONE = "IMAGE_SHAPES[0, %ld] = [%ld, %ld, %ld, %ld]: height, width and channels must be >= 1"
ROW_NOT_NEXT = (
    "IMAGE_SHAPES[0, %ld] = [%ld, %ld, %ld, %ld]: image %ld must start at offset %ld, right after the images "
    "before it (the K images tile IMAGE in order, without gaps or overlap)"
)
ROW_OUTSIDE_IMAGE = "IMAGE_SHAPES[0, %ld] = [%ld, %ld, %ld, %ld] is outside IMAGE (%ld bytes)"
IMAGE_HAS_GAPS = "IMAGE holds %ld bytes, its %ld images %ld: no gaps allowed"
# The C step alone: it takes RGB pixels at their NaViT size and does not resize.
NOT_RGB = "image %ld: kimi_patchify takes RGB images (C=3), got C=%ld; send other modes to the preprocess model"
GRID_TOO_LARGE = (
    "image %ld: %ldx%ld needs a %ldx%ld patch grid, beyond %ld a side or %ld in all (send images at their NaViT size)"
)

C_MESSAGES = {
    name: value for name, value in dict(globals()).items() if name.isupper() and isinstance(value, str)
}


def c_message_header() -> str:
    """The C step's ``kimi_messages.h``: ``KIMI_MSG_<NAME>`` for each template above, as a C string."""
    lines = ["/* Generated from kimi_vision_common/messages.py (c_message_header): do not edit. */", "#pragma once"]
    for name, text in C_MESSAGES.items():
        if not text.isascii() or any(c in text for c in '"\\'):
            raise ValueError(f"{name}: a C template must be plain ASCII without quotes or backslashes")
        lines.append(f'#define KIMI_MSG_{name} "{text}"')
    return "\n".join(lines) + "\n"
