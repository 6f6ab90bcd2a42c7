"""SGLang with ``SGLANG_EXTERNAL_MM_PROCESSOR_PACKAGE=kimi_vision_common.sglang_processors``: its Kimi
K2.5 and K3 processing built by its own ``TokenizerManager``, answered by ours (the library in
process, ``KIMI_PREP_SGLANG=local``; a real ``kimi-prep serve``, the setting a gRPC address), equal
to SGLang's stock CPU path on every corpus file: ``input_ids``, offsets, ``image_grid_thw`` and
``pixel_values`` (dtype included), and the same error on every file stock refuses. With SGLang made
to believe CUDA is there (stock then takes its GPU call, or K3's deferred GPU path), ours stays
equal to stock's CPU path.

Runs in the SGLang environment (``make test``: ``.venv-sglang``); elsewhere skipped.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang.srt", reason="SGLang is not installed in this environment")

import numpy as np

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent
sys.path[:0] = [str(HERE), str(TESTS)]
import checkpoints  # noqa: E402
import sglang_side  # noqa: E402
from make_inputs import free_loopback_port, kimi_prep_serve  # noqa: E402
from test_stock_sglang import FILES as SAMPLE  # noqa: E402  a JPEG, greyscale, CMYK, LA, palette tRNS, RGBA WebP

PACKAGE = "kimi_vision_common.sglang_processors"
CORPUS = TESTS / "data" / "corpus"
FILES = sorted(path.name for path in CORPUS.iterdir() if path.is_file())
SETUPS = {
    "k25": ("kimi-k2.5", {}),
    "k3": ("kimi-k3", {}),
    "k3-nocache": ("kimi-k3", {"mm_preprocess_cache_size_mb": 0}),
}
SERVED = ("kimi_k25_vision_u8", "kimi_k3_vision_u8")
COMPARED = ("input_ids", "offsets", "image_grid_thw")


def with_setting(value: str | None) -> Any:
    """The package imported anew under ``KIMI_PREP_SGLANG=value`` and named to SGLang (None: not
    named; SGLang's own)."""
    if value is None:
        os.environ.pop("SGLANG_EXTERNAL_MM_PROCESSOR_PACKAGE", None)
        return None
    os.environ["SGLANG_EXTERNAL_MM_PROCESSOR_PACKAGE"] = PACKAGE
    os.environ["KIMI_PREP_SGLANG"] = value
    package = importlib.reload(importlib.import_module(PACKAGE))
    importlib.reload(importlib.import_module(f"{PACKAGE}.kimi"))
    return package


def build_all(dirs: dict[str, Path], setting: str | None) -> dict[str, sglang_side.StockSGLang]:
    with_setting(setting)
    built = {name: sglang_side.build_processor(dirs[preset], preset, **args) for name, (preset, args) in SETUPS.items()}
    with_setting(None)
    return built


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, int]]:
    """A real ``kimi-prep serve`` of :data:`SERVED`: the setting that names it, its HTTP port."""
    venv = Path(os.environ.get("KIMI_SERVING_VENV", TESTS.parent / ".venv"))
    serve = venv / "bin" / "kimi-prep"
    assert serve.exists(), f"no {serve}: make setup (or set KIMI_SERVING_VENV) serves the remote side"
    serving = ("--models", *SERVED, "--instances", "1", "--threads", "1", "--response-cache-mib", "0")
    with kimi_prep_serve([str(serve)], *serving) as (http, grpc):  # no cache: each request counted
        yield f"grpc://127.0.0.1:{grpc}?deadline_s=120", http


@pytest.fixture(scope="module")
def forms(tmp_path_factory: pytest.TempPathFactory, server: tuple) -> dict[str, dict[str, sglang_side.StockSGLang]]:
    dirs = checkpoints.write_checkpoints(tmp_path_factory.mktemp("sglang_checkpoints"))
    return {"stock": build_all(dirs, None), "local": build_all(dirs, "local"), "remote": build_all(dirs, server[0])}


def served_images(http_port: int) -> int:
    """Requests the server's models have answered so far (Triton's statistics)."""
    import json
    import urllib.request

    total = 0
    for model in SERVED:
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v2/models/{model}/stats", timeout=30) as answer:
            total += sum(stats["inference_count"] for stats in json.load(answer)["model_stats"])
    return total


