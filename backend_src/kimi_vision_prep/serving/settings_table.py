"""The table of every setting a served model reads (docs/serving.md), made from the definitions.

Each row: the ``parameters`` key, what it means, the library's default (the dataclass or constant
that defines it) and the values a rendering writes into the models' configs (read back from
:func:`~.repository.repository_models`), so the table cannot drift from either. The preset's own
fields are the preset table's (docs/presets.md). ``tests/test_settings_table.py`` checks that
docs/serving.md holds this table; ``python -m kimi_vision_prep.serving.settings_table --write``
rewrites it there.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from collections import defaultdict
from pathlib import Path

from kimi_vision_common.models import SERVED_PRESETS, model_prefix
from kimi_vision_common.presets import Preset

from ..buffers import DEFAULT_RECYCLE_CAP_BYTES, DEFAULT_SCRATCH_CAP_BYTES
from ..limits import VideoLimits
from .config import DecoderSettings
from .render_blocks import RenderOptions
from .repository import repository_models

DOC = Path(__file__).resolve().parents[3] / "docs" / "serving.md"
BEGIN, END = "<!-- settings-table: begin -->", "<!-- settings-table: end -->"
PARAMETER = re.compile(r'parameters \{ key: "(?P<key>[^"]+)" value: \{ string_value: "(?P<value>[^"]*)" \} \}')

MEANINGS: dict[str, str] = {
    "max_images_per_request": "images (K) of one request",
    "max_patches_per_request": "NaViT patches of one request's images, from their headers",
    "max_encoded_bytes": "bytes of one encoded image",
    "max_pixels": "stored width x height of one image",
    "strict_decode": "a failed fast decode is an error, not a Pillow fallback",
    "decoder_pool_size": "nvImageCodec decoders kept per instance",
    "codec_threads": "nvImageCodec CPU threads per decoder (0: all cores)",
    "cpu_decode_threads": "threads of one CPU decode call: images at once, a lone JPEG's row bands (0: all cores)",
    "numba_threads": "threads of the CPU kernels (0: all cores)",
    "scratch_cap_bytes": "scratch arena kept per thread for reuse",
    "recycle_cap_bytes": "freed output buffers kept for reuse",
    "max_video_bytes": "bytes of one encoded video",
    "max_frame_pixels": "width x height of one video frame",
    "max_video_frames": "frames of a video stream, counted before decoding",
    "max_sampled_frames": "frames sampled from one video (T of a chunk request)",
    "ffmpeg_threads": "FFmpeg decoder threads (0: FFmpeg's choice)",
    "FORCE_CPU_ONLY_INPUT_TENSORS": "the Python backend's: no: inputs stay on the GPU (DLPack hand-off)",
    "hidden_size": "the chaining example's Conv2d width",
    "seed": "the chaining example's weight seed",
}


def library_defaults() -> dict[str, object]:
    """Each setting's default where the library defines it (None: no limit; absent: served only)."""
    values: dict[str, object] = dataclasses.asdict(DecoderSettings())
    values.update(dataclasses.asdict(VideoLimits()))
    values.update(
        scratch_cap_bytes=DEFAULT_SCRATCH_CAP_BYTES,
        recycle_cap_bytes=DEFAULT_RECYCLE_CAP_BYTES,
        numba_threads=0,
        ffmpeg_threads=0,
    )
    return values


def rendered_values(options: RenderOptions) -> dict[str, dict[str, list[tuple[str, str]]]]:
    """``{key: {value: [(preset, model kind)]}}`` over every rendered model but the preset's fields."""
    preset_fields = {field.name for field in dataclasses.fields(Preset)} | {"preset"}
    values: dict[str, dict[str, list[tuple[str, str]]]] = defaultdict(lambda: defaultdict(list))
    for model in repository_models(options):
        for match in PARAMETER.finditer(model.config):
            if match["key"] not in preset_fields:
                values[match["key"]][match["value"]].append(model_kind(model.name))
    return values


def _models(found: list[tuple[str, str]]) -> str:
    """``decode, vision_fused`` (every preset alike) or ``kimi-k3: decode, ...`` (one preset's)."""
    kinds = list(dict.fromkeys(kind for _, kind in found))
    presets = sorted({preset for preset, _ in found if preset})
    only = f"{presets[0]}: " if len(presets) == 1 and len(SERVED_PRESETS) > 1 else ""
    return only + ", ".join(kinds)


def model_kind(name: str) -> tuple[str, str]:
    """``kimi_k25_vision_u8`` -> ``("kimi-k2.5", "vision_u8")``; ``("", name)`` for other names."""
    for preset in SERVED_PRESETS:
        if name.startswith(f"{model_prefix(preset)}_"):
            return preset, name.removeprefix(f"{model_prefix(preset)}_")
    return "", name


def _text(value: object) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def settings_table(options: RenderOptions | None = None) -> str:
    """The markdown table (the checked-in rendering's values unless ``options``)."""
    defaults, rendered = library_defaults(), rendered_values(options or RenderOptions())
    lines = ["| parameter | meaning | library default | rendered (models) |", "|---|---|---|---|"]
    for key in sorted(rendered, key=lambda k: (k not in defaults, k)):
        served = "; ".join(f"{value} ({_models(found)})" for value, found in sorted(rendered[key].items()))
        library = _text(defaults[key]) if key in defaults else "-"
        lines.append(f"| `{key}` | {MEANINGS[key]} | {library} | {served} |")
    return "\n".join(lines) + "\n"


def with_table(document: str, table: str) -> str:
    """``document`` with the text between the table's markers replaced by ``table``."""
    start, end = document.index(BEGIN) + len(BEGIN), document.index(END)
    return document[:start] + "\n" + table + document[end:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"rewrite the table in {DOC}")
    table = settings_table()
    if parser.parse_args().write:
        DOC.write_text(with_table(DOC.read_text(), table))
    else:
        sys.stdout.write(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
