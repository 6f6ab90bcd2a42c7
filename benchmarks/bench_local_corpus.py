"""``kimi-prep bench-local`` on the corpus photos against ``tests/reference.py`` (developer benchmark).

    .venv/bin/python benchmarks/bench_local_corpus.py [--preset kimi-k2.5] [--repeats 5] [--out-dir bench_results]
        [--keep-large-buffers]

The same timings, ratios, JSON and PNG as the installed command (``kimi_vision_server.cli.bench_local``),
on the real photos BENCHMARKS.md reports, with the test suite's plain reference as the baseline.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from photos import benchmark_photos, plain_reference

from kimi_vision_server.cli import bench_local


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="kimi-k2.5")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out-dir", type=Path, default=Path("bench_results"))
    parser.add_argument("--keep-large-buffers", action="store_true", help="kimi_vision_server/allocator.py's retention")
    args = parser.parse_args()
    allocator = bench_local.apply_allocator(args.keep_large_buffers)
    reference = plain_reference().reference_preprocess
    bench_local.run(args.preset, args.repeats, args.out_dir, allocator, benchmark_photos(), reference)
    return 0


if __name__ == "__main__":
    sys.exit(main())