def counted_library_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A counter of the library processor's pixel calls (its class's, so every copy SGLang's threads
    make counts)."""
    from kimi_vision_prep.processor import KimiVisionProcessor

    calls = [0]
    original = KimiVisionProcessor._pixels

    def counting(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(KimiVisionProcessor, "_pixels", counting)
    return calls


def outcome(processor: sglang_side.StockSGLang, datas: list[bytes]) -> dict[str, Any] | BaseException:
    try:
        return sglang_side.run(processor, None, datas)
    except Exception as exc:  # the verdict under test
        return exc


def assert_same(ours: dict[str, Any] | BaseException, stock: dict[str, Any] | BaseException, what: str) -> None:
    if isinstance(stock, BaseException):  # SGLang's loader refused it: the same error for ours
        assert type(ours) is type(stock), (what, ours, stock)
        return
    assert not isinstance(ours, BaseException), (what, ours)
    for key in COMPARED:
        assert np.array_equal(np.asarray(ours[key]), np.asarray(stock[key])), (what, key)
    assert ours["pixel_values"].dtype == stock["pixel_values"].dtype == np.float32, what
    assert np.array_equal(ours["pixel_values"], stock["pixel_values"]), what
    assert ours["image_grid_thw"].dtype == stock["image_grid_thw"].dtype, what


def test_ours_is_built_where_named(forms: dict) -> None:
    """The processors SGLang built are ours where the package is named, SGLang's elsewhere."""
    assert {type(p.mm_processor).__module__ for p in forms["stock"].values()} == {
        "sglang.srt.multimodal.processors.kimi_k25",
        "sglang.srt.multimodal.processors.kimi_k3",
    }
    for form in ("local", "remote"):
        assert {type(p.mm_processor).__module__ for p in forms[form].values()} == {f"{PACKAGE}.kimi"}
    assert type(forms["remote"]["k25"].mm_processor._processor._hf_processor.media_processor).__name__ == (
        "RemoteKimiProcessor"
    )


@pytest.mark.parametrize("setup", SETUPS)
def test_every_corpus_file_equals_stock(
    forms: dict, server: tuple, monkeypatch: pytest.MonkeyPatch, setup: str
) -> None:
    """Every corpus file, one a request: ours (in process and remote) equals SGLang's stock CPU path,
    or both refuse it with the same error (SGLang's loader, before any processor). Ours did the
    work: the library was called, and the server answered, at least once for each accepted file
    (the checkpoint's code is the tests' reference, which ours equals: equality alone would not
    show whose pixels these are)."""
    library_calls = counted_library_calls(monkeypatch)
    served_before = served_images(server[1])
    refused = 0
    for name in FILES:
        data = (CORPUS / name).read_bytes()
        stock = outcome(forms["stock"][setup], [data])
        refused += isinstance(stock, BaseException)
        for form in ("local", "remote"):
            assert_same(outcome(forms[form][setup], [data]), stock, f"{form} {setup} {name}")
    assert 0 < refused < len(FILES)
    assert library_calls[0] >= len(FILES) - refused
    assert served_images(server[1]) - served_before >= len(FILES) - refused


@pytest.mark.parametrize("setup", SETUPS)
def test_several_images_in_one_request_equal_stock(forms: dict, setup: str) -> None:
    datas = [(CORPUS / name).read_bytes() for name in SAMPLE]
    stock = outcome(forms["stock"][setup], datas)
    for form in ("local", "remote"):
        assert_same(outcome(forms[form][setup], datas), stock, f"{form} {setup}")


@pytest.mark.parametrize("setup", SETUPS)
def test_believing_in_cuda_ours_stays_equal_to_stocks_cpu_path(forms: dict, setup: str) -> None:
    """SGLang made to believe CUDA is there: stock would take its GPU call (K2.5) or defer to the
    model's GPU pass (K3); ours takes neither and equals stock's CPU path."""
    datas = [(CORPUS / name).read_bytes() for name in SAMPLE]
    stock = outcome(forms["stock"][setup], datas)
    for form in ("local", "remote"):
        with sglang_side.believe_cuda():
            ours = outcome(forms[form][setup], datas)
        assert not isinstance(ours, BaseException) and ours["deferred"] == [False] * len(datas), ours
        assert_same(ours, stock, f"{form} {setup}")


