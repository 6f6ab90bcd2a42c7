"""How vLLM builds and calls a Kimi image processor, for the classes the vLLM plugin has it build.

:class:`VllmCalls` goes before a :class:`~kimi_vision_common.processor_api.ProcessorInterface` subclass (the
library's in-process one, the client's remote one): ``from_pretrained(model, revision=...,
trust_remote_code=...)`` with the preset of the checkpoint's ``model_type``, and a bad image raised
as the ``ValueError`` vLLM answers with HTTP 400 (the typed error chained as its cause, its class
named in the message); a fault of the server's state (a server that cannot be reached, a stub
restarting, busy decoders: :class:`~kimi_vision_common.errors.ServerUnavailableError`) as vLLM's
``RetryableRequestError``, answered 503; anything else as ``VLLMServerError`` (500): neither is the
request's fault. Building one tells the plugin that this process serves a Kimi model.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ..errors import PreprocessError, ServerUnavailableError
from ..faults import is_verdict
from ..processor_api import HUB_OPTIONS
from .checks import model_preset
from .jpegs import KimiProcessingState
from .server_faults import OURS

# Faults of the server's state: vLLM's RetryableRequestError (503), never its 400.
NOT_THE_REQUESTS = (ServerUnavailableError,)


class VllmCalls:
    """vLLM's calls of a Kimi processor (a mixin: ``class X(VllmCalls, SomeProcessor)``)."""

    @classmethod
    def from_pretrained(cls, name: str | Path, **kwargs: Any) -> Any:
        hub = {key: kwargs[key] for key in (*HUB_OPTIONS, "revision") if key in kwargs}
        kwargs.setdefault("preset", model_preset(name, hub))
        processor = super().from_pretrained(name, **kwargs)  # type: ignore[misc]
        KimiProcessingState.defer_jpegs = True
        return processor

    def preprocess(self, medias: Any, *args: Any, **kwargs: Any) -> Any:
        return as_value_error(super().preprocess, medias, *args, **kwargs)  # type: ignore[misc]

    def media_tokens_calculator(self, media: Mapping[str, Any]) -> int:
        return as_value_error(super().media_tokens_calculator, media)  # type: ignore[misc]

    def get_resize_config(self, media: Mapping[str, Any]) -> dict[str, int]:
        return as_value_error(super().get_resize_config, media)  # type: ignore[misc]


def as_value_error(call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``call(*args, **kwargs)``, what it raises as vLLM answers it: a verdict on the input as
    ``ValueError`` (HTTP 400), a fault of the server's state (:data:`NOT_THE_REQUESTS`) as vLLM's
    ``RetryableRequestError`` (503: the request was fine, retry it), anything else of ours (a bug, a
    model not served, a deployment that does not fit) as vLLM's ``VLLMServerError`` (500); a
    ``ValueError`` or ``TypeError`` of the call's arguments as it is (vLLM's 400)."""
    try:
        return call(*args, **kwargs)
    except PreprocessError as exc:
        raise vllm_error(exc) from exc
    except (ValueError, TypeError):
        raise
    except Exception as exc:  # a bug, an out-of-memory: the server's, not the request's
        raise vllm_error(exc) from exc


def vllm_error(exc: Exception) -> Exception:
    """The error vLLM answers for ``exc`` as :func:`as_value_error` says, its class and reason
    named and marked as ours (:data:`~.server_faults.OURS`); ``exc`` itself for a server error where this vLLM has
    no such classes."""
    if isinstance(exc, PreprocessError) and is_verdict(exc):
        error: Exception = ValueError(f"{type(exc).__name__}: {exc}")
    else:
        try:
            from vllm.exceptions import RetryableRequestError, VLLMServerError
        except ImportError:
            return exc
        server_error = RetryableRequestError if isinstance(exc, NOT_THE_REQUESTS) else VLLMServerError
        error = server_error(f"{type(exc).__name__}: {exc}")
    setattr(error, OURS, True)
    return error
