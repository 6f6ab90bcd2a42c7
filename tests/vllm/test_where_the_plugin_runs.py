"""Where the vLLM plugin changes vLLM and where it keeps out, each in a fresh vLLM process with the
plugin installed (the plugin changes vLLM's modules for a process's life): the proven versions and
the opt-in, a vLLM whose media classes keep their names but behave otherwise (simulated by
changing them before the plugin registers), a model that is not Kimi asking for vLLM's Kimi class,
vLLM's Rust frontend, and vLLM 0.33's decode budget against stock's verdict."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from checkpoints import vllm_environment, write_checkpoint

from kimi_vision_common.vllm_plugin.checks import proven_range

CORPUS = Path(__file__).resolve().parents[1] / "data" / "corpus"
NOT_PROVEN = "is not one the plugin was proven on"
BEHAVES_OTHERWISE = "behaves otherwise than the plugin relies on"
INACTIVE = "the plugin is inactive"


def run_vllm(code: str, setting: str | None = None, **extra: str) -> str:
    """``code`` run in a fresh vLLM process (the plugin's setting as given, ``extra`` added to its
    environment); its standard output and error."""
    env = {**vllm_environment(setting), **extra}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout + done.stderr


# The plugin registered as vLLM registers it, after `{change}`; whether vLLM's builder is the plugin's.
REGISTERS = """
{change}
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm.transformers_utils import processor
wrapper = processor.cached_get_image_processor.__wrapped__
print("wrapped:", wrapper.__module__ == "kimi_vision_common.vllm_plugin.choice")
"""
ANOTHER_VERSION = "import vllm; vllm.__version__ = '0.99.0'"


def test_a_vllm_outside_the_proven_versions_keeps_its_own_processor_with_one_warning() -> None:
    out = run_vllm(REGISTERS.format(change=ANOTHER_VERSION))
    assert "wrapped: False" in out
    assert out.count(NOT_PROVEN) == 1 and f"vLLM 0.99.0 {NOT_PROVEN} ({proven_range()};" in out


def test_the_setting_opts_in_to_a_vllm_outside_the_proven_versions() -> None:
    out = run_vllm(REGISTERS.format(change=ANOTHER_VERSION), "local?unproven_vllm=yes")
    assert "wrapped: True" in out and NOT_PROVEN not in out


def test_a_proven_vllm_gets_the_plugin_without_a_word() -> None:
    out = run_vllm(REGISTERS.format(change=""))
    assert "wrapped: True" in out and "kimi-vision-prep" not in out


# Changes that keep every name the plugin uses but not what it relies on.
CHANGED_VLLMS = {
    "MediaWithBytes of another signature": """
import dataclasses
from typing import Any
from vllm.multimodal.media import base
@dataclasses.dataclass
class MediaWithBytes:
    original_bytes: bytes
    media: Any
    io_config: Any = None
base.MediaWithBytes = MediaWithBytes
""",
    "a parser that no longer turns images": """
from vllm.multimodal import parse
parse.normalize_image = lambda image: image
""",
    "a loader of lazily decoded media": """
import io
from vllm.multimodal.image import open_image
from vllm.multimodal.media.base import MediaWithBytes
from vllm.multimodal.media.image import ImageMediaIO
ImageMediaIO.load_bytes = lambda self, data: MediaWithBytes(open_image(io.BytesIO(data)), data)
""",
    "a loader that charges its decode budget otherwise": """
from vllm.multimodal.media.image import ImageMediaIO
load_bytes = ImageMediaIO.load_bytes
def charging_more(self, data):
    if self.decoded_budget is not None:
        self.decoded_budget.charge(1)
    return load_bytes(self, data)
