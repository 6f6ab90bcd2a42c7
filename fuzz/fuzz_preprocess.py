#!/usr/bin/env python3
"""Fuzz ``kimi_vision_prep.preprocess_bytes`` against the Pillow reference (issue 5), and
``preprocess_video`` against the PyAV reference (``--target videos``).

Every input, for both presets, must be processed exactly as the reference would or rejected with a
typed bad-input error (see ``fuzz_oracle.py``). Image inputs start from small shared-corpus files
and synthetic images, video inputs from short clips of every kind the planned decode reads; they
are mutated by atheris/libFuzzer (coverage-guided, when atheris is installed) or by a plain random
loop, both mixing in structure-aware JPEG/PNG or packet-aware video mutations (``fuzz_mutators.py``).

    python fuzz/fuzz_preprocess.py --seconds 120                    # what `make fuzz` runs
    python fuzz/fuzz_preprocess.py --target videos --seconds 120    # and this
    python fuzz/fuzz_preprocess.py --replay fuzz/crashes/X.bin      # (--target videos for a video)

The command is a guard: the fuzzing runs in a child process whose resident memory is capped and
whose wall time is bounded; each input has a time limit (libFuzzer ``-timeout`` or ``SIGALRM``).
Rule violations are saved under ``--crash-dir`` (``.bin`` input + ``.txt`` detail) and fuzzing
goes on; an input that crashes, hangs or exhausts the child is saved there too. Exit status 0 means
no finding.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import resource
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fuzz_mutators import mutate, mutate_video

if TYPE_CHECKING:
    from fuzz_oracle import Finding

FUZZ_DIR = Path(__file__).resolve().parent
STARTUP_GRACE_S = 120.0  # imports, numba cache load, seed generation
POLL_S = 0.2
SAVED_PER_SIGNATURE = 3
FINDINGS_EXIT = 3  # the fuzzing process's status when it recorded rule violations (and nothing worse)
# Instrumented for coverage: Pillow and the library, except the modules holding numba kernels
# (atheris' bytecode instrumentation breaks their compilation).
INSTRUMENTED = ["PIL", "kimi_vision_prep"]
NOT_INSTRUMENTED = [
    f"kimi_vision_prep.{m}" for m in ("decode.jpeg_scan", "patchify.normalize", "numba_runtime", "resize.resize_numba")
]
CHILD_ENV = {"NUMBA_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", choices=("images", "videos"), default="images", help="what is fuzzed")
    parser.add_argument("--seconds", type=float, default=120.0, help="fuzzing time budget")
    parser.add_argument("--engine", choices=("auto", "atheris", "random"), default="auto")
    parser.add_argument("--timeout", type=int, default=10, help="seconds allowed per input")
    parser.add_argument("--rss-limit-mb", type=int, default=2048, help="resident memory cap of the fuzzing process")
    parser.add_argument("--crash-dir", type=Path, default=FUZZ_DIR / "crashes")
    parser.add_argument("--max-corpus-bytes", type=int, default=256 << 10, help="largest corpus file used as a seed")
    parser.add_argument("--seed", type=int, default=None, help="RNG seed (default: random, printed)")
    parser.add_argument("--replay", type=Path, nargs="+", help="judge these files once and exit")
    parser.add_argument("--verbose", action="store_true", help="show the fuzzing process's output (decoder warnings)")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)  # internal: the guarded process
    return parser.parse_args(argv)


# -- the fuzzing process ------------------------------------------------------------------------


Judge = Callable[[bytes, str], str]  # (input, preset) -> verdict label, or raises fuzz_oracle.Finding


def target_judge(target: str) -> Judge:
    """The verdict rule of ``target`` (``fuzz_oracle``: imported late, atheris must instrument Pillow first)."""
    import fuzz_oracle

    if target == "videos":
        return fuzz_oracle.judge_video
    decoder = fuzz_oracle.make_decoder()
    return lambda data, preset: fuzz_oracle.judge(data, preset, decoder)


def target_mutate(target: str) -> Callable[[bytes, random.Random, int], bytes]:
    return mutate_video if target == "videos" else mutate


def max_input_bytes(target: str) -> int:
    from fuzz_oracle import FUZZ_LIMITS, FUZZ_VIDEO_LIMITS

    return FUZZ_VIDEO_LIMITS.max_video_bytes if target == "videos" else FUZZ_LIMITS.max_encoded_bytes


class Session:
    """Runs inputs through the oracle and keeps the counts the guard reports."""

    def __init__(self, workdir: Path, crash_dir: Path, seconds: float, judge: Judge) -> None:
        import fuzz_oracle

        self.oracle = fuzz_oracle
        self.workdir = workdir
        self.crash_dir = crash_dir
        self.judge = judge
        self.deadline = time.monotonic() + seconds
        self.next_stats = 0.0
        self.executions = 0
        self.verdicts: Counter[str] = Counter()
        self.findings: Counter[str] = Counter()

    def expired(self) -> bool:
        return time.monotonic() >= self.deadline

    def run_one(self, data: bytes) -> bool:
        """Judge ``data`` for every preset; True when it produced a verdict not seen before."""
        (self.workdir / "current.bin").write_bytes(data)  # for the guard, should this input kill us
        new = False
        for preset in self.oracle.PRESET_NAMES:
            try:
                verdict = self.judge(data, preset)
            except self.oracle.Finding as finding:
                self._record(finding, data)
                verdict = f"{preset} FINDING {finding.signature}"
            new |= verdict not in self.verdicts
            self.verdicts[verdict] += 1
        self.executions += 1
        if time.monotonic() >= self.next_stats:
            self.write_stats()
        return new

    def _record(self, finding: Finding, data: bytes) -> None:
        self.findings[finding.signature] += 1
        if self.findings[finding.signature] > SAVED_PER_SIGNATURE:
            return
        stem = f"{slug(finding.signature)}-{hashlib.sha1(data).hexdigest()[:12]}"
        self.crash_dir.mkdir(parents=True, exist_ok=True)
        (self.crash_dir / f"{stem}.bin").write_bytes(data)
        (self.crash_dir / f"{stem}.txt").write_text(f"{finding.signature}\n\n{finding.detail}\n")
        print(f"FINDING {finding.signature} -> {self.crash_dir / stem}.bin", file=sys.stderr, flush=True)

    def write_stats(self) -> None:
        stats = {"executions": self.executions, "verdicts": self.verdicts, "findings": self.findings}
        tmp = self.workdir / "stats.json.tmp"
        tmp.write_text(json.dumps(stats))
        tmp.replace(self.workdir / "stats.json")
        self.next_stats = time.monotonic() + 1.0

    def finish(self) -> int:
        self.write_stats()
        return FINDINGS_EXIT if self.findings else 0


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "_", text).strip("_")


def write_engine_info(workdir: Path, engine: str, seed: int) -> None:
    (workdir / "engine.json").write_text(json.dumps({"engine": engine, "seed": seed}))


def load_seeds(target: str, max_corpus_bytes: int, max_bytes: int) -> dict[str, bytes]:
    from fuzz_seeds import all_seeds, video_seeds

    seeds = video_seeds() if target == "videos" else all_seeds(max_corpus_bytes)
    return {name: data for name, data in seeds.items() if len(data) <= max_bytes}


def run_atheris(args: argparse.Namespace, workdir: Path, seed: int) -> None:
    """Coverage-guided fuzzing (libFuzzer via atheris)."""
    import atheris

    with atheris.instrument_imports(include=INSTRUMENTED, exclude=NOT_INSTRUMENTED):
        import PIL.Image

        import kimi_vision_prep  # noqa: F401

        PIL.Image.init()  # import every format plugin under instrumentation
    max_len, mutate_target = max_input_bytes(args.target), target_mutate(args.target)
    seed_dir, corpus_dir = workdir / "seeds", workdir / "corpus"
    seed_dir.mkdir()
    corpus_dir.mkdir()
    for name, data in load_seeds(args.target, args.max_corpus_bytes, max_len).items():
        (seed_dir / slug(name)).write_bytes(data)
    session = Session(workdir, args.crash_dir, args.seconds, target_judge(args.target))

    def test_one_input(data: bytes) -> None:
        if session.expired():
            sys.stdout.flush()
            os._exit(session.finish())
        session.run_one(data)

    def custom_mutator(data: bytes, max_size: int, mutator_seed: int) -> bytes:
        rng = random.Random(mutator_seed)
        if rng.random() < 1 / 3:
            return atheris.Mutate(data, max_size)
        return mutate_target(data, rng, max_size)

    args.crash_dir.mkdir(parents=True, exist_ok=True)
    libfuzzer_args = [
        f"-timeout={args.timeout}",
        f"-rss_limit_mb={args.rss_limit_mb}",
        f"-max_len={max_len}",
        f"-seed={seed}",
        f"-artifact_prefix={args.crash_dir}/",
    ]
    libfuzzer_argv = [sys.argv[0], *libfuzzer_args, str(corpus_dir), str(seed_dir)]
    atheris.Setup(libfuzzer_argv, test_one_input, custom_mutator=custom_mutator)
    atheris.Fuzz()


def run_random(args: argparse.Namespace, workdir: Path, seed: int) -> int:
    """Mutation fuzzing without coverage: seeds, then mutants of seeds and of inputs with new verdicts."""
    max_len, mutate_target = max_input_bytes(args.target), target_mutate(args.target)
    pool = list(load_seeds(args.target, args.max_corpus_bytes, max_len).values())
    session = Session(workdir, args.crash_dir, args.seconds, target_judge(args.target))
    rng = random.Random(seed)
    queue = list(pool)
    while not session.expired():
        data = queue.pop() if queue else mutate_target(rng.choice(pool), rng, max_len)
        signal.alarm(args.timeout)  # SIGALRM's default action ends the process, even inside C code
        if session.run_one(data) and not queue:
            pool.append(data)
        signal.alarm(0)
    return session.finish()


def have_atheris() -> bool:
    try:
        import atheris  # noqa: F401
    except ImportError:
        return False
    return True


def child_main(args: argparse.Namespace) -> int:
    seed = args.seed if args.seed is not None else random.randrange(1, 1 << 31)
    engine = args.engine if args.engine != "auto" else ("atheris" if have_atheris() else "random")
    write_engine_info(args.child, engine, seed)
    if engine == "atheris":
        run_atheris(args, args.child, seed)
        return 0  # not reached: atheris.Fuzz() exits the process
    return run_random(args, args.child, seed)


# -- the guard ----------------------------------------------------------------------------------


def rss_mb(pid: int) -> float:
    """Resident memory of ``pid`` in MiB (0 when it is gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0.0
    match = re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE)
    return int(match.group(1)) / 1024 if match else 0.0


