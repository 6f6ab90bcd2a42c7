"""Soak test for ``make soak``: a real tritonserver under mixed good and bad images for a while.

Starts an :class:`~kimi_vision_server.launch.embedded.EmbeddedServer` (the checked-in repository), then
keeps ``--concurrency`` gRPC requests in flight for ``--seconds`` against the four ensembles (float32
and uint8 wire) and the two fused models, cycling through good images (corpus files Pillow accepts
plus synthetic ones) and bad ones (rejected corpus files, truncated / random / text payloads).
Checks: no good image ever fails, every good response is bit-equal to in-process
``preprocess_bytes`` (computed once per image and preset; uint8 patches expanded first), every bad
one gets INVALID_ARG. Prints requests, errors and the private RSS (RssAnon) of tritonserver and
each model stub at start, every ``--sample-every`` seconds and at the end.

The leak bound compares peaks: a process fails when its highest sample in the second half of the
run exceeds its highest in the first half by more than ``--rss-growth`` (fraction) *and* more than
``--rss-growth-mib``. A process's RSS under load is a working set that moves with what is in flight
(tritonserver holds up to ``concurrency`` responses of up to 38 MB of FP32 each, so a single sample
swings by hundreds of MiB), so start-vs-end samples measure luck; a leak raises every later peak.
At ~125 requests/s, a leak of 8 KiB per request adds 150 MiB between the halves of a 300 s run.

Exit code 0 on success, 1 on any failed check.
"""

from __future__ import annotations

import argparse
import queue
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
from make_inputs import CORPUS, corpus_names, jpeg_rgb, png_mode
from tritonclient.utils import InferenceServerException

from kimi_vision_prep import PreprocessError, pixel_values_from_patches, preprocess_bytes
from kimi_vision_server.launch.embedded import EmbeddedServer

# Model -> (preset, pixel output): float32 PIXEL_VALUES, or uint8 PIXEL_PATCHES expanded here.
ENSEMBLES = {
    "kimi_k25_vision": ("kimi-k2.5", "PIXEL_VALUES"),
    "kimi_k3_vision": ("kimi-k3", "PIXEL_VALUES"),
    "kimi_k25_vision_u8": ("kimi-k2.5", "PIXEL_PATCHES"),
    "kimi_k3_vision_u8": ("kimi-k3", "PIXEL_PATCHES"),
    # The fused models (decode + preprocess in one stub), one per pixel output.
    "kimi_k25_vision_fused_u8": ("kimi-k2.5", "PIXEL_PATCHES"),
    "kimi_k3_vision_fused": ("kimi-k3", "PIXEL_VALUES"),
}
PRESETS = sorted({preset for preset, _ in ENSEMBLES.values()})
INVALID_ARG = "StatusCode.INVALID_ARGUMENT"
MIB = 1 << 20


# -- process memory --------------------------------------------------------------------------------


