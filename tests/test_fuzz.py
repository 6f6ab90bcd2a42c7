"""Fuzzing (issue 5): mutated images follow the verdict rule, and the fuzz harness runs clean.

The verdict rule (``fuzz/fuzz_oracle.py``): Pillow accepts an input -> ``pixel_values`` bit-equal
to ``tests/reference.py``; Pillow rejects it or a limit is exceeded -> a typed bad-input
``PreprocessError``; no other exception escapes. Saved reproducers under ``fuzz/crashes/`` are
replayed as regressions.
"""

from __future__ import annotations

import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

FUZZ_DIR = Path(__file__).resolve().parents[1] / "fuzz"
if str(FUZZ_DIR) not in sys.path:
    sys.path.insert(0, str(FUZZ_DIR))

import fuzz_mutators  # noqa: E402
from fuzz_oracle import PRESET_NAMES, judge, make_decoder  # noqa: E402
from fuzz_seeds import corpus_seeds, synthetic_seeds  # noqa: E402

SEEDS = {**synthetic_seeds(), **corpus_seeds(max_bytes=32 << 10)}
DECODER = make_decoder()
REPRODUCERS = sorted((FUZZ_DIR / "crashes").glob("*.bin"))


def mutated(data: st.DataObject) -> bytes:
    """A seed with 1-3 mutations, each a named structure-aware or generic mutator and an RNG seed."""
    encoded = SEEDS[data.draw(st.sampled_from(sorted(SEEDS)), label="seed")]
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        pool = fuzz_mutators.mutators_for(encoded) | fuzz_mutators.GENERIC
        mutator = pool[data.draw(st.sampled_from(sorted(pool)), label="mutator")]
        encoded = mutator(encoded, random.Random(data.draw(st.integers(0, 2**32 - 1), label="rng")))
    return encoded


@settings(
    derandomize=True,
    database=None,
    max_examples=2500,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(st.data())
def test_mutated_images_follow_the_verdict_rule(data: st.DataObject) -> None:
    encoded = mutated(data)
    for preset in PRESET_NAMES:
        judge(encoded, preset, DECODER)  # raises fuzz_oracle.Finding (an AssertionError) on a violation


@pytest.mark.parametrize("path", REPRODUCERS, ids=[p.name for p in REPRODUCERS])
def test_saved_reproducers_follow_the_verdict_rule(path: Path) -> None:
    for preset in PRESET_NAMES:
        judge(path.read_bytes(), preset, DECODER)


def test_structure_mutators_change_their_format() -> None:
    """Each JPEG/PNG mutator finds the structure it targets in a seed of its format."""
    seeds = {fuzz_mutators.JPEG_SOI: SEEDS["jpeg-4:2:0"], fuzz_mutators.PNG_SIGNATURE: SEEDS["png-P+trns"]}
    for magic, pool in ((fuzz_mutators.JPEG_SOI, fuzz_mutators.JPEG), (fuzz_mutators.PNG_SIGNATURE, fuzz_mutators.PNG)):
        for name, mutator in pool.items():
            outputs = {mutator(seeds[magic], random.Random(seed)) for seed in range(8)}
            assert outputs - {seeds[magic]}, f"{name} never changed its input"


def test_harness_runs_clean_in_a_guarded_process(tmp_path: Path) -> None:
    """The `make fuzz` command, for 20 s: exits 0, executes inputs, reports verdicts and peak RSS."""
    cmd = [sys.executable, str(FUZZ_DIR / "fuzz_preprocess.py"), "--seconds", "20", "--seed", "1"]
    done = subprocess.run(
        [*cmd, "--crash-dir", str(tmp_path)], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    executions = int(re.search(r"^executions: (\d+)", done.stdout, re.MULTILINE).group(1))
    assert executions > 0, done.stdout
    assert re.search(r"^peak RSS: [1-9]\d* MiB", done.stdout, re.MULTILINE), done.stdout
    assert "findings: 0" in done.stdout
    assert not list(tmp_path.iterdir()), "the harness saved failing inputs"
