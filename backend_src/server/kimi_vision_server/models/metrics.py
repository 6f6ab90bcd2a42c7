"""Custom Prometheus counters of the serving models, through ``pb_utils.MetricFamily``.

tritonserver's Python backend (2.51) supports COUNTER, GAUGE and HISTOGRAM families; counters are
enough here and aggregate cleanly across instances. Families are shared by name across all models
and instances of a server; every metric carries ``model`` and ``instance`` labels so each stub
process owns its own series (a series shared by two processes would be removed under the other
one's feet when either unloads).

Exposed on the metrics endpoint (``:8002/metrics``):

- ``kimi_prep_decodes_total{path}``: images decoded, by decode path (libjpeg, simplejpeg,
  nvimgcodec-cpu/-cuda, coefficients-cuda, pillow).
- ``kimi_prep_decode_fallbacks_total{reason}``: planned fast decodes that fell back to Pillow.
- ``kimi_prep_errors_total{reason}``: failed requests, by :func:`~kimi_vision_common.errors.reason_for`.
- ``kimi_prep_video_frames_decoded_total``: frames the video models decoded (a cancelled stream
  stops adding to it).
- ``kimi_prep_image_inputs_total{device}``: decoded images a preprocess model received, by the memory
  they arrived in (``cpu``, ``cuda:N``): ``cuda`` means the decode step's tensor came through
  DLPack without a host copy (the GPU check asserts it).
- ``kimi_prep_repeat_cache_total{outcome}``: a GPU decode step's repeat cache lookups (hit, miss).
- ``kimi_prep_stage_seconds_total{stage}``: wall time spent per stage (decode, preprocess, vision: the fused
  decode + preprocess models, patch_embed).
"""

from __future__ import annotations

from typing import Any

FAMILIES: dict[str, tuple[str, str]] = {
    # key: (metric family name, description)
    "decodes": ("kimi_prep_decodes_total", "Images decoded, by decode path"),
    "fallbacks": ("kimi_prep_decode_fallbacks_total", "Planned fast decodes that fell back to Pillow, by reason"),
    "errors": ("kimi_prep_errors_total", "Failed requests, by error reason"),
    "stage_seconds": ("kimi_prep_stage_seconds_total", "Cumulative wall time per stage in seconds"),
    "video_frames": ("kimi_prep_video_frames_decoded_total", "Video frames decoded (stops when a stream is cancelled)"),
    "image_inputs": ("kimi_prep_image_inputs_total", "Decoded images a preprocess model received, by memory"),
    "repeats": ("kimi_prep_repeat_cache_total", "A GPU decode step's lookups of repeated images, by outcome"),
}


class ModelMetrics:
    """Counters of one model instance; a no-op when ``pb_utils`` has no metrics support."""

    def __init__(self, pb_utils: Any, model: str, instance: str) -> None:
        self._base_labels = {"model": model, "instance": instance}
        self._families: dict[str, Any] = {}
        self._series: dict[tuple[str, str, str], Any] = {}
        self.error: str | None = None
        family_class = getattr(pb_utils, "MetricFamily", None)
        if family_class is None:
            self.error = "pb_utils has no MetricFamily"
            return
        try:
            for key, (name, description) in FAMILIES.items():
                self._families[key] = family_class(name=name, description=description, kind=family_class.COUNTER)
        except Exception as exc:  # metrics disabled on the server (--allow-metrics=false), ...
            self._families.clear()
            self.error = f"custom metrics unavailable: {type(exc).__name__}: {exc}"

    @property
    def enabled(self) -> bool:
        return bool(self._families)

    def _increment(self, key: str, label: str, value: str, amount: float) -> None:
        family = self._families.get(key)
        if family is None:
            return
        try:
            series = self._series.get((key, label, value))
            if series is None:
                series = family.Metric(labels={**self._base_labels, label: value})
                self._series[(key, label, value)] = series
            series.increment(amount)
        except Exception as exc:  # metrics must never fail a request
            self.error = f"custom metrics disabled after {type(exc).__name__}: {exc}"
            self.close()

    def count_decode(self, path: str) -> None:
        self._increment("decodes", "path", path, 1)

    def count_fallback(self, reason: str) -> None:
        self._increment("fallbacks", "reason", reason, 1)

    def count_error(self, reason: str) -> None:
        self._increment("errors", "reason", reason, 1)

    def count_video_frames(self, frames: int) -> None:
        self._increment("video_frames", "model", self._base_labels["model"], frames)

    def count_image_input(self, device: str) -> None:
        self._increment("image_inputs", "device", device, 1)

    def count_repeat(self, outcome: str, amount: int = 1) -> None:
        self._increment("repeats", "outcome", outcome, amount)

    def add_stage_seconds(self, stage: str, seconds: float) -> None:
        self._increment("stage_seconds", "stage", stage, seconds)

    def close(self) -> None:
        """Drop series before families (the backend requires that order)."""
        self._series.clear()
        self._families.clear()
