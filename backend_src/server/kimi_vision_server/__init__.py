"""kimi-vision-server: the library's preprocessing served on NVIDIA Triton Inference Server, split
by job (its own distribution, ``backend_src/server/``; the library, ``kimi_vision_prep``, knows
nothing of it).

- root: :mod:`.settings` (every served setting, declared once), :mod:`.host` (the host's layout),
  :mod:`.allocator` (malloc settings), :mod:`.triton_install` (finding tritonserver, laying out the
  C step); they import no folder of the package.
- :mod:`.render`: the model repository rendered from the presets.
- :mod:`.models`: the Triton Python models, their parts, and the C step (``models/patchify/``).
- :mod:`.launch`: one start path for ``kimi-prep serve`` and :class:`~.launch.embedded.EmbeddedServer`.
- :mod:`.watch`: the stub watchdog, its recovery, the probes.
- :mod:`.cli`: the CLI layer (the server's ``kimi-prep`` commands, ``bench-local``).
"""
