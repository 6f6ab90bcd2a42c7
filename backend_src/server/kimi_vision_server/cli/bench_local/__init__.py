"""``kimi-prep bench-local``: in-process, side-by-side timings in one run.

For each image: ours (``preprocess_bytes`` exactly as a caller gets it), a reference processor when
the caller gives one (``benchmarks/bench_local_corpus.py`` gives ``tests/reference.py``), the floor
(:func:`fastest_exact_decode`: the fastest exact single-thread decoder alone), our decoder alone
(``decode``: the library's route for the file, a lone JPEG in row bands on every core, so
``ours/decode`` is what the pipeline adds to its own decode), the Pillow decode and, when
installed, DALI's CPU pipeline (decode, antialiased cubic resize to the same size, normalize). Then
batch throughput (``preprocess_batch`` over the set: single-thread = 1 worker, 1 numba and 1
decoder thread, against the defaults) and a profile (decode, resize, patchify, the rest: allocation
and page faults) of the images nearest 1080p, 9 MP and 12 MP. Every number is min/median of
``repeats`` runs; ratios compare medians measured in the same process. Images fall in two classes:
``no-resize`` (within the preset's patch budget) and ``downscale``. The default images are
generated (:func:`~.samples.bench_photos`), so the command needs no checkout; ``--images`` takes
real photos, and ``benchmarks/bench_local_corpus.py`` runs it on the test corpus against
``tests/reference.py``. Writes ``bench_local.json`` and ``bench_local.png`` under ``out_dir``.
"""

# The package's own names, as ``kimi-prep bench-local`` and the benchmarks call them.
from .contenders import BenchImage, apply_allocator, bench_images, fastest_exact_decode
from .measure import BATCH_ROUNDS, run
from .timing import Timing, throughput, time_calls, timed_rounds

__all__ = [
    "BATCH_ROUNDS",
    "BenchImage",
    "Timing",
    "apply_allocator",
    "bench_images",
    "fastest_exact_decode",
    "run",
    "throughput",
    "time_calls",
    "timed_rounds",
]
