"""How fast a killed Python-backend stub, or a killed tritonserver, is noticed and the model serves
exactly again, idle and under load.

    .venv/bin/python benchmarks/bench_recovery.py [--serve repository|default] [--rounds 3] [--load 4]
        [--no-kill-server] [--out-dir bench_results]

One embedded server with the stub watchdog and a probe port: ``--serve repository`` (the default)
serves the checked-in repository as it is (an instance a model; ``kimi_k25_vision`` is
``kimi_k25_decode`` then the Python ``kimi_k25_preprocess``), ``--serve default`` what `kimi-prep
serve` renders on this host (its layout; on a CPU host the ensemble ends with the C patchify step,
which runs inside tritonserver and has no stub). Each round kills the first stub of each Python
step of ``kimi_k25_vision`` in turn with SIGKILL, then tritonserver itself (the watchdog starts
it again: docs/faults.md; not with ``--no-kill-server``), first with the server idle, then under load
(``--load`` client threads, in a process of their own, sending corpus photos and undecodable bytes
to ``kimi_k25_vision`` over gRPC without pause), and measures, from the kill: the seconds until
``kimi_k25_vision`` answers every corpus image bit-equal to ``preprocess_bytes`` again once
``/readyz`` has said the server is not ready (the death noticed), and until ``/readyz`` is 200
again. The load's requests are counted by outcome: exact, a typed error, a wrong
answer, or no answer within 60 s (hung). After the rounds: the live stubs of each killed step
against their count before the first kill (a replaced version that never unloads keeps its
surviving stubs until the watchdog ends them, idle) and the PSS of tritonserver and its stubs
then and before. Prints min/median per model and condition; writes ``bench_recovery.json`` and
``.png``. tests/test_faults.py checks that recovery happens (under
load, with the counters); this measures how long it takes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import signal
import statistics
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_idle_memory import pss_mib
from photos import CORPUS
from plots import saved_axes

from kimi_vision_prep import preprocess_bytes
from kimi_vision_server.launch.embedded import EmbeddedServer, free_port
from kimi_vision_server.render.repository import RenderOptions, default_model_names, host_rendering
from kimi_vision_server.watch.stub_scan import stub_processes
from kimi_vision_server.watch.watchdog import SERVER_QUICK_EXIT_S

MODEL = "kimi_k25_vision"
KILLED = ("kimi_k25_decode", "kimi_k25_preprocess")
SERVER = "tritonserver"  # killed last in each round: the watchdog starts it again (docs/faults.md)
IMAGES = ("pil__hopper.jpg", "imagers__large_image.jpg")
GIVE_UP_S = 600.0


def serves_exactly(url: str, cases: list[tuple[bytes, np.ndarray]]) -> bool:
    client = grpcclient.InferenceServerClient(url)
    try:
        for data, expected in cases:
            tensor = grpcclient.InferInput("IMAGE_BYTES", [1, 1], "BYTES")
            tensor.set_data_from_numpy(np.array([[data]], dtype=np.object_))
            result = client.infer(MODEL, [tensor], client_timeout=60)
            if not np.array_equal(result.as_numpy("PIXEL_VALUES")[0], expected):
                return False
        return True
    except InferenceServerException:
        return False
    finally:
        client.close()


class Load:
    """``threads`` clients sending a corpus photo, then undecodable bytes, in turn, without pause,
    each answer checked; ``outcomes`` counts them (``exact``, ``typed_error``, ``wrong``, ``hung``)
    once the load has stopped. The clients run in a process of their own: in this one they would
    hold its GIL (each checks a 38 MB answer) while the kill's own check waits to run, and the
    seconds measured would be this process's, not the server's."""

    def __init__(self, url: str, cases: list[tuple[bytes, np.ndarray]], threads: int) -> None:
        context = multiprocessing.get_context("spawn")  # no fork of a process with gRPC threads
        self._stop = context.Event()
        self._outcomes = context.Queue()
        self._process = context.Process(target=_load, args=(url, cases, threads, self._stop, self._outcomes))
        self.outcomes: dict[str, int] = {}

    def __enter__(self) -> Load:
        self._process.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self.outcomes = self._outcomes.get(timeout=GIVE_UP_S)
        self._process.join()


def _load(url: str, cases: list[tuple[bytes, np.ndarray]], threads: int, stop: Any, outcomes: Any) -> None:
    """The load's process: ``threads`` clients until ``stop`` is set, then their counts to ``outcomes``."""
    counts = {"exact": 0, "typed_error": 0, "wrong": 0, "hung": 0}
    lock = threading.Lock()

    def count(outcome: str) -> None:
        with lock:
            counts[outcome] += 1

    def run(index: int) -> None:
        client = grpcclient.InferenceServerClient(url)
        requests = [*cases, (b"\xff\xd8 not a JPEG " * 64, None)]
        turn = index
        try:
            while not stop.is_set():
                data, expected = requests[turn % len(requests)]
                turn += 1
                tensor = grpcclient.InferInput("IMAGE_BYTES", [1, 1], "BYTES")
                tensor.set_data_from_numpy(np.array([[data]], dtype=np.object_))
                try:
                    result = client.infer(MODEL, [tensor], client_timeout=60)
                except InferenceServerException as exc:
                    count("hung" if "Deadline" in str(exc) else "typed_error")
                    continue
                exact = expected is not None and np.array_equal(result.as_numpy("PIXEL_VALUES")[0], expected)
                count("exact" if exact else "wrong")
        finally:
            client.close()

    workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    outcomes.put(counts)


