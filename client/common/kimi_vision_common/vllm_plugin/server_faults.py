"""The third patch of vLLM: a fault of the server stays one. vLLM wraps whatever a processor raises
in a ``ValueError`` of its own words (a 400); what ours raised (marked :data:`OURS`, :mod:`.calls`)
passes that wrapper as it is (:func:`pass_server_faults`).
"""

from __future__ import annotations

from typing import Any

# The attribute that marks an error our processors raised for vLLM (:mod:`.calls`), passed through
# vLLM's wrapper of processor errors (:func:`pass_server_faults`).
OURS = "raised_by_kimi_vision_prep"


def pass_server_faults() -> None:
    """Wrap vLLM's ``InputProcessingContext.call_hf_processor`` (which turns any error into a
    ``ValueError`` of its own words, a 400) so that what one of ours raised (marked
    :data:`OURS`) passes as it is: a ``RetryableRequestError`` for a fault of the
    server's state (vLLM answers 503), a ``VLLMServerError`` for anything else not the request's
    (500), the ``ValueError`` naming the library's class and reason for a verdict (400). Any other
    processor's errors are wrapped as before."""
    from vllm.multimodal.processing.context import InputProcessingContext

    call_hf_processor = InputProcessingContext.call_hf_processor

    def passing_ours(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return call_hf_processor(self, *args, **kwargs)
        except ValueError as exc:
            raised = exc.__cause__
            if getattr(raised, OURS, False):
                raise raised from raised.__cause__  # type: ignore[misc]
            raise

    InputProcessingContext.call_hf_processor = passing_ours
