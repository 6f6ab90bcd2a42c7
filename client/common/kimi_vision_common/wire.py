"""What travels between a served model and its clients: tensor names, the admin header, and the
error tags that make a remote failure raise the class it raised in process.

Triton 2.51 passes a client only a code and a message, so a served message starts with a tag
naming the class (:func:`served_message`: ``"InvalidImageError: not a decodable image ..."``) and
:func:`error_from_served` turns it back into that class. Triton's own rejections (queue full,
wrong shape, ...) carry no tag: :mod:`.faults` maps them.
"""

from __future__ import annotations

import ipaddress
import os
import re
from pathlib import Path

import numpy as np

from .errors import PreprocessError
from .faults import untagged_error

# Tensor names, each spelled here once. What clients send and get back:
IMAGE_BYTES, VIDEO_BYTES, FRAME_BYTES = "IMAGE_BYTES", "VIDEO_BYTES", "FRAME_BYTES"
PIXEL_VALUES, PIXEL_PATCHES = "PIXEL_VALUES", "PIXEL_PATCHES"
GRID_THW, NUM_TOKENS = "GRID_THW", "NUM_TOKENS"
PROMPT, TIMESTAMP, FRAME_INDICES, PATCH_EMBEDS = "PROMPT", "TIMESTAMP", "FRAME_INDICES", "PATCH_EMBEDS"
# What the decode step hands the step after it (kimi_vision_server/models/requests.py has the layout):
IMAGE, IMAGE_SHAPES, MODE, RESAMPLE = "IMAGE", "IMAGE_SHAPES", "MODE", "RESAMPLE"
STORED_SIZES, DECODE_PATH = "STORED_SIZES", "DECODE_PATH"
# What the decode step hands the preprocess step (both sides send these; a client of the preprocess
# model may leave out STORED_SIZES: its images are then at their stored size).
PREPROCESS_INPUTS = (IMAGE, IMAGE_SHAPES, MODE, RESAMPLE)
OPTIONAL_PREPROCESS_INPUT = STORED_SIZES
DECODED_TENSORS = (*PREPROCESS_INPUTS, OPTIONAL_PREPROCESS_INPUT)
TENSOR_NAMES = frozenset(
    {IMAGE_BYTES, VIDEO_BYTES, FRAME_BYTES, PIXEL_VALUES, PIXEL_PATCHES, GRID_THW, NUM_TOKENS, PROMPT, TIMESTAMP}
    | {FRAME_INDICES, PATCH_EMBEDS, IMAGE, IMAGE_SHAPES, MODE, RESAMPLE, STORED_SIZES, DECODE_PATH}
)
# NUM_TOKENS' one dtype: on the wire (TYPE_INT32), in the library's and the client's arrays, in the npz.
NUM_TOKENS_DTYPE = np.dtype(np.int32)
NUM_TOKENS_TRITON_TYPE = f"TYPE_{NUM_TOKENS_DTYPE.name.upper()}"
# Where a server listens unless told otherwise (tritonserver's own defaults), and the probes
# (`kimi-prep serve --probe-port`, `make serve`): the launcher, both CLIs and the deploy files use these.
DEFAULT_HTTP_PORT, DEFAULT_GRPC_PORT, DEFAULT_METRICS_PORT, DEFAULT_PROBE_PORT = 8000, 8001, 8002, 8003
# K of IMAGE_BYTES [1, K] the served models accept by default (their max_images_per_request).
DEFAULT_MAX_IMAGES_PER_REQUEST = 16

# The header that carries the admin key to tritonserver's restricted APIs (docs/security.md).
ADMIN_HEADER = "kimi-prep-admin-key"
# tritonserver's gRPC frontend looks for the restricted key under this prefix (HTTP: as it is).
GRPC_HEADER_PREFIX = "triton-grpc-protocol-"
# Where the operator's key comes from when no key file is named (a Kubernetes Secret in the manifest).
ADMIN_KEY_ENV = "KIMI_PREP_ADMIN_KEY"
MIN_KEY_LENGTH = 16


# How a client of several servers spreads its requests (kimi_vision_client.servers.replicas): the client's
# ``balance`` and the vLLM setting's ``balance=`` option; the first is the default.
BALANCES = ("round_robin", "rendezvous")


def is_loopback(host: str) -> bool:
    """True for a loopback address (127.0.0.0/8, ::1, bracketed or not) or ``localhost``: where
    a server opens shared memory without the key, and a client uses it by default."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def admin_headers(key: str, protocol: str = "http") -> dict[str, str]:
    """The header that carries ``key`` over ``protocol`` (``http``: :data:`ADMIN_HEADER`; ``grpc``:
    the same name behind :data:`GRPC_HEADER_PREFIX`, as tritonserver's gRPC frontend expects it)."""
    return {(GRPC_HEADER_PREFIX if protocol == "grpc" else "") + ADMIN_HEADER: key}


def checked_key(key: str, source: str) -> str:
    """``key`` stripped; ValueError where it is too short to guess or would break the flag's syntax."""
    key = key.strip()
    if len(key) < MIN_KEY_LENGTH:
        raise ValueError(f"the admin key from {source} has {len(key)} characters: use at least {MIN_KEY_LENGTH}")
    if any(c in key for c in ",:= \t\n") or not key.isprintable():
        raise ValueError(f"the admin key from {source} may not hold spaces, ',', ':' or '='")
    return key


def operator_key(key_file: Path | None, environ: dict[str, str] | os._Environ[str] = os.environ) -> str | None:
    """The operator's admin key: ``key_file``'s content, else :data:`ADMIN_KEY_ENV`; None if neither."""
    if key_file is not None:
        return checked_key(Path(key_file).read_text(), str(key_file))
    if environ.get(ADMIN_KEY_ENV):
        return checked_key(environ[ADMIN_KEY_ENV], ADMIN_KEY_ENV)
    return None


def _error_classes() -> dict[str, type[PreprocessError]]:
    """Every :class:`PreprocessError` class of :mod:`.errors` by name (derived, not listed)."""
    classes: dict[str, type[PreprocessError]] = {}
    pending: list[type[PreprocessError]] = [PreprocessError]
    while pending:
        cls = pending.pop()
        if cls.__module__ == PreprocessError.__module__:
            classes[cls.__name__] = cls
        pending.extend(cls.__subclasses__())
    return classes


ERROR_CLASSES = _error_classes()
_TAG = re.compile(r"^(?P<tag>[A-Za-z]+Error): (?P<message>.*)$", re.S)
# Triton prefixes an ensemble step's error with this.
ENSEMBLE_PREFIX = re.compile(r"^in ensemble '[^']*', ")


def served_message(exc: BaseException) -> str:
    """The message a served model returns for ``exc``: its class tag, then its text (a bug, not a
    :class:`PreprocessError`, is tagged ``PreprocessError: internal error: <type>: ...``)."""
    if isinstance(exc, PreprocessError):
        return f"{type(exc).__name__}: {exc}"
    return f"{PreprocessError.__name__}: internal error: {type(exc).__name__}: {exc}"


def error_from_served(code: str, message: str) -> PreprocessError:
    """The error a served ``message`` with Triton ``code`` (a ``triton_code`` name: INVALID_ARG,
    UNAVAILABLE, ...) stands for: the tagged class with the untagged text, else what
    :func:`.faults.untagged_error` makes of Triton's or the transport's own words."""
    message = ENSEMBLE_PREFIX.sub("", message)
    match = _TAG.match(message)
    if match and match["tag"] in ERROR_CLASSES:
        return ERROR_CLASSES[match["tag"]](match["message"])
    return untagged_error(code, message)
