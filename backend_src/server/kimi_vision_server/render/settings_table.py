"""The table of every setting a served model reads (docs/serving.md), made from :data:`~.settings.SETTINGS`.

Each row: the ``parameters`` key, what it means, the library's default, the values a rendering
writes into the models' configs (read back from :func:`~.repository.repository_models`, so the
table cannot drift from the renderer) and why a served value differs from the library's. The
preset's own fields are the preset table's (docs/presets.md). ``tests/test_settings_table.py`` checks that
docs/serving.md holds this table;
``python -m kimi_vision_server.render.settings_table --write docs/serving.md`` rewrites it there.
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

from ..settings import SETTINGS
from .blocks import RenderOptions
from .repository import repository_models

BEGIN, END = "<!-- settings-table: begin -->", "<!-- settings-table: end -->"
PARAMETER = re.compile(r'parameters \{ key: "(?P<key>[^"]+)" value: \{ string_value: "(?P<value>[^"]*)" \} \}')


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


def settings_table(options: RenderOptions | None = None) -> str:
    """The markdown table (the checked-in rendering's values unless ``options``)."""
    rendered = rendered_values(options or RenderOptions())
    lines = [
        "| parameter | meaning | library default | rendered (models) | why the served value differs |",
        "|---|---|---|---|---|",
    ]
    for item in sorted(SETTINGS, key=lambda s: (not s.library, s.name)):
        served = "; ".join(f"{value} ({_models(found)})" for value, found in sorted(rendered[item.name].items()))
        library = item.text(item.default) if item.library else "-"
        lines.append(f"| `{item.name}` | {item.meaning} | {library} | {served} | {item.why or '-'} |")
    return "\n".join(lines) + "\n"


def with_table(document: str, table: str) -> str:
    """``document`` with the text between the table's markers replaced by ``table``."""
    start, end = document.index(BEGIN) + len(BEGIN), document.index(END)
    return document[:start] + "\n" + table + document[end:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", type=Path, metavar="DOC", help="rewrite the table in DOC (docs/serving.md)")
    table, document = settings_table(), parser.parse_args().write
    if document is not None:
        document.write_text(with_table(document.read_text(), table))
    else:
        sys.stdout.write(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