ImageMediaIO.load_bytes = charging_more
""",
}
WHAT_DIFFERS = {
    "MediaWithBytes of another signature": "MediaWithBytes has the fields ('original_bytes', 'media', 'io_config')",
    "a parser that no longer turns images": "the parser does not turn an image to its EXIF orientation",
    "a loader of lazily decoded media": "ImageMediaIO.load_bytes does not return a decoded RGB image",
    "a loader that charges its decode budget otherwise": "ImageMediaIO.load_bytes charges its decode budget 9 bytes",
}


def has_decode_budget() -> bool:
    from vllm.multimodal.media import base

    return hasattr(base, "MediaDecodedBudget")


@pytest.mark.parametrize("change", CHANGED_VLLMS)
def test_a_vllm_whose_media_classes_behave_otherwise_keeps_its_own_processor(change: str) -> None:
    """Its names kept, its behaviour changed: one warning naming what differs, vLLM's own processing
    (the opt-in to unproven versions does not lift it)."""
    if "budget" in change and not has_decode_budget():
        pytest.skip("this vLLM charges no decode budget")
    out = run_vllm(REGISTERS.format(change=CHANGED_VLLMS[change]), "local?unproven_vllm=yes")
    assert "wrapped: False" in out
    assert out.count(BEHAVES_OTHERWISE) == 1 and WHAT_DIFFERS[change] in out


BUILDS = """
import json, os
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm.multimodal.media.image import ImageMediaIO
from vllm.transformers_utils.processor import cached_get_image_processor
from vllm.transformers_utils.processors.kimi_k25_vision_fused import KimiK25FusedVisionProcessor
built = cached_get_image_processor(os.environ["CHECKPOINT"], processor_cls_overrides=KimiK25FusedVisionProcessor)
media = ImageMediaIO().load_bytes(open(os.environ["PHOTO"], "rb").read())
print(json.dumps({"built": type(built).__name__, "decoded": media.media._im is not None}))
"""


def test_a_model_that_is_not_kimi_keeps_vllms_processor_for_the_kimi_class(tmp_path: Path) -> None:
    """A checkpoint of another model type (the Kimi preprocessor config beside it) asking vLLM for
    its Kimi class gets vLLM's class, and the process's loader keeps decoding JPEGs as vLLM's does;
    the same checkpoint as ``kimi_k25`` gets ours."""
    other = write_checkpoint(tmp_path / "other", "kimi-k2.5")
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "model_type": "deepseek_vl_v2"}))
    kimi = write_checkpoint(tmp_path / "kimi", "kimi-k2.5")
    photo = str(CORPUS / "sklearn__china.jpg")
    found = {}
    for name, checkpoint in (("other", other), ("kimi", kimi)):
        out = run_vllm(BUILDS, CHECKPOINT=str(checkpoint), PHOTO=photo)
        found[name] = json.loads(next(line for line in out.splitlines() if line.startswith('{"built"')))
    assert found["other"] == {"built": "KimiK25FusedVisionProcessor", "decoded": True}
    assert found["kimi"] == {"built": "VllmKimiProcessor", "decoded": False}


def test_vllms_rust_frontend_gets_one_warning_that_the_plugin_is_inactive() -> None:
    out = run_vllm(REGISTERS.format(change=""), VLLM_USE_RUST_FRONTEND="1")
    assert "wrapped: False" in out
    assert out.count(INACTIVE) == 1 and "VLLM_USE_RUST_FRONTEND is set" in out


# A chat of the photos PHOTOS (JSON) through vLLM's renderer under each budget of BUDGETS (JSON); the
# verdict of each as JSON.
BUDGET_VERDICTS = """
import base64, json, os, sys
sys.path.insert(0, os.environ["HERE"])
from vllm_side import renderer
from vllm.renderers.params import ChatParams
render = renderer(os.environ["CHECKPOINT"], True, os.environ["CORPUS"])
files = [open(path, "rb").read() for path in json.loads(os.environ["PHOTOS"])]
urls = ["data:image/jpeg;base64," + base64.b64encode(data).decode() for data in files]
content = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
messages = [{"role": "user", "content": [*content, {"type": "text", "text": "describe this"}]}]
verdicts = {}
for budget in json.loads(os.environ["BUDGETS"]):
    os.environ["VLLM_MAX_MEDIA_REQUEST_DECODE_BYTES"] = str(budget)
    try:
        render.render_chat([messages], ChatParams())
        verdicts[budget] = "accepted"
    except Exception as exc:
        verdicts[budget] = f"{type(exc).__name__}: {exc}"
print("verdicts:", json.dumps(verdicts))
"""


def test_a_request_over_vllms_decode_budget_is_refused_as_stock_refuses_it(tmp_path: Path) -> None:
    """vLLM 0.33 charges a chat's images ``width * height * 4`` each against
    ``VLLM_MAX_MEDIA_REQUEST_DECODE_BYTES`` before decoding them; ours hands the JPEGs over
    undecoded but charges them the same: under a budget one byte short of the two photos, ours
    refuses the request with stock's error, and at the budget both accept it."""
    from PIL import Image

    if not has_decode_budget():
        pytest.skip("this vLLM charges no decode budget")
    photos = [str(CORPUS / "sklearn__china.jpg"), str(CORPUS / "pil__hopper.jpg")]
    cost = 0
    for photo in photos:
        with Image.open(photo) as image:
            cost += image.width * image.height * 4
    checkpoint = str(write_checkpoint(tmp_path / "k25", "kimi-k2.5"))
    inputs = {"HERE": str(Path(__file__).parent), "CHECKPOINT": checkpoint, "CORPUS": str(CORPUS)}
    inputs |= {"PHOTOS": json.dumps(photos), "BUDGETS": json.dumps([cost - 1, cost])}
    verdicts = {}
    for side, setting in (("stock", "off"), ("ours", None)):
        out = run_vllm(BUDGET_VERDICTS, setting, **inputs)
        line = next(line for line in out.splitlines() if line.startswith("verdicts:"))
        verdicts[side] = json.loads(line.split(" ", 1)[1])
    assert verdicts["ours"] == verdicts["stock"]
    assert verdicts["stock"][str(cost)] == "accepted"
    assert verdicts["stock"][str(cost - 1)].startswith("ValueError: Request decoded media exceeds")
