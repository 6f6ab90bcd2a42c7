"""Triton Python model kimi_patch_embed: kimi_vision_server.models.PatchEmbedModel.

Rendered by `kimi-prep render-repository`; config.pbtxt parameters select the preset and knobs.
"""

from kimi_vision_server.contract import triton_python_model
from kimi_vision_server.models import PatchEmbedModel

TritonPythonModel = triton_python_model(PatchEmbedModel)
