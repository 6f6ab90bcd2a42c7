"""The peer a Triton user would write instead of ours: the plain reference processor in a Python model.

``bench_perf_analyzer.py`` copies this file as ``model.py`` of ``reference_k25_vision`` in a
bench-only repository, with ``tests/reference.py`` (Pillow decode + Pillow bicubic + numpy
normalise/patchify, the reference the exactness tests compare with) beside it. Same inputs and
outputs as ``kimi_k25_vision`` (IMAGE_BYTES -> PIXEL_VALUES, GRID_THW, NUM_TOKENS), same batching
and instances; no numba, no nvImageCodec, no shared decoder pool.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils  # type: ignore[import-not-found]

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reference import reference_preprocess


def pixel_tensors(images: np.ndarray) -> list[pb_utils.Tensor]:
    """The K encoded images of one request -> its three output tensors."""
    results = [reference_preprocess(bytes(data), "kimi-k2.5") for data in images.reshape(-1)]
    return [
        pb_utils.Tensor("PIXEL_VALUES", np.concatenate([r.pixel_values for r in results])),
        pb_utils.Tensor("GRID_THW", np.stack([r.grid_thw for r in results])),
        pb_utils.Tensor("NUM_TOKENS", np.array([r.num_tokens for r in results], dtype=np.int32)),
    ]


class TritonPythonModel:
    def execute(self, requests: list) -> list:
        responses = []
        for request in requests:
            images = pb_utils.get_input_tensor_by_name(request, "IMAGE_BYTES").as_numpy()
            try:
                responses.append(pb_utils.InferenceResponse(output_tensors=pixel_tensors(images)))
            except Exception as error:  # the peer answers every failure per request
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(error))))
        return responses