def ready(server: EmbeddedServer) -> bool:
    try:
        with urllib.request.urlopen(server.probe_url + "/readyz", timeout=30) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def seconds_until(condition, started: float) -> float:
    while not condition():
        if time.monotonic() - started > GIVE_UP_S:
            raise RuntimeError(f"no recovery within {GIVE_UP_S:g} s")
        time.sleep(0.02)
    return time.monotonic() - started


def victim(server: EmbeddedServer, killed: str) -> int:
    """The pid to kill: tritonserver itself, or the first stub of the model ``killed``."""
    assert server.process is not None
    if killed == SERVER:
        return server.process.pid
    (stub,) = [s for s in stub_processes(server.process.pid) if s.instance == f"{killed}_0_0" and not s.zombie]
    return stub.pid


def kill_and_time(
    server: EmbeddedServer, killed: str, cases: list[tuple[bytes, np.ndarray]], not_before: float
) -> tuple[float, float]:
    """SIGKILL ``killed`` (a model's stub, or tritonserver) once the server is ready and not before
    the monotonic time ``not_before``; (seconds until exact again, until ready)."""
    seconds_until(lambda: ready(server), time.monotonic())
    time.sleep(max(0.0, not_before - time.monotonic()))
    pid = victim(server, killed)
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    # Until the death is noticed: with two instances the surviving one can answer the check first.
    seconds_until(lambda: not ready(server), killed_at)
    exact_s = seconds_until(lambda: serves_exactly(server.grpc_url, cases), killed_at)
    return exact_s, seconds_until(lambda: ready(server), killed_at)


def live_stubs(server: EmbeddedServer, models: list[str]) -> dict[str, int]:
    assert server.process is not None
    stubs = [s for s in stub_processes(server.process.pid) if not s.zombie]
    return {model: sum(s.model == model for s in stubs) for model in models}