def watch(proc: subprocess.Popen[bytes], args: argparse.Namespace) -> tuple[int, str | None, float]:
    """Wait for the child under the RSS cap and wall-clock bound: (returncode, kill reason, peak RSS MiB).

    A kill reason starts with its label, ``oom:`` or ``hang:``.
    """
    deadline = time.monotonic() + args.seconds + STARTUP_GRACE_S + args.timeout
    peak, reason = 0.0, None
    while proc.poll() is None:
        rss = rss_mb(proc.pid)
        peak = max(peak, rss)
        if rss > args.rss_limit_mb:
            reason = f"oom: rss {rss:.0f} MiB over {args.rss_limit_mb}"
        elif time.monotonic() > deadline:
            reason = "hang: wall-clock bound exceeded"
        if reason:
            proc.kill()
            proc.wait()
            break
        time.sleep(POLL_S)
    peak = max(peak, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)
    return proc.returncode, reason, peak


def save_last_input(workdir: Path, crash_dir: Path, label: str) -> Path | None:
    """Keep the input the child was working on when it died or was killed."""
    current = workdir / "current.bin"
    if not current.exists():
        return None
    data = current.read_bytes()
    crash_dir.mkdir(parents=True, exist_ok=True)
    path = crash_dir / f"{label}-{hashlib.sha1(data).hexdigest()[:12]}.bin"
    path.write_bytes(data)
    return path


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def report(workdir: Path, elapsed: float, peak: float) -> dict[str, Any]:
    stats = read_json(workdir / "stats.json")
    engine = read_json(workdir / "engine.json")
    executions = stats.get("executions", 0)
    verdicts = stats.get("verdicts", {})
    print(f"engine: {engine.get('engine')} (seed {engine.get('seed')})")
    print(f"executions: {executions} in {elapsed:.0f} s ({executions / max(elapsed, 1e-9):.1f}/s)")
    print(f"peak RSS: {peak:.0f} MiB")
    print(f"unique verdicts: {len(verdicts)}")
    for verdict, count in sorted(verdicts.items()):
        print(f"  {count:8d}  {verdict}")
    print(f"findings: {sum(stats.get('findings', {}).values())}")
    for signature, count in sorted(stats.get("findings", {}).items()):
        print(f"  {count:8d}  {signature}")
    return stats


