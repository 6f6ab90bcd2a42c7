"""Three ``kimi-prep serve`` replicas behind one client, which balances them.

A mixed load (photos and their repeats, fresh photos, images the reference refuses) goes through one
``KimiVisionClient`` given all three addresses (``round_robin``); one replica is killed
mid-load (SIGKILL: tritonserver, its stubs and the launcher, as a pod dies) and started again on the
same ports. No request is lost or answered wrong: every photo gets its own patches, every refused
image its own typed error; the survivors take the dead replica's share and the returned replica is
used again. With ``balance="rendezvous"`` an image's repeats reach the replica that answered it
first, so the response cache's hit rate across three replicas is that of one (measured here with
one request in flight, so that hits do not depend on timing).

What was measured is printed (``pytest -s``) for docs/serving.md, "Kubernetes".
"""

from __future__ import annotations

import itertools
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from make_inputs import CORPUS, SERVE_START_BUDGET_S, ServeProcess, require_tritonserver

from kimi_vision_client.client import KimiVisionClient, WireResult
from kimi_vision_client.remote_processor import RemoteKimiProcessor
from kimi_vision_common.errors import PreprocessError
from kimi_vision_prep import KimiVisionProcessor

pytestmark = pytest.mark.server

MODEL = "kimi_k25_vision_u8"
REPLICAS = 3
PHOTOS = ["pil__hopper.jpg", "sklearn__china.jpg", "pil__hopper_gray.jpg", "sklearn__flower.jpg", "pilx__hopper.png"]
REFUSED = ["imagers__null_height.jpg", "pil__truncated_jpeg.jpg", "imagers__lossless16bit.jpg"]
UINT8 = {"do_rescale": False, "do_normalize": False}
IN_FLIGHT = 8  # requests of the load in flight at once
SUCCESS, HITS, MISSES = "nv_inference_request_success", "nv_cache_num_hits_per_model", "nv_cache_num_misses_per_model"
REPEATS = 5  # each image of the hit-rate load, sent this many times


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[ServeProcess]]:
    require_tritonserver()
    servers = [
        ServeProcess("--models", MODEL, "--instances", "1", "--threads", "1", "--response-cache-mib", "64")
        for _ in range(REPLICAS)
    ]
    for server in servers:
        server.launch()
    try:
        for server in servers:
            server.wait_ready()
        yield servers
    finally:
        for server in servers:
            server.stop()


@pytest.fixture(scope="module")
def verdicts() -> dict[str, np.ndarray | type[PreprocessError]]:
    """Each corpus file's uint8 patches in process, or the class of the error it is refused with."""
    local = KimiVisionProcessor()
    out: dict[str, np.ndarray | type[PreprocessError]] = {}
    for name in PHOTOS + REFUSED:
        try:
            out[name] = local.preprocess({"type": "image", "image": (CORPUS / name).read_bytes()}, **UINT8)[
                "pixel_values"
            ]
        except PreprocessError as exc:
            out[name] = type(exc)
    assert all(isinstance(out[name], np.ndarray) for name in PHOTOS)
    assert all(isinstance(out[name], type) for name in REFUSED)
    return out


def fresh(name: str, tag: str) -> bytes:
    """A corpus file made a new request: bytes after the image's end, which every decoder ignores
    (the same pixels), so that no response cache holds it."""
    return (CORPUS / name).read_bytes() + f"kimi-prep-test {tag}".encode()


def verdict_of(result: WireResult | PreprocessError, expected: np.ndarray | type[PreprocessError]) -> str:
    """ "exact", "lost" (no answer: unavailable, past a deadline) or "wrong"."""
    if isinstance(expected, np.ndarray):
        if isinstance(result, WireResult):
            same = result.pixels.dtype == expected.dtype and np.array_equal(result.pixels, expected)
            return "exact" if same else "wrong"
        return "lost" if not isinstance(result, PreprocessError) or "nvailable" in type(result).__name__ else "wrong"
    if isinstance(result, WireResult):
        return "wrong"
    return "exact" if type(result) is expected else ("lost" if "nvailable" in type(result).__name__ else "wrong")


def successes(servers: list[ServeProcess]) -> list[int]:
    return [server.counter(SUCCESS, MODEL) if server.process.poll() is None else 0 for server in servers]


def settled_successes(servers: list[ServeProcess], total: int) -> list[int]:
    """Each server's success count once they add up to ``total``: Triton counts a request after its
    answer has left, so a count read right after the answer may not have it yet."""
    give_up = time.monotonic() + SERVE_START_BUDGET_S
    while sum(counts := successes(servers)) < total:
        assert time.monotonic() < give_up, f"the servers counted {counts} of {total} answered requests"
        time.sleep(0.01)
    return counts


