"""Triton Python model kimi_patch_embed: kimi_vision_prep.serving.models.PatchEmbedModel.

Rendered by `kimi-prep render-repository`; config.pbtxt parameters select the preset and knobs.
"""

from kimi_vision_prep.serving.contract import triton_python_model
from kimi_vision_prep.serving.models import PatchEmbedModel

TritonPythonModel = triton_python_model(PatchEmbedModel)
