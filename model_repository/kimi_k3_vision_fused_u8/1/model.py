"""Triton Python model kimi_k3_vision_fused_u8: kimi_vision_prep.serving.models.FusedVisionModel.

Rendered by `kimi-prep render-repository`; config.pbtxt parameters select the preset and knobs.
"""

from kimi_vision_prep.serving.contract import triton_python_model
from kimi_vision_prep.serving.models import FusedVisionModel

TritonPythonModel = triton_python_model(FusedVisionModel)
