"""Triton Python model kimi_k3_tokens: kimi_vision_server.models.media.TokensModel.

Rendered by `kimi-prep render-repository`; config.pbtxt parameters select the preset and knobs.
"""

from kimi_vision_server.models.contract import triton_python_model
from kimi_vision_server.models.media import TokensModel

TritonPythonModel = triton_python_model(TokensModel)