def log_tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


def guard_main(argv: list[str], args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="kimi-fuzz-") as tmp:
        workdir = Path(tmp)
        log_path = workdir / "child.log"
        env = {**os.environ, **CHILD_ENV}
        started = time.monotonic()
        with log_path.open("wb") as log:
            output = None if args.verbose else log
            cmd = [sys.executable, __file__, *argv, "--child", str(workdir)]
            proc = subprocess.Popen(cmd, env=env, stdout=output, stderr=subprocess.STDOUT if output else None)
            returncode, reason, peak = watch(proc, args)
        stats = report(workdir, time.monotonic() - started, peak)
        if stats.get("findings"):
            print(f"inputs and details saved under {args.crash_dir}/ (replay: --replay FILE.bin)")
        if reason is None and returncode in (0, FINDINGS_EXIT):
            return 0 if returncode == 0 else 1
        why = reason or f"crash: {signal.Signals(-returncode).name if returncode < 0 else f'status {returncode}'}"
        label = "timeout" if returncode == -signal.SIGALRM else why.split(":")[0]
        print(f"fuzzing process failed ({why}); last input: {save_last_input(workdir, args.crash_dir, label)}")
        print(log_tail(log_path))
        return 1


def replay_main(target: str, paths: list[Path]) -> int:
    from fuzz_oracle import PRESET_NAMES, Finding

    judge = target_judge(target)
    failed = 0
    for path in paths:
        for preset in PRESET_NAMES:
            try:
                print(f"{path}: {judge(path.read_bytes(), preset)}")
            except Finding as finding:
                failed += 1
                print(f"{path}: FINDING {finding}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.replay:
        return replay_main(args.target, args.replay)
    if args.child:
        return child_main(args)
    return guard_main(argv, args)


if __name__ == "__main__":
    sys.exit(main())
