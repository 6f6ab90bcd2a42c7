"""docs/contract.md states the checkpoint's rules in the project's words: its tables (preset values,
worked size examples, video chunks, the AV1 clip's sampling) are read here and recomputed with the
library, so the document cannot drift from the code."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kimi_vision_common.presets import get_preset
from kimi_vision_common.sizing import chunk_target, chunk_tokens, navit_target_size
from kimi_vision_prep.video_pipeline import preprocess_video

ROOT = Path(__file__).resolve().parents[1]
CONTRACT = (ROOT / "docs" / "contract.md").read_text()


def table(heading: str) -> list[list[str]]:
    """The rows (cells stripped, backticks dropped) of the first table after ``heading``."""
    section = CONTRACT[CONTRACT.index(heading) :]
    lines = re.search(r"((?:^\|.*\|\n)+)", section, re.M)[1].splitlines()  # type: ignore[index]
    return [[cell.strip().strip("`") for cell in line.strip("|").split("|")] for line in lines[2:]]


def size(text: str) -> tuple[int, int]:
    width, height = text.split("x")
    return int(width), int(height)


def test_the_preset_table_is_the_presets() -> None:
    rows = table("## Presets")
    assert len(rows) >= 10
    for field, k25, k3 in rows:
        for name, written in (("kimi-k2.5", k25), ("kimi-k2.6", k25), ("kimi-k3", k3)):
            value = getattr(get_preset(name), field)
            shown = ", ".join(str(v) for v in value) if isinstance(value, tuple) else str(value)
            assert shown == written, (name, field)


@pytest.mark.parametrize("row", table("## Size: the NaViT rule"), ids=lambda row: f"{row[0]}-{row[1]}")
def test_each_worked_size_example(row: list[str]) -> None:
    preset, original, resized, pad, grid, tokens = row
    target = navit_target_size(*size(original), get_preset(preset))
    assert (target.new_width, target.new_height) == size(resized)
    assert f"{target.pad_width}, {target.pad_height}" == pad
    assert f"{target.grid_h}x{target.grid_w}" == grid
    assert target.num_tokens == int(tokens)


@pytest.mark.parametrize("row", table("## Video chunks"), ids=lambda row: f"{row[0]}-{row[1]}")
def test_each_worked_chunk_example(row: list[str]) -> None:
    preset_name, frame, resized, grid, tokens = row
    preset = get_preset(preset_name)
    for frames in (1, 4):  # the per-chunk token count does not depend on T
        target = chunk_target(*size(frame), frames, preset)
        assert (target.new_width, target.new_height) == size(resized)
        assert f"T x {target.grid_h} x {target.grid_w}" == grid
        assert chunk_tokens(target, preset) == int(tokens)


def test_the_av1_clip_samples_and_timestamps(corpus: Path) -> None:
    data = (corpus / "video" / "torchcodec__av1_video.mkv").read_bytes()
    (preset, frames, chunk_sizes, timestamps) = table("Worked example, the AV1 clip")[0]
    chunks = list(preprocess_video(data, preset))
    assert [i for chunk in chunks for i in chunk.frame_indices] == [int(v) for v in frames.split(", ")]
    assert [len(chunk.frame_indices) for chunk in chunks] == [int(v) for v in chunk_sizes.split(", ")]
    assert [chunk.timestamp for chunk in chunks] == timestamps.split(", ")
    k3 = list(preprocess_video(data, "kimi-k3"))
    assert [len(chunk.frame_indices) for chunk in k3] == [4] * 10
    assert (k3[9].frame_indices[0], k3[9].timestamp) == (114, "00:00:04.559")
    assert "the tenth starts at frame 114" in CONTRACT and "00:00:04.559" in CONTRACT
