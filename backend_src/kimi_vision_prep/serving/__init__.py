"""Serving the preprocessing on NVIDIA Triton Inference Server.

- :mod:`.config`: Triton model-config parameters -> preset and decoder settings.
- :mod:`.models`: the request/response logic of every Python-backend model (``model.py`` files
  in ``model_repository/`` are thin wrappers around these classes).
- :mod:`.metrics`: custom Prometheus counters through ``pb_utils.MetricFamily``.
- :mod:`.patch_embed`: the seeded Conv2d of the chaining example.
- :mod:`.launcher`: find or lay out ``tritonserver``, render the repository, run it.
"""
