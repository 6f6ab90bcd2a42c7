"""Triton Python model kimi_patch_embed: the logic is kimi_vision_prep.serving.models.PatchEmbedModel.

config.pbtxt parameters select the preset and the runtime knobs (see that class's docstring).
"""

from kimi_vision_prep.serving.models import PatchEmbedModel, triton_python_model

TritonPythonModel = triton_python_model(PatchEmbedModel)