def leftover(server: EmbeddedServer, killed: list[str], before: dict[str, int]) -> dict[str, Any]:
    """The killed steps' live stubs after the rounds, once they are back to ``before`` or the
    watchdog's idle wait for replaced stubs has passed twice over."""
    assert server.watchdog is not None
    started = time.monotonic()
    deadline = started + 2 * server.watchdog.replaced_idle_s + 10
    while live_stubs(server, killed) != before and time.monotonic() < deadline:
        time.sleep(0.5)
    after = live_stubs(server, killed)
    ended = server.watchdog.counters()["replaced_stubs_ended"]
    return {
        "live_stubs_before": before,
        "live_stubs_after": after,
        "waited_s": time.monotonic() - started,
        "replaced_stubs_ended": ended,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--load", type=int, default=4, help="client threads of the load (0: idle only)")
    parser.add_argument(
        "--serve",
        choices=("repository", "default"),
        default="repository",
        help="the checked-in repository as it is (an instance a model, the Python preprocess step), or "
        "what `kimi-prep serve` renders on this host (its layout; a CPU host ends with the C patchify step)",
    )
    parser.add_argument(
        "--kill-server",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="end each round by killing tritonserver itself (the watchdog starts it again)",
    )
    parser.add_argument("--out-dir", type=Path, default=Path("bench_results"))
    args = parser.parse_args()
    cases = [((CORPUS / n).read_bytes(), preprocess_bytes((CORPUS / n).read_bytes()).pixel_values) for n in IMAGES]
    conditions = ["idle", *(["under_load"] if args.load else [])]
    outcomes: dict[str, int] = {}
    render, models = (None, None) if args.serve == "repository" else (host_rendering(), default_model_names())
    with EmbeddedServer(render=render, models=models, probe_port=free_port()) as server:
        assert server.process is not None and serves_exactly(server.grpc_url, cases)
        stubbed = {stub.model for stub in stub_processes(server.process.pid)}
        killed = [model for model in KILLED if model in stubbed]  # a C step has no stub to kill
        killed_all = [*killed, *([SERVER] if args.kill_server else [])]
        results = {c: {m: {"exact_s": [], "ready_s": []} for m in killed_all} for c in conditions}
        stubs_before, pss_before = live_stubs(server, killed), pss_mib(server.process_tree())
        restarted_at = -SERVER_QUICK_EXIT_S  # the first server's first exit is started again at once
        for condition in conditions:
            with contextlib.ExitStack() as stack:
                load = stack.enter_context(Load(server.grpc_url, cases, args.load)) if condition != "idle" else None
                for _ in range(args.rounds):
                    for model in killed_all:
                        # A tritonserver that dies within SERVER_QUICK_EXIT_S of a restart is started
                        # again after a backoff (a crash loop's): this measures the start at once.
                        not_before = restarted_at + SERVER_QUICK_EXIT_S if model == SERVER else 0.0
                        exact_s, ready_s = kill_and_time(server, model, cases, not_before)
                        if model == SERVER:
                            restarted_at = time.monotonic()
                        results[condition][model]["exact_s"].append(exact_s)
                        results[condition][model]["ready_s"].append(ready_s)
                        print(f"{condition} {model}: exact after {exact_s:.2f} s, ready after {ready_s:.2f} s")
            if load is not None:
                outcomes = load.outcomes
                print(f"the load's requests: {outcomes}", flush=True)
        after = leftover(server, killed, stubs_before)
        after |= {"pss_mib_before": pss_before, "pss_mib_after": pss_mib(server.process_tree())}
        print(
            f"live stubs of the killed steps: {after['live_stubs_before']} before the kills, "
            f"{after['live_stubs_after']} {after['waited_s']:.0f} s after the rounds "
            f"(replaced stubs ended: {after['replaced_stubs_ended']}); PSS of tritonserver and its stubs "
            f"{after['pss_mib_before']:.0f} MiB before, {after['pss_mib_after']:.0f} MiB after",
            flush=True,
        )
    summary = {
        condition: {
            model: {
                f"{key}_{stat}": fn(values)
                for key, values in by.items()
                for stat, fn in (("min", min), ("median", statistics.median))
            }
            for model, by in by_model.items()
        }
        for condition, by_model in results.items()
    }
    for condition, by_model in summary.items():
        for model, row in by_model.items():
            print(
                f"{condition:10s} {model:22s} exact again: min {row['exact_s_min']:.2f} s, median "
                f"{row['exact_s_median']:.2f} s; /readyz: min {row['ready_s_min']:.2f} s, "
                f"median {row['ready_s_median']:.2f} s"
            )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    report = {
        "serve": args.serve,
        "layout": repr(render or RenderOptions()),
        "rounds": args.rounds,
        "load_threads": args.load,
        "cpus": os.cpu_count(),
        "seconds": results,
    }
    report |= {"summary": summary, "load_outcomes": outcomes, "after_the_rounds": after}
    (args.out_dir / "bench_recovery.json").write_text(json.dumps(report, indent=2))
    with saved_axes(args.out_dir / "bench_recovery.png", (7, 3.5)) as ax:
        x = np.arange(len(killed_all))
        width = 0.8 / len(conditions)
        for i, condition in enumerate(conditions):
            medians = [summary[condition][m]["exact_s_median"] for m in killed_all]
            ax.bar(x - 0.4 + width * (i + 0.5), medians, width, label=f"exact again, {condition.replace('_', ' ')}")
        ax.set_xticks(x, [f"kill -9 {m}" for m in killed_all])
        ax.set_ylabel(f"seconds after the kill (median of {args.rounds})")
        ax.legend()
    return 0


if __name__ == "__main__":
    sys.exit(main())