@dataclass
class Load:
    """One client sending the mixed load, :data:`IN_FLIGHT` at a time, until stopped; every
    answer's verdict and the time its window completed."""

    client: KimiVisionClient
    verdicts: dict[str, np.ndarray | type[PreprocessError]]
    stop: threading.Event = field(default_factory=threading.Event)
    seen: list[tuple[float, str, str]] = field(default_factory=list)  # (time, file, verdict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self) -> None:
        turn = 0
        while not self.stop.is_set():
            names = [*PHOTOS, *REFUSED]
            batch = [(names[(turn + i) % len(names)], turn + i) for i in range(IN_FLIGHT)]
            turn += IN_FLIGHT
            # Every other request a repeat (the cache answers it), the rest fresh bytes.
            requests = [(CORPUS / n).read_bytes() if i % 2 else fresh(n, str(i)) for n, i in batch]
            results = self.client.preprocess_media(requests, concurrency=IN_FLIGHT)
            done = time.monotonic()
            with self.lock:
                self.seen += [
                    (done, n, verdict_of(r, self.verdicts[n])) for (n, _), r in zip(batch, results, strict=True)
                ]

    def count(self, since: float = 0.0) -> int:
        with self.lock:
            return sum(1 for at, _, _ in self.seen if at >= since)

    def wait_for(self, answers: int, since: float = 0.0) -> None:
        give_up = time.monotonic() + SERVE_START_BUDGET_S
        while self.count(since) < answers:
            assert time.monotonic() < give_up, f"the load stalled: {self.summary()}"
            time.sleep(0.05)

    def summary(self) -> dict[str, int]:
        with self.lock:
            kinds = [what for _, _, what in self.seen]
        return {kind: kinds.count(kind) for kind in ("exact", "lost", "wrong")}

    def completions(self) -> list[float]:
        with self.lock:
            return sorted({at for at, _, _ in self.seen})


def test_a_replica_killed_mid_load_loses_no_request_and_comes_back(
    replicas: list[ServeProcess], verdicts: dict
) -> None:
    client = KimiVisionClient(",".join(s.grpc_url for s in replicas), "grpc", MODEL)
    load = Load(client, verdicts)
    worker = threading.Thread(target=load.run)
    before = successes(replicas)
    worker.start()
    try:
        load.wait_for(200)
        shares_before = [now - then for now, then in zip(successes(replicas), before, strict=True)]
        killed = time.monotonic()
        replicas[0].kill()
        load.wait_for(200, since=killed)
        survivors_at_kill = successes(replicas)
        load.wait_for(400, since=killed)
        shares_after = [now - then for now, then in zip(successes(replicas), survivors_at_kill, strict=True)]
        replicas[0].start()
        ready = time.monotonic()
        give_up = ready + SERVE_START_BUDGET_S
        while successes(replicas)[0] == 0:
            assert time.monotonic() < give_up, "the restarted replica got no request"
            time.sleep(0.05)
        back = time.monotonic() - ready
        load.wait_for(100, since=time.monotonic())
    finally:
        load.stop.set()
        worker.join()
        client.close()
    summary = load.summary()
    completions = load.completions()
    after_kill = [at for at in completions if at >= killed]
    window = [at for at in completions if killed - 2 <= at <= killed + 10]
    gaps = [b - a for a, b in itertools.pairwise(window)]
    usual = [b - a for a, b in itertools.pairwise(at for at in completions if at < killed)]
    print(
        f"\nreplicas: {sum(summary.values())} requests, lost {summary['lost']}, wrong {summary['wrong']}; "
        f"answers per replica before the kill {shares_before}, after it {shares_after}; first answer "
        f"{after_kill[0] - killed:.2f} s after the kill, longest wait between answers {max(gaps):.2f} s "
        f"(before the kill: {max(usual):.2f} s); "
        f"the restarted replica answered {back:.2f} s after it was ready"
    )
    assert summary["lost"] == 0 and summary["wrong"] == 0, summary
    assert all(share > 0 for share in shares_before), shares_before  # each replica had its share
    assert shares_after[0] == 0 and all(share > 0 for share in shares_after[1:]), shares_after
    refused = [what for _, name, what in load.seen if name in REFUSED]
    assert refused and set(refused) == {"exact"}  # every refused image still its own typed error


def cache_counts(servers: list[ServeProcess]) -> tuple[int, int]:
    hits = sum(server.counter(HITS, MODEL) for server in servers)
    return hits, sum(server.counter(MISSES, MODEL) for server in servers)


