"""Triton Python model kimi_k3_video_chunk: kimi_vision_server.models.media.VideoChunkModel.

Rendered by `kimi-prep render-repository`; config.pbtxt parameters select the preset and knobs.
"""

from kimi_vision_server.models.contract import triton_python_model
from kimi_vision_server.models.media import VideoChunkModel

TritonPythonModel = triton_python_model(VideoChunkModel)
