"""A client and a ``kimi-prep serve`` sharing a ``/dev/shm`` with little room left, as a container
with Docker's small default ``/dev/shm`` is: run as root in a mount namespace of its own (``unshare
--mount``), by ``tests/test_remote_shared_memory.py``.

    unshare --mount --propagation private python shm_namespace_side.py OUT.json

It mounts a fresh tmpfs on ``/dev/shm``, starts the server, and leaves free on it less than a large
photo's request needs beside the client's headroom but enough for a small one; then the client, in
``auto`` mode, preprocesses both. Written to OUT.json: whether each answer equals the library's in
process, the free bytes left and the bytes each request needs (its input, then its outputs as the
server returned them), and the largest region the server had registered after each request; then,
with room for two large requests' regions, eight sent at once: whether each answer is exact, the
regions the client holds, and whether tritonserver is still the one it was (a region written past
a full tmpfs would have killed it with SIGBUS).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import tritonclient.grpc
from make_inputs import CORPUS, ServeProcess, jpeg_rgb

from kimi_vision_client.client import KimiVisionClient
from kimi_vision_client.request.shm_slots import SHM_HEADROOM_BYTES, SHM_ROOT, NoRoomError, ShmRegion, shm_free_bytes
from kimi_vision_prep import preprocess_bytes

MODEL = "kimi_k25_vision_u8"
IN_FLIGHT = 8
TMPFS_BYTES = 512 << 20
FILLER = Path(SHM_ROOT) / "kimi_test_filler"


def registered_sizes(url: str) -> list[int]:
    with tritonclient.grpc.InferenceServerClient(url) as client:
        regions = client.get_system_shared_memory_status(as_json=True).get("regions", {})
    return [int(region["byte_size"]) for region in regions.values()]


def fill_leaving(free_bytes: int) -> None:
    """Write a file on /dev/shm so that about ``free_bytes`` stay free (tmpfs pages are allocated
    as they are written)."""
    size = shm_free_bytes() - free_bytes
    with FILLER.open("wb") as out:
        chunk = b"\0" * (1 << 20)
        for _ in range(size >> 20):
            out.write(chunk)


def main(out: Path) -> None:
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES}", "kimi-test-shm", SHM_ROOT], check=True)
    small, large = (CORPUS / "pil__hopper.jpg").read_bytes(), jpeg_rgb(4000, 3000)
    expected = {name: preprocess_bytes(data, "kimi-k2.5", output="pixel_patches").pixel_patches for name, data in
                (("small", small), ("large", large))}  # fmt: skip
    server = ServeProcess("--models", MODEL, "--instances", "1", "--threads", "1", "--response-cache-mib", "0")
    server.start()
    try:
        with KimiVisionClient(server.grpc_url, "grpc", MODEL) as wire:  # the stub's own pages, touched first
            # A request's input (the file behind its 4-byte length), then its outputs.
            needs = {
                name: 4 + len(data) + r.pixels.nbytes + r.grid_thw.nbytes + 4
                for name, data in (("small", small), ("large", large))
                for r in wire.preprocess_media([data])
            }
        free = needs["large"] + SHM_HEADROOM_BYTES - (2 << 20)  # the large request does not fit, the small does
        fill_leaving(free)
        report: dict = {"needs": needs, "free": shm_free_bytes(), "headroom": SHM_HEADROOM_BYTES}
        with KimiVisionClient(server.grpc_url, "grpc", MODEL, use_shared_memory="auto") as client:
            for name, data in (("small", small), ("large", large)):
                (result,) = client.preprocess_media([data])
                report[name] = {
                    "exact": bool(np.array_equal(result.pixels, expected[name])),
                    "largest_region": max(registered_sizes(server.grpc_url), default=0),
                }
        # Room for two large requests' regions beside the headroom, eight of them in flight at once.
        FILLER.unlink()
        fill_leaving(SHM_HEADROOM_BYTES + 5 * needs["large"] // 2)
        tritonserver = server.tritonserver_pid()
        with KimiVisionClient(server.grpc_url, "grpc", MODEL, use_shared_memory="auto") as client:
            results = client.preprocess_media([large] * IN_FLIGHT, concurrency=IN_FLIGHT)
            report["in_flight"] = {
                "exact": [bool(np.array_equal(getattr(r, "pixels", None), expected["large"])) for r in results],
                "regions": len(client.shared_memory_regions),
                "same_tritonserver": server.tritonserver_pid() == tritonserver,
            }
        # A region larger than what is free: its pages cannot be reserved, and nothing is left of it.
        free = shm_free_bytes()
        try:
            ShmRegion(free + (1 << 20))
            report["no_room"] = {"refused": False}
        except NoRoomError:
            report["no_room"] = {"refused": True, "free_before": free, "free_after": shm_free_bytes()}
    finally:
        server.stop()
        FILLER.unlink(missing_ok=True)
    out.write_text(json.dumps(report))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
