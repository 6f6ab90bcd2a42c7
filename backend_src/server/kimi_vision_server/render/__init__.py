"""Rendering the model repository: each served model's ``config.pbtxt`` and ``model.py`` from the
presets and the settings (``repository.py``; its blocks, the media kinds, the pbtxt writer, the
settings table of docs/serving.md). Imports the package root (``settings``, ``host``,
``triton_install``) and nothing of ``models``, ``launch`` or ``watch``.
"""
