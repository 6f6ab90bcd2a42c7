"""How fast a killed Python-backend stub is noticed and its model serves exactly again.

    .venv/bin/python benchmarks/bench_recovery.py [--rounds 3] [--out-dir bench_results]

One embedded server (the checked-in repository, the stub watchdog, a probe port); each round
kills the stub of ``kimi_k25_decode`` and then of ``kimi_k25_preprocess`` with SIGKILL and
measures, from the kill: the seconds until ``kimi_k25_vision`` answers every corpus image
bit-equal to ``preprocess_bytes`` again, and until ``/readyz`` is 200 again. Prints min/median
per model; writes ``bench_recovery.json`` and ``.png``. tests/test_faults.py checks that recovery
happens (under load, with the counters); this measures how long it takes.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

sys.path.insert(0, str(Path(__file__).resolve().parent))

from photos import CORPUS
from plots import saved_axes

from kimi_vision_prep import preprocess_bytes
from kimi_vision_server.embedded import EmbeddedServer, free_port
from kimi_vision_server.watchdog import stub_processes

MODEL = "kimi_k25_vision"
KILLED = ("kimi_k25_decode", "kimi_k25_preprocess")
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out-dir", type=Path, default=Path("bench_results"))
    args = parser.parse_args()
    cases = [((CORPUS / n).read_bytes(), preprocess_bytes((CORPUS / n).read_bytes()).pixel_values) for n in IMAGES]
    results: dict[str, dict[str, list[float]]] = {m: {"exact_s": [], "ready_s": []} for m in KILLED}
    with EmbeddedServer(probe_port=free_port()) as server:
        assert server.process is not None and serves_exactly(server.grpc_url, cases)
        for _ in range(args.rounds):
            for model in KILLED:
                seconds_until(lambda: ready(server), time.monotonic())
                (stub,) = [
                    s for s in stub_processes(server.process.pid) if s.instance == f"{model}_0_0" and not s.zombie
                ]
                killed_at = time.monotonic()
                os.kill(stub.pid, signal.SIGKILL)
                time.sleep(0.05)  # the stub is gone before the first check
                results[model]["exact_s"].append(
                    seconds_until(lambda: serves_exactly(server.grpc_url, cases), killed_at)
                )
                results[model]["ready_s"].append(seconds_until(lambda: ready(server), killed_at))
                print(
                    f"{model}: exact again after {results[model]['exact_s'][-1]:.2f} s, "
                    f"/readyz 200 after {results[model]['ready_s'][-1]:.2f} s",
                    flush=True,
                )
    summary = {
        model: {
            f"{key}_{stat}": fn(values)
            for key, values in by.items()
            for stat, fn in (("min", min), ("median", statistics.median))
        }
        for model, by in results.items()
    }
    for model, row in summary.items():
        print(
            f"{model:22s} exact again: min {row['exact_s_min']:.2f} s, median {row['exact_s_median']:.2f} s; "
            f"/readyz: min {row['ready_s_min']:.2f} s, median {row['ready_s_median']:.2f} s"
        )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "bench_recovery.json").write_text(
        json.dumps({"rounds": args.rounds, "cpus": os.cpu_count(), "seconds": results, "summary": summary}, indent=2)
    )
    with saved_axes(args.out_dir / "bench_recovery.png", (6, 3.5)) as ax:
        x = np.arange(len(KILLED))
        ax.bar(x - 0.2, [summary[m]["exact_s_median"] for m in KILLED], 0.4, label=f"{MODEL} exact again")
        ax.bar(x + 0.2, [summary[m]["ready_s_median"] for m in KILLED], 0.4, label="/readyz 200 again")
        ax.set_xticks(x, [f"kill -9 {m}" for m in KILLED])
        ax.set_ylabel(f"seconds after the kill (median of {args.rounds})")
        ax.legend()
    return 0


if __name__ == "__main__":
    sys.exit(main())
