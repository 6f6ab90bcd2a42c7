"""Triton Python model kimi_k25_video_chunk: kimi_vision_server.media_models.VideoChunkModel.

Rendered by `kimi-prep render-repository`; config.pbtxt parameters select the preset and knobs.
"""

from kimi_vision_server.contract import triton_python_model
from kimi_vision_server.media_models import VideoChunkModel

TritonPythonModel = triton_python_model(VideoChunkModel)