def test_a_server_fault_is_not_the_requests(tmp_path: Path) -> None:
    """A server that cannot be reached: SGLang's API server answers 503 (an HTTPException), never
    the 400 of a bad image."""
    from fastapi import HTTPException

    dirs = checkpoints.write_checkpoints(tmp_path)
    nobody = f"grpc://127.0.0.1:{free_loopback_port()}?deadline_s=2"
    processor = build_all({"kimi-k2.5": dirs["kimi-k2.5"], "kimi-k3": dirs["kimi-k3"]}, nobody)["k25"]
    with pytest.raises(HTTPException) as caught:
        sglang_side.run(processor, None, [(CORPUS / "pil__hopper.jpg").read_bytes()])
    from kimi_vision_common import errors

    assert caught.value.status_code == 503
    assert issubclass(getattr(errors, caught.value.detail.split(":")[0]), errors.ServerUnavailableError)


def test_an_unproven_sglang_gets_one_warning_and_its_own(monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    package = importlib.import_module(PACKAGE)
    monkeypatch.setattr(package, "PROVEN_SGLANG", ())
    monkeypatch.setenv("KIMI_PREP_SGLANG", "local")
    with caplog.at_level(logging.WARNING, logger="kimi_vision_prep.sglang"):
        assert package.active_choice() is None
    assert [r.getMessage() for r in caplog.records if "not one these processors were proven on" in r.getMessage()]


def test_a_missing_dependency_is_an_import_error_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the setting asks for a server and the client is not installed, importing the package
    fails naming it (SGLang skips a failing module of the package with a warning only)."""
    package = importlib.import_module(PACKAGE)
    monkeypatch.setitem(sys.modules, "kimi_vision_client.remote_processor", None)
    monkeypatch.setenv("KIMI_PREP_SGLANG", "grpc://127.0.0.1:8001")
    with pytest.raises(ImportError, match=r"needs kimi_vision_client\.remote_processor"):
        package.active_choice()


def test_the_sglang_here_is_the_proven_one() -> None:
    """The Makefile's pin (tests/test_doc_facts.py ties it to PROVEN_SGLANG) is what runs here."""
    package = importlib.import_module(PACKAGE)
    assert package.sglang_version() in package.PROVEN_SGLANG


@pytest.mark.parametrize("setup", ("k25", "k3"))
def test_a_jpeg_reaches_ours_undecoded_and_anything_else_as_sglang_loads_it(forms: dict, setup: str) -> None:
    """SGLang's loader, as ours runs it: an RGB JPEG (a ``data:`` URL) opened, not decoded, under
    SGLang's own Kimi identity (the file's digest); a greyscale JPEG loaded as SGLang loads it for
    K2.5 (converted to RGB) and opened only for K3 (which keeps its mode); a PNG loaded as stock."""
    from sglang.srt.managers.schedule_batch import Modality
    from sglang.srt.multimodal.processors.kimi_common import unwrap_kimi_images
    from sglang.srt.utils import ImageData

    def loaded(form: str, name: str) -> Any:
        cls = type(forms[form][setup].mm_processor)
        item = cls._load_single_item(
            ImageData(url=sglang_side.data_url((CORPUS / name).read_bytes())),
            Modality.IMAGE,
            None,
            None,
            setup == "k25",
        )
        (image,) = unwrap_kimi_images([item])
        return item, image

    for form in ("local", "remote"):
        item, image = loaded(form, "pil__hopper.jpg")
        stock_item, stock_image = loaded("stock", "pil__hopper.jpg")
        assert image._im is None and stock_image._im is not None
        assert item.content_digest == stock_item.content_digest
        _, grey = loaded(form, "pil__hopper_gray.jpg")
        assert (grey._im is None) == (setup == "k3")
        _, png = loaded(form, "pilx__uncompressed_la.png")
        assert png._im is not None
