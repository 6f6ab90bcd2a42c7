"""The exact GPU route on a real GPU: coefficients read on the CPU, libjpeg's integer arithmetic in
torch kernels on CUDA (``coefficients-cuda``, a ``cuda`` decoder's default).

Per accepted corpus JPEG: the kernels on CUDA equal the same kernels on the CPU and Pillow, bit for
bit, and refuse the same files for the same reasons; per accepted file and preset, the default
``cuda`` decoder gives the CPU decoder's pixels exactly (its refusals to Pillow counted with their
reasons); the pool bounds concurrent callers. Skipped as a whole without CUDA; the CPU proof of
the same kernels is ``tests/test_jpeg_coefficients.py``, the routing ``tests/test_gpu_route_fake.py``.
"""

from __future__ import annotations

import contextlib
import io
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from gpu_common import CORPUS, LARGE_CLEAN_JPEG, CorpusFile, accepted_files
from PIL import Image

from kimi_vision_prep import ImageDecoder, Preset, get_preset
from kimi_vision_prep.decode import jpeg_bands
from kimi_vision_prep.decode.coefficients import REFUSALS
from kimi_vision_prep.decode.jpeg_kernels import decode_jpeg

if not torch.cuda.is_available():
    pytest.skip("no CUDA device (run tests/gpu/run_device_checks.sh on a GPU machine)", allow_module_level=True)

pytestmark = pytest.mark.gpu

PRESETS = [get_preset("kimi-k2.5"), get_preset("kimi-k3")]
ACCEPTED = accepted_files(CORPUS)
JPEGS = [f for f in ACCEPTED if f.is_jpeg]
CPU_DECODER = ImageDecoder("cpu")


def by_name(files: list[CorpusFile]) -> list[object]:
    return [pytest.param(f, id=f.name) for f in files]


@pytest.fixture(scope="module")
def device() -> str:
    return f"cuda:{torch.cuda.current_device()}"


def test_the_libjpeg_extension_is_built_for_this_python() -> None:
    """Without it every file goes to Pillow (counted, but the route would not be measured)."""
    assert jpeg_bands.libjpeg_path() is not None, jpeg_bands.unavailable_reason()


@pytest.mark.parametrize("item", by_name(JPEGS))
def test_kernels_on_cuda_equal_the_kernels_on_the_cpu_and_pillow(
    item: CorpusFile, device: str, record_property: pytest.RecordProperty
) -> None:
    data = (CORPUS / item.name).read_bytes()
    on_cuda, cuda_reason = decode_jpeg(data, device)
    on_cpu, cpu_reason = decode_jpeg(data, "cpu")

    record_property("refused", cuda_reason or "")
    assert cuda_reason == cpu_reason
    if cuda_reason is not None:
        assert cuda_reason in REFUSALS and on_cuda is None
        return
    assert on_cuda.device == torch.device(device) and on_cuda.dtype == torch.uint8
    assert torch.equal(on_cuda.cpu(), on_cpu)
    with Image.open(io.BytesIO(data)) as image:
        np.testing.assert_array_equal(on_cuda.cpu().numpy(), np.asarray(image))  # Pillow's mode: L, RGB, CMYK


@pytest.mark.parametrize("preset", [pytest.param(p, id=p.name) for p in PRESETS])
@pytest.mark.parametrize("item", by_name(ACCEPTED))
def test_the_default_cuda_decoder_gives_the_cpu_decoders_pixels(
    item: CorpusFile, preset: Preset, device: str, record_property: pytest.RecordProperty
) -> None:
    data = (CORPUS / item.name).read_bytes()
    decoder = ImageDecoder(device)
    on_gpu = decoder.decode(data, preset)
    reference = CPU_DECODER.decode(data, preset)

    record_property("decode_path", on_gpu.decode_path)
    record_property("fallback_reason", on_gpu.fallback_reason or "")
    assert on_gpu.decode_path in ("coefficients-cuda", "pillow")
    assert on_gpu.fallback_reason is None or on_gpu.fallback_reason in REFUSALS
    if isinstance(reference.pixels, Image.Image):  # a source mode only Pillow resizes: on the host
        assert (on_gpu.pixels.mode, on_gpu.pixels.tobytes()) == (reference.pixels.mode, reference.pixels.tobytes())
        return
    assert isinstance(on_gpu.pixels, torch.Tensor) and on_gpu.pixels.device == torch.device(device)
    np.testing.assert_array_equal(on_gpu.pixels.cpu().numpy(), reference.pixels)
    assert decoder.stats.snapshot()["paths"] == {on_gpu.decode_path: 1}


def test_concurrent_callers_stay_within_the_pool_and_get_the_same_pixels(
    device: str, record_property: pytest.RecordProperty
) -> None:
    """The exact route holds a pool slot per image being read and run: counted from the route's side
    (every borrow it makes), at most ``pool_size`` at once however many callers."""
    decoder = ImageDecoder(device, pool_size=2)
    items = [(CORPUS / f.name).read_bytes() for f in JPEGS]
    lock, holding = threading.Lock(), {"now": 0, "peak": 0, "borrows": 0}
    borrow = decoder.pool.borrow

    @contextlib.contextmanager
    def counted_borrow() -> Iterator[object]:
        with borrow() as slot:
            with lock:
                holding["now"] += 1
                holding["borrows"] += 1
                holding["peak"] = max(holding["peak"], holding["now"])
            try:
                yield slot
            finally:
                with lock:
                    holding["now"] -= 1

    decoder.pool.borrow = counted_borrow  # type: ignore[method-assign]  # the instance the route is given

    def decode_all() -> list[object]:
        results = decoder.decode_batch(items, PRESETS[0])
        torch.cuda.current_stream().synchronize()
        return [r.pixels for r in results]

    expected = decode_all()
    exact = decoder.stats.snapshot()["paths"].get("coefficients-cuda", 0)
    with ThreadPoolExecutor(max_workers=4) as workers:
        rounds = [workers.submit(decode_all) for _ in range(4)]
        for r in rounds:
            for a, b in zip(r.result(), expected, strict=True):
                assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a.tobytes() == b.tobytes()

    record_property("peak_slots_held", holding["peak"])
    assert exact > 0 and holding["borrows"] >= 5 * exact  # every exact decode went through the pool
    assert 1 <= holding["peak"] <= 2 and holding["now"] == 0
    assert decoder.pool.discarded == 0


def test_a_decode_holds_device_memory_only_while_it_runs(device: str) -> None:
    """The kernels' temporaries are freed with the decode: what stays allocated is the pixels."""
    data = (CORPUS / LARGE_CLEAN_JPEG).read_bytes()
    decoder = ImageDecoder(device, pool_size=1)
    decoder.decode(data, PRESETS[0])  # warm
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    decoded = decoder.decode(data, PRESETS[0])
    torch.cuda.synchronize(device)
    assert decoded.decode_path == "coefficients-cuda"
    assert torch.cuda.memory_allocated(device) - before <= decoded.pixels.numel() + (1 << 20)
