"""The execute contract by the path a repository rendered before the ``models/`` folder names it
(``from kimi_vision_server.contract import triton_python_model``): such a repository keeps loading.
The contract itself is :mod:`.models.contract`."""

from .models.contract import triton_python_model

__all__ = ["triton_python_model"]
