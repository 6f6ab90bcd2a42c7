"""kimi-vision-server: the library's preprocessing served on NVIDIA Triton Inference Server, split
by job (its own distribution, ``backend_src/server/``; the library, ``kimi_vision_prep``, knows
nothing of it).

- :mod:`.repository` (with :mod:`.render_blocks`, :mod:`.media_kinds`, :mod:`.pbtxt`): the model
  repository rendered from the presets.
- :mod:`.settings`: every served setting, declared once; :mod:`.config`: model-config parameters
  -> preset, decoder, video settings.
- :mod:`.tensors`: tensors in and out, the DLPack hand-off; :mod:`.requests`: request validation
  and the image models' tensors; :mod:`.warmup`: warm-up inputs.
- :mod:`.contract`: the execute contract (and its streaming form), the ``pb_utils`` adapter.
- :mod:`.components`, :mod:`.models`, :mod:`.media_models`: the models, by composition;
  :mod:`.patch_embed`: the chaining example's Conv2d; :mod:`.metrics`: custom counters.
- :mod:`.launcher` (with :mod:`.triton_install`, :mod:`.shm_regions`): one start path for
  ``kimi-prep serve`` and :class:`~.embedded.EmbeddedServer` (tests, benchmarks, the demo);
  :mod:`.watchdog`, :mod:`.probes`.
- :mod:`.cli`: the CLI layer (the server's ``kimi-prep`` commands, ``bench-local``).
"""
