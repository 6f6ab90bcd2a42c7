"""Triton Python model kimi_patch_embed: kimi_vision_server.models.images.PatchEmbedModel.

Rendered by `kimi-prep render-repository`; config.pbtxt parameters select the preset and knobs.
"""

from kimi_vision_server.models.contract import triton_python_model
from kimi_vision_server.models.images import PatchEmbedModel

TritonPythonModel = triton_python_model(PatchEmbedModel)
