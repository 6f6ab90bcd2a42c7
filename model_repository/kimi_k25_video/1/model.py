"""Triton Python model kimi_k25_video: kimi_vision_server.models.media.VideoModel.

Rendered by `kimi-prep render-repository`; config.pbtxt parameters select the preset and knobs.
"""

from kimi_vision_server.models.contract import triton_python_model
from kimi_vision_server.models.media import VideoModel

TritonPythonModel = triton_python_model(VideoModel)
