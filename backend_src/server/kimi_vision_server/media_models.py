"""The media models by the path a repository rendered before the ``models/`` folder names them
(``from kimi_vision_server.media_models import VideoModel``): such a repository keeps loading. The
models themselves are in :mod:`.models.media`."""

from .models.media import TokensModel, VideoChunkModel, VideoModel

__all__ = ["TokensModel", "VideoChunkModel", "VideoModel"]
