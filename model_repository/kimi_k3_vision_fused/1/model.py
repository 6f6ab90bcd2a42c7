"""Triton Python model kimi_k3_vision_fused: the logic is kimi_vision_prep.serving.models.FusedVisionModel
(decode + preprocess in one model).

config.pbtxt parameters select the preset and the runtime knobs (see that class's docstring).
"""

from kimi_vision_prep.serving.models import FusedVisionModel, triton_python_model

TritonPythonModel = triton_python_model(FusedVisionModel)
