"""The Triton Python models the rendered ``model.py`` files name (``images``: decode, preprocess,
fused, patch embed; ``media``: video, video chunk, tokens), their parts (components, the execute
contract, requests, tensors, config, warm-up, metrics) and, in ``patchify/``, the C step. Imports the
library and the package root (``settings``, ``host``); never ``render``, ``launch`` or ``watch``.
"""