def _rss_bytes(pid: int, field: str) -> int:
    """One ``Rss*`` line of /proc/PID/status, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    return 0


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def _stub_label(pid: int) -> str:
    """The model a Python-backend stub serves (``.../<model>/1/model.py`` on its command line)."""
    args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    for arg in args:
        if arg.endswith(b"/model.py"):
            return Path(arg.decode()).parts[-3]
    return f"pid{pid}"


def server_rss(server_pid: int, field: str = "RssAnon") -> dict[str, int]:
    """``field`` (RssAnon: private memory; RssShmem: mapped shared memory) in bytes of tritonserver
    and each of its stub processes, by model name.

    The leak bound applies to RssAnon. RssShmem counts the touched pages of the Python backend's
    shared-memory pool, which grows (in shm-growth-byte-size steps) until it holds the largest
    batch of outputs in flight, e.g. 8 decoded 13.7 MP images = 330 MiB for a decode model: bounded
    by the pool, not a leak, so it is printed but not bounded here.
    """
    rss = {"tritonserver": _rss_bytes(server_pid, field)}
    for child in _children(server_pid):
        try:
            rss[_stub_label(child)] = _rss_bytes(child, field)
        except FileNotFoundError:  # exited between listing and reading
            continue
    return rss


def half_peaks(samples: Samples, seconds: float) -> tuple[dict[str, int], dict[str, int]]:
    """Per process, the highest RSS sampled in the first and in the second half of the run."""
    first: dict[str, int] = {}
    second: dict[str, int] = {}
    for elapsed, rss in samples:
        peaks = first if elapsed < seconds / 2 else second
        for name, value in rss.items():
            peaks[name] = max(peaks.get(name, 0), value)
    return first, second


def rss_growth_failures(first: dict[str, int], second: dict[str, int], fraction: float, mib: float) -> list[str]:
    """Processes whose second-half peak exceeds their first-half peak by more than ``fraction`` of it
    and more than ``mib`` MiB, or that are gone."""
    failures = []
    for name, before in first.items():
        after = second.get(name)
        if after is None:
            failures.append(f"{name}: process gone")
        elif after - before > max(fraction * before, mib * MIB):
            failures.append(f"{name}: peak {before / MIB:.0f} -> {after / MIB:.0f} MiB")
    return failures


def format_rss(rss: dict[str, int]) -> str:
    return ", ".join(f"{name} {value / MIB:.0f} MiB" for name, value in sorted(rss.items()))


# -- the workload ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Item:
    """One payload and, per preset, the expected outcome: outputs (good) or None (bad)."""

    label: str
    data: bytes
    expected: dict[str, dict[str, np.ndarray] | None]


def expected_outputs(data: bytes, preset: str) -> dict[str, np.ndarray] | None:
    try:
        result = preprocess_bytes(data, preset)
    except PreprocessError:
        return None
    return {
        "PIXEL_VALUES": result.pixel_values,
        "GRID_THW": result.grid_thw,
        "NUM_TOKENS": np.array(result.num_tokens, dtype=np.int32),
    }


def workload() -> list[Item]:
    """Good and bad payloads, with the in-process result for every preset precomputed."""
    payloads: dict[str, bytes] = {
        "synthetic 640x480 jpeg": jpeg_rgb(640, 480),
        "synthetic 2400x1800 jpeg": jpeg_rgb(2400, 1800, seed=3),
        "synthetic rgba png": png_mode(300, 200, "RGBA"),
        "synthetic palette+trns png": png_mode(120, 90, "P+trns"),
        "empty": b"",
        "text path": b"/etc/passwd",
        "random bytes": np.random.default_rng(0).bytes(4096),
    }
    jpeg = payloads["synthetic 640x480 jpeg"]
    payloads["truncated jpeg"] = jpeg[: len(jpeg) // 2]
    for name in corpus_names(accepted=True)[::4] + corpus_names(accepted=False):
        payloads[name] = (CORPUS / name).read_bytes()
    return [
        Item(label, data, {preset: expected_outputs(data, preset) for preset in PRESETS})
        for label, data in payloads.items()
    ]


@dataclass
class Tally:
    requests: int = 0
    good_errors: list[str] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    bad_wrong_code: list[str] = field(default_factory=list)
    codes: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)


def check(item: Item, model: str, result: object, error: InferenceServerException | None, tally: Tally) -> None:
    preset, pixel_output = ENSEMBLES[model]
    expected = item.expected[preset]
    with tally.lock:
        tally.requests += 1
        tally.codes["OK" if error is None else str(error.status())] += 1
        if expected is None:
            if error is None or error.status() != INVALID_ARG:
                tally.bad_wrong_code.append(f"{item.label} ({model}): {error.status() if error else 'accepted'}")
            return
        if error is not None:
            tally.good_errors.append(f"{item.label} ({model}): {error.status()} {error.message()}")
            return
    outputs = {name: result.as_numpy(name) for name in (pixel_output, "GRID_THW", "NUM_TOKENS")}
    pixel_values = outputs[pixel_output][0]
    if pixel_output == "PIXEL_PATCHES":
        pixel_values = pixel_values_from_patches(pixel_values, preset)
    same = (
        np.array_equal(pixel_values, expected["PIXEL_VALUES"])
        and np.array_equal(outputs["GRID_THW"][0, 0], expected["GRID_THW"])
        and int(outputs["NUM_TOKENS"][0, 0]) == int(expected["NUM_TOKENS"])
    )
    if not same:
        with tally.lock:
            tally.mismatches.append(f"{item.label} ({model})")


Samples = list[tuple[float, dict[str, int]]]  # (seconds since the load started, server_rss)


def sample_rss(server_pid: int, every_s: float, stop: threading.Event, samples: Samples) -> None:
    """Append ``(seconds since start, server_rss)`` every ``every_s`` until ``stop``, printing each."""
    started = time.monotonic()
    while not stop.wait(every_s):
        elapsed, rss = time.monotonic() - started, server_rss(server_pid)
        samples.append((elapsed, rss))
        print(f"  {elapsed:5.0f} s  RssAnon {format_rss(rss)}", flush=True)


def run_load(url: str, items: list[Item], seconds: float, concurrency: int, tally: Tally) -> None:
    """Keep ``concurrency`` async gRPC requests in flight, round robin over items and ensembles."""
    client = grpcclient.InferenceServerClient(url)
    slots = threading.Semaphore(concurrency)
    pending: queue.Queue[None] = queue.Queue()
    jobs = [(item, model) for item in items for model in ENSEMBLES]
    deadline = time.monotonic() + seconds
    sent = 0
    try:
        while time.monotonic() < deadline:
            item, model = jobs[sent % len(jobs)]
            slots.acquire()
            tensor = grpcclient.InferInput("IMAGE_BYTES", [1, 1], "BYTES")
            tensor.set_data_from_numpy(np.array([[item.data]], dtype=np.object_))

            def done(result: object, error: object, item: Item = item, model: str = model) -> None:
                try:
                    check(item, model, result, error, tally)
                finally:
                    slots.release()
                    pending.put(None)

            outputs = [grpcclient.InferRequestedOutput(n) for n in (ENSEMBLES[model][1], "GRID_THW", "NUM_TOKENS")]
            client.async_infer(model, [tensor], done, outputs=outputs)
            sent += 1
        for _ in range(sent):
            pending.get(timeout=300)
    finally:
        client.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=300.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rss-growth", type=float, default=0.25, help="allowed peak growth, fraction")
    parser.add_argument("--rss-growth-mib", type=float, default=150.0, help="allowed peak growth, MiB")
    parser.add_argument("--sample-every", type=float, default=15.0, help="print every process's RssAnon this often (s)")
    args = parser.parse_args(argv)

    items = workload()
    good = sum(1 for item in items for outcome in item.expected.values() if outcome is not None)
    print(
        f"workload: {len(items)} payloads, {good} good / {len(PRESETS) * len(items) - good} bad (payload, preset) "
        f"pairs, sent round robin to {', '.join(ENSEMBLES)}"
    )
    tally = Tally()
    with EmbeddedServer() as server:
        assert server.process is not None
        run_load(server.grpc_url, items, min(10.0, args.seconds), args.concurrency, Tally())  # warm-up, not counted
        start_rss = server_rss(server.process.pid)
        samples: Samples = []
        stop = threading.Event()
        every_s = min(args.sample_every, args.seconds / 8)  # at least 4 samples per half
        sampler = threading.Thread(target=sample_rss, args=(server.process.pid, every_s, stop, samples))
        sampler.start()
        started = time.monotonic()
        try:
            run_load(server.grpc_url, items, args.seconds, args.concurrency, tally)
        finally:
            stop.set()
            sampler.join()
        elapsed = time.monotonic() - started
        end_rss = server_rss(server.process.pid)
        end_shmem = server_rss(server.process.pid, "RssShmem")
        ready = server.is_ready()
    rate = tally.requests / elapsed
    print(f"requests: {tally.requests} in {elapsed:.0f} s ({rate:.1f}/s), codes {dict(tally.codes)}")
    print(f"RssAnon start: {format_rss(start_rss)}")
    print(f"RssAnon end:   {format_rss(end_rss)}")
    first_peaks, second_peaks = half_peaks(samples, elapsed)
    print(f"RssAnon peak, first half:  {format_rss(first_peaks)}")
    print(f"RssAnon peak, second half: {format_rss(second_peaks)}")
    print(f"RssShmem end (backend shm pool, bounded): {format_rss(end_shmem)}")
    failures = [
        *(f"good image failed: {x}" for x in tally.good_errors[:10]),
        *(f"not bit-equal to preprocess_bytes: {x}" for x in tally.mismatches[:10]),
        *(f"bad image not INVALID_ARG: {x}" for x in tally.bad_wrong_code[:10]),
        *(
            f"RSS grew: {x}"
            for x in rss_growth_failures(first_peaks, second_peaks, args.rss_growth, args.rss_growth_mib)
        ),
        *([] if ready else ["server not ready at the end"]),
    ]
    print(
        f"errors: {len(tally.good_errors)} on good images, {len(tally.mismatches)} mismatches, "
        f"{len(tally.bad_wrong_code)} bad images without INVALID_ARG"
    )
    for failure in failures:
        print(f"FAIL {failure}")
    print("soak: FAILED" if failures else "soak: OK")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