def hit_rate(url: str, servers: list[ServeProcess], tag: str, **options: str) -> float:
    """The response cache's hit rate over a load of every photo :data:`REPEATS` times (fresh bytes
    under ``tag``, in a seeded shuffle), one request in flight, across ``servers``."""
    requests = [fresh(name, tag) for name in PHOTOS for _ in range(REPEATS)]
    random.Random(0).shuffle(requests)
    before = cache_counts(servers)
    with KimiVisionClient(url, "grpc", MODEL, **options) as client:
        results = client.preprocess_media(requests, concurrency=1)
    assert all(isinstance(result, WireResult) for result in results)
    hits, misses = (now - then for now, then in zip(cache_counts(servers), before, strict=True))
    assert hits + misses == len(requests)
    return hits / len(requests)


def test_rendezvous_keeps_the_cache_hit_rate_of_one_replica(replicas: list[ServeProcess]) -> None:
    everyone = ",".join(s.grpc_url for s in replicas)
    one = hit_rate(replicas[1].grpc_url, replicas[1:2], "one replica")
    rendezvous = hit_rate(everyone, replicas, "rendezvous", balance="rendezvous")
    round_robin = hit_rate(everyone, replicas, "round robin", balance="round_robin")
    print(
        f"\nresponse cache hit rate ({len(PHOTOS)} images x {REPEATS}): one replica {one:.3f}, three with "
        f"rendezvous {rendezvous:.3f} ({rendezvous / one:.2f}x), three with round_robin {round_robin:.3f} "
        f"({round_robin / one:.2f}x)"
    )
    assert rendezvous >= 0.9 * one


def test_the_remote_processor_answers_exactly_from_several_replicas(
    replicas: list[ServeProcess], verdicts: dict
) -> None:
    remote = RemoteKimiProcessor(url=[s.grpc_url for s in replicas], balance="rendezvous")
    assert remote.shared_memory is False  # regions are registered with one server
    try:
        for name in PHOTOS:
            got = remote.preprocess({"type": "image", "image": fresh(name, "processor")}, **UINT8)["pixel_values"]
            assert got.dtype == verdicts[name].dtype and np.array_equal(got, verdicts[name])
    finally:
        remote.close()


def test_kimi_prep_infer_spreads_over_several_addresses(replicas: list[ServeProcess], tmp_path: Path) -> None:
    out = tmp_path / "out.npz"
    command = [sys.executable, "-m", "kimi_vision_client.cli", "infer", "--quiet", "--model", MODEL]
    command += ["--url", ",".join(s.grpc_url for s in replicas), "--balance", "rendezvous", "--out", str(out)]
    command += [str(CORPUS / name) for name in PHOTOS]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert len(np.load(out, allow_pickle=True)["names"]) == len(PHOTOS)


def test_a_dns_name_is_resolved_and_balanced(replicas: list[ServeProcess], verdicts: dict) -> None:
    port = replicas[0].grpc_url.rsplit(":", 1)[1]
    with KimiVisionClient(f"dns:///localhost:{port}", "grpc", MODEL) as client:
        (result,) = client.preprocess_media([fresh(PHOTOS[0], "dns")])
    assert isinstance(result, WireResult) and np.array_equal(result.pixels, verdicts[PHOTOS[0]])


DUAL_STACK_CLIENT = """
import json, sys
import numpy as np
from kimi_vision_client.client import KimiVisionClient
from kimi_vision_client.servers.replicas import resolved
url, model, expected, photos = sys.argv[1], sys.argv[2], np.load(sys.argv[3]), sys.argv[4:]
report = {"resolved": resolved(url.split(",")[0])}
for balance in ("round_robin", "rendezvous"):
    with KimiVisionClient(url, "grpc", model, balance=balance) as client:
        results = client.preprocess_media([open(p, "rb").read() for p in photos], concurrency=4)
    exact = [np.array_equal(getattr(r, "pixels", None), expected[str(i)]) for i, r in enumerate(results)]
    report[balance] = [bool(e) for e in exact]
print(json.dumps(report))
"""


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root and unshare")
def test_every_address_of_a_listed_name_is_used_ipv6_loopback_first(
    replicas: list[ServeProcess], verdicts: dict, tmp_path: Path
) -> None:
    """A name that resolves to ``::1`` first, then ``127.0.0.1`` (an /etc/hosts of the client's own,
    in a mount namespace), listed for two replicas listening on 127.0.0.1 only: each balance tries
    the name's every address and answers every request exactly (taking each name's first address
    alone, both replicas were unreachable)."""
    hosts = tmp_path / "hosts"
    hosts.write_text("::1 kimi-dual-stack\n127.0.0.1 kimi-dual-stack localhost\n")
    expected = tmp_path / "expected.npz"
    np.savez(expected, **{str(i): verdicts[name] for i, name in enumerate(PHOTOS)})
    url = ",".join(f"kimi-dual-stack:{server.grpc_url.rsplit(':', 1)[1]}" for server in replicas[:2])
    client = [sys.executable, "-c", DUAL_STACK_CLIENT, url, MODEL, str(expected), *(str(CORPUS / n) for n in PHOTOS)]
    mount = f'mount --bind {hosts} /etc/hosts && exec "$@"'
    command = ["unshare", "--mount", "--propagation", "private", "sh", "-c", mount, "sh", *client]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"\ndual-stack name: {report}")
    assert report["resolved"][0].startswith("[::1]") and report["resolved"][1].startswith("127.0.0.1")
    assert report["round_robin"] == [True] * len(PHOTOS) and report["rendezvous"] == [True] * len(PHOTOS)


