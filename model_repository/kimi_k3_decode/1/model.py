"""Triton Python model kimi_k3_decode: kimi_vision_server.models.images.DecodeModel.

Rendered by `kimi-prep render-repository`; config.pbtxt parameters select the preset and knobs.
"""

from kimi_vision_server.models.contract import triton_python_model
from kimi_vision_server.models.images import DecodeModel

TritonPythonModel = triton_python_model(DecodeModel)
