"""vLLM plugin: vLLM's Kimi-K2.5 / K2.6 / K3 image processing answered by this project's processor,
in the vLLM process (the library) or by a server (the client's remote processor).

Installed with either (both depend on this package) as the ``vllm.general_plugins`` entry point
``kimi_vision_prep``, which vLLM loads in each of its processes (API server, engine core, workers;
``VLLM_PLUGINS`` filters them). :func:`register` does three things, all only where vLLM's Kimi files
are where this module knows them and this vLLM is one it runs on (below; elsewhere one warning and
vLLM's own processing, never a crash):

1. **The processor.** vLLM's Kimi models build their image processor with
   ``cached_get_image_processor(..., processor_cls_overrides=KimiK25FusedVisionProcessor)``; that
   function is wrapped (where vLLM defines it and in the Kimi model modules already imported) so
   that this one call builds the class the setting names instead. Other models' calls go through
   unchanged.
2. **Encoded JPEGs reach it encoded.** Once such a processor has been built in a process (that
   process serves a Kimi model), a JPEG that would be handed over decoded is handed over opened
   only, as vLLM's ``MediaWithBytes`` (the image Pillow opened, the file's bytes): in the chat
   path (``ImageMediaIO.load_bytes``: bytes, ``data:`` URLs, files), and for an opened PIL image in
   a request's ``multi_modal_data`` (the parser), so that neither the loader, the parser nor the
   processor cache's hasher (which keys a ``MediaWithBytes`` by its bytes) decodes it first. A JPEG
   of mode RGB or L is deferred (vLLM converts L to RGB, as the processor does); where vLLM's path
   turns it to its EXIF orientation it is handed over as a :class:`~kimi_vision_common.orientation.TurnedJpeg` (the
   turned size; the processor turns the decoded pixels). Any other image takes vLLM's path
   unchanged, and the processor uses the pixels vLLM loaded.
3. **A fault of the server stays one.** vLLM wraps whatever a processor raises in a ``ValueError``
   of its own words (``InputProcessingContext.call_hf_processor``), which its API server answers
   400; ours raise a fault of the server's state as vLLM's ``RetryableRequestError`` and a verdict
   on an image as a ``ValueError`` naming the library's class and reason (:mod:`.calls`), and
   that wrapper is wrapped so it passes both as they are: 503 (retry) and 400 with our words.

``KIMI_PREP_VLLM``, the one setting the plugin reads: ``local`` (default) processes in the vLLM
process (``kimi_vision_prep.vllm_processor.VllmKimiProcessor``: the library); ``off`` leaves vLLM as
it is; a server's gRPC address (``host:port`` or ``grpc://host:port``; several replicas as
``grpc://h1:8001,h2:8001`` or one ``dns:///name:8001``; options as a query:
``grpc://host:8001?deadline_s=30&fallback=local``, :func:`.setting.remote_settings`) sends the pixels to the
served models (``kimi_vision_client.processors.vllm_processor.VllmRemoteKimiProcessor``: the client).
:data:`.setting.PROCESSORS` maps the values to the class built.

Where it runs (:mod:`.checks`): only on the vLLM versions it was proven on
(:data:`~.checks.PROVEN_VLLM`; elsewhere one warning and vLLM's own processing, unless the
setting's :data:`~kimi_vision_common.remote_setting.PLUGIN_OPTIONS` ``unproven_vllm=yes`` opts in:
``local?unproven_vllm=yes``), where
vLLM's media classes behave as it assumes (checked at register; else one warning and vLLM's own),
never with vLLM's Rust frontend (``VLLM_USE_RUST_FRONTEND``: it processes the API server's inputs
itself; one warning that the plugin is inactive), and only for a checkpoint whose ``config.json``
names a Kimi model type (``checks.MODEL_PRESETS``): another model asking vLLM for the same
class keeps vLLM's. Where vLLM charges a request's decoded bytes (vLLM 0.33's
``VLLM_MAX_MEDIA_REQUEST_DECODE_BYTES``), a deferred JPEG is charged from its header exactly as
vLLM's loader charges it before decoding, so a request over the budget is refused as stock refuses it.

The package, one module a job: :mod:`.setting` (the setting, the class each mode builds),
:mod:`.checks` (where it runs), :mod:`.choice` (1), :mod:`.jpegs` (2), :mod:`.server_faults` (3),
:mod:`.calls` (vLLM's calls of the classes it has vLLM build, for the library's and the client's).
No other common module imports it.

This package imports neither numba nor vLLM's Kimi files: vLLM's CPU workers load the plugins before
they scan every loaded module for Triton kernels to replace, a scan that fails on llvmlite's
function wrappers (numba's), so the processor's module loads only where vLLM builds a processor.
"""

from __future__ import annotations

import logging
import os

from .checks import (
    RUST_FRONTEND,
    behaviour_differences,
    installed_vllm_version,
    is_proven,
    proven_range,
    rust_frontend_set,
)
from .choice import build_ours_for_kimi
from .jpegs import defer_encoded_jpegs
from .server_faults import pass_server_faults
from .setting import MODES, PROCESSORS, SETTING, Setting, parse_setting

log = logging.getLogger("kimi_vision_prep.vllm")


def register() -> None:
    """vLLM's ``vllm.general_plugins`` entry point (every vLLM process calls it once)."""
    try:
        setting = parse_setting(os.environ.get(SETTING, MODES[0]))
    except ValueError as exc:
        log.warning("kimi-vision-prep: %s=%r: %s; vLLM's own Kimi processor is used", SETTING, os.environ[SETTING], exc)
        return
    if PROCESSORS[setting.mode] is None:
        return
    if rust_frontend_set():
        log.warning(
            "kimi-vision-prep: %s is set: vLLM's Rust frontend processes the requests' images itself, "
            "the plugin is inactive (vLLM's own Kimi processing)",
            RUST_FRONTEND,
        )
        return
    try:
        refusal = why_not_here(setting)
        if refusal is None:
            build_ours_for_kimi(setting.mode)
            defer_encoded_jpegs()
            pass_server_faults()
    except (ImportError, AttributeError) as exc:
        refusal = f"this vLLM's Kimi files are not where the plugin knows them ({type(exc).__name__}: {exc})"
    if refusal is not None:
        log.warning("kimi-vision-prep: %s; vLLM's own Kimi processor is used", refusal)


def why_not_here(setting: Setting) -> str | None:
    """Why the plugin does not run in this vLLM (a version outside the proven ones, not opted in;
    media classes that behave otherwise), or None."""
    version = installed_vllm_version()
    if not is_proven(version):
        if not setting.unproven_vllm:
            return (
                f"vLLM {version} is not one the plugin was proven on ({proven_range()}; "
                f"the option unproven_vllm=yes of {SETTING} runs it anyway)"
            )
        log.info("kimi-vision-prep: vLLM %s, outside %s, by the setting's unproven_vllm=yes", version, proven_range())
    differences = behaviour_differences()
    if differences:
        return "this vLLM behaves otherwise than the plugin relies on: " + "; ".join(differences)
    return None
