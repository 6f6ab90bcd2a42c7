"""Triton Python model kimi_k3_decode: the logic is kimi_vision_prep.serving.models.DecodeModel.

config.pbtxt parameters select the preset and the runtime knobs (see that class's docstring).
"""

from kimi_vision_prep.serving.models import DecodeModel, triton_python_model

TritonPythonModel = triton_python_model(DecodeModel)