def test_a_replica_down_from_the_start_is_passed_over(replicas: list[ServeProcess], verdicts: dict) -> None:
    """rendezvous with a first address nothing listens on: readiness and every request are answered
    by the live one (each request ranked first at the dead one is sent again)."""
    from make_inputs import free_loopback_port

    url = f"127.0.0.1:{free_loopback_port()},{replicas[1].grpc_url}"
    with KimiVisionClient(url, "grpc", MODEL, balance="rendezvous") as client:
        client.require_model()
        results = client.preprocess_media([fresh(name, "one down") for name in PHOTOS], concurrency=2)
    for name, result in zip(PHOTOS, results, strict=True):
        assert isinstance(result, WireResult) and np.array_equal(result.pixels, verdicts[name]), result


def test_a_dns_name_follows_the_replicas_it_lists(monkeypatch: pytest.MonkeyPatch, verdicts: dict) -> None:
    """A headless Service's name as an autoscaler changes it: one pod, then two, then only the new
    one. The name (resolved by a stand-in for the cluster's DNS: two servers on 127.0.0.1 and
    127.0.0.2, one port) is resolved again at each request here (REFRESH_S 0): the added replica
    takes requests, the removed one none, every answer exact."""
    from make_inputs import free_loopback_port

    from kimi_vision_client.servers import replicas as module

    require_tritonserver()
    port = free_loopback_port()
    pods = [ServeProcess("--models", MODEL, "--instances", "1", "--threads", "1", "--response-cache-mib", "0",
                         host=f"127.0.0.{i}", grpc_port=port) for i in (1, 2)]  # fmt: skip
    listed = ["127.0.0.1"]
    real_getaddrinfo = socket.getaddrinfo

    def cluster_dns(host: str, *args: object, **kwargs: object) -> list:
        if host != "kimi-prep-pods.test":
            return real_getaddrinfo(host, *args, **kwargs)  # type: ignore[arg-type]
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in listed]

    monkeypatch.setattr(module.socket, "getaddrinfo", cluster_dns)
    monkeypatch.setattr(module, "REFRESH_S", 0.0)
    for pod in pods:
        pod.launch()
    try:
        for pod in pods:
            pod.wait_ready()

        def send(count: int, tag: str) -> None:
            results = client.preprocess_media([fresh(PHOTOS[0], f"{tag} {i}") for i in range(count)], concurrency=2)
            assert all(isinstance(r, WireResult) and np.array_equal(r.pixels, verdicts[PHOTOS[0]]) for r in results)

        def resolved_to(client: KimiVisionClient, ips: list[str]) -> None:
            """Until the name's resolution (apart from the requests) has taken the change."""
            give_up = time.monotonic() + SERVE_START_BUDGET_S
            while set(client._replicas.members) != {f"{ip}:{port}" for ip in ips}:
                assert time.monotonic() < give_up, "the name's new addresses were never taken"
                client._replicas.refresh()
                time.sleep(0.01)

        with KimiVisionClient(f"dns:///kimi-prep-pods.test:{port}", "grpc", MODEL) as client:
            send(4, "one pod")
            assert settled_successes(pods, 4) == [4, 0]
            listed.append("127.0.0.2")
            resolved_to(client, listed)
            give_up, sent = time.monotonic() + SERVE_START_BUDGET_S, 4
            while settled_successes(pods, sent)[1] == 0:
                assert time.monotonic() < give_up, "the added replica got no request"
                send(2, "two pods")
                sent += 2
            listed.remove("127.0.0.1")
            resolved_to(client, listed)
            before = settled_successes(pods, sent)
            send(6, "the new pod")
            after = settled_successes(pods, sent + 6)
        assert after[0] == before[0] and after[1] == before[1] + 6
    finally:
        for pod in pods:
            pod.stop()
