"""The built C step (``models/patchify/``, the extension ``_triton_patchify``) loaded through ctypes,
outside tritonserver (its Triton API symbols are weak), with the signatures of the functions it
exports for the tests."""

from __future__ import annotations

import ctypes

from kimi_vision_server.triton_install import patchify_library

SIZE_T = ctypes.c_size_t
U8_P = ctypes.POINTER(ctypes.c_uint8)
F32_P = ctypes.POINTER(ctypes.c_float)


def load_c_step() -> ctypes.CDLL:
    library = ctypes.CDLL(str(patchify_library()))
    library.kimi_normalize_tables.argtypes = [ctypes.POINTER(ctypes.c_double)] * 2 + [F32_P]
    library.kimi_write_patches_f32.argtypes = [U8_P, SIZE_T, SIZE_T, F32_P, F32_P, SIZE_T, SIZE_T, SIZE_T]
    library.kimi_write_patches_u8.argtypes = [U8_P, SIZE_T, SIZE_T, U8_P, SIZE_T, SIZE_T, SIZE_T]
    library.kimi_config_parameter.argtypes = [ctypes.c_char_p, SIZE_T, ctypes.c_char_p, ctypes.c_char_p, SIZE_T]
    return library
