"""Triton Python model kimi_k25_preprocess: kimi_vision_prep.serving.models.PreprocessModel.

Rendered by `kimi-prep render-repository`; config.pbtxt parameters select the preset and knobs.
"""

from kimi_vision_prep.serving.contract import triton_python_model
from kimi_vision_prep.serving.models import PreprocessModel

TritonPythonModel = triton_python_model(PreprocessModel)
