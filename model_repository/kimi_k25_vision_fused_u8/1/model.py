"""Triton Python model kimi_k25_vision_fused_u8: kimi_vision_server.models.images.FusedVisionModel.

Rendered by `kimi-prep render-repository`; config.pbtxt parameters select the preset and knobs.
"""

from kimi_vision_server.models.contract import triton_python_model
from kimi_vision_server.models.images import FusedVisionModel

TritonPythonModel = triton_python_model(FusedVisionModel)
