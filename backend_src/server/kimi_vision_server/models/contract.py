"""The execute contract every served model keeps, and the one adapter around ``pb_utils``.

Contract of ``execute``: one response per request, in order; a request that fails gets a
``TritonError`` whose code is the error's ``triton_code`` and whose message is
:func:`~kimi_vision_common.errors.served_message` (the class tag first, so clients raise the same
type), never affecting the other requests of the batch; a cancelled request gets CANCELLED;
nothing is raised out of ``execute``.

Requested outputs (``request.requested_output_names()``, checked on tritonserver 2.51): a client
that names no outputs gets, and the model sees as requested, every output of the config; an
ensemble step requests exactly the keys of its ``output_map`` (whatever the ensemble's client
asked for); outputs a model returns beyond the requested ones are dropped by the backend.
"""

from __future__ import annotations

import faulthandler
import signal
import time
import traceback
import uuid
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from kimi_vision_common.errors import (
    CancelledError,
    InvalidRequestError,
    PreprocessError,
    detached,
    reason_for,
    triton_code_for,
)
from kimi_vision_common.wire import served_message
from kimi_vision_prep.buffers import configure_buffers, scratch_scope

from .config import buffer_caps, model_config_from_args, model_parameters
from .metrics import ModelMetrics
from .requests import Outputs
from .tensors import input_array, output_tensor, synchronize_cuda

Result = Outputs | BaseException  # one request's outputs, or why it failed


class TritonIO:
    """The few ``pb_utils`` calls the models make, in one place (a fake replaces it in unit tests)."""

    def __init__(self, pb_utils: Any) -> None:
        self.pb = pb_utils

    def get_input(self, request: Any, name: str) -> Any:
        tensor = self.pb.get_input_tensor_by_name(request, name)
        if tensor is None:
            raise InvalidRequestError(f"missing input {name}")
        return input_array(tensor)

    def get_optional_input(self, request: Any, name: str) -> Any:
        """The input ``name`` (``optional: true`` in the config), or None when the request has none."""
        tensor = self.pb.get_input_tensor_by_name(request, name)
        return None if tensor is None else input_array(tensor)

    @staticmethod
    def requested_outputs(request: Any) -> frozenset[str] | None:
        """The output names the request asked for (``requested_output_names()``); None when the
        request cannot say (:meth:`ServingModel.requested_outputs` reads that as the config's).
        Triton fills in every output when a client names none."""
        getter = getattr(request, "requested_output_names", None)
        names = getter() if callable(getter) else None
        return frozenset(names) if names else None

    @staticmethod
    def is_cancelled(request: Any) -> bool:
        check = getattr(request, "is_cancelled", None)
        return bool(check()) if check is not None else False

    def response(self, outputs: Mapping[str, Any]) -> Any:
        synchronize_cuda(outputs.values())
        tensors = [output_tensor(self.pb, name, value) for name, value in outputs.items()]
        return self.pb.InferenceResponse(output_tensors=tensors)

    @staticmethod
    def request_id(request: Any) -> str:
        """The client's request id, else a generated one, so a failure can be found in the server log."""
        getter = getattr(request, "request_id", None)
        given = getter() if callable(getter) else ""
        return str(given) if given else f"gen-{uuid.uuid4().hex[:12]}"

    def error_response(self, exc: BaseException, request_id: str | None = None) -> Any:
        errors = self.pb.TritonError
        code = getattr(errors, triton_code_for(exc), errors.INTERNAL)
        message = served_message(exc)
        if request_id is not None:
            message = f"{message} (request id {request_id})"
        return self.pb.InferenceResponse(output_tensors=[], error=errors(message, code))

    def log(self, level: str, message: str) -> None:
        logger = getattr(self.pb, "Logger", None)
        if logger is not None:
            getattr(logger, f"log_{level}")(message)


class ServingModel:
    """A served model: what Triton's ``args`` say (config, parameters, names, device), its metrics
    and the execute contract. A model sets ``stage`` (the ``kimi_prep_stage_seconds_total`` label)
    and implements :meth:`handle`; what it does is built from components (``components.py``)."""

    stage = "model"

    def __init__(self, pb_utils: Any, args: Mapping[str, Any]) -> None:
        self.io = TritonIO(pb_utils)
        self.config = model_config_from_args(args)
        self.parameters = model_parameters(self.config)
        configure_buffers(**buffer_caps(self.parameters))  # one model per stub process
        self.name = str(args.get("model_name") or self.config.get("name", "model"))
        self.output_names = frozenset(output["name"] for output in self.config.get("output", ())) or None
        self.instance = str(args.get("model_instance_name") or self.name)
        gpu = str(args.get("model_instance_kind", "CPU")).upper() == "GPU"
        self.device = f"cuda:{int(args.get('model_instance_device_id', 0))}" if gpu else "cpu"
        self.metrics = ModelMetrics(pb_utils, self.name, self.instance)
        if self.metrics.error:
            self.io.log("warn", f"{self.name}: {self.metrics.error}")

    def requested_outputs(self, request: Any) -> frozenset[str] | None:
        """The outputs ``request`` asked for; when it cannot say, every output of this model's
        config, so a model offering one pixel output (kimi_*_vision_fused) never computes the
        other (None only for a config that lists no outputs)."""
        return self.io.requested_outputs(request) or self.output_names

    def handle(self, requests: Sequence[Any]) -> list[Result]:
        """One outputs dict or one exception per live request, in order."""
        raise NotImplementedError

    def failed(self, exc: BaseException) -> BaseException:
        """A request's error as a result value: without its traceback (see :func:`detached`: kept, it
        pins the request's tensors in a reference cycle), logged in full first when it is a bug."""
        if not isinstance(exc, PreprocessError):
            self.io.log("error", f"{self.name}: {''.join(traceback.format_exception(exc)).rstrip()}")
        return detached(exc)

    def attempt(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, or the exception it raised as a result value (:meth:`failed`): one
        request's error never fails the others of its batch."""
        try:
            return fn(*args)
        except Exception as exc:
            return self.failed(exc)

    def per_request(self, items: Iterable[Any], fn: Callable[[Any], Any]) -> list[Any]:
        """``fn(item)`` for each item, in order, through :meth:`attempt`; an item that already is an
        error stays that request's result."""
        return [item if isinstance(item, BaseException) else self.attempt(fn, item) for item in items]

    def execute(self, requests: Sequence[Any]) -> list[Any]:
        """One response per request, in order; never raises (the stub would fail the whole batch)."""
        try:
            return self._execute(requests)
        except Exception as exc:  # last line of defence (metrics/logging/adapter failures)
            return [self.io.error_response(exc) for _ in requests]

    def _execute(self, requests: Sequence[Any]) -> list[Any]:
        results: list[Result | None] = [None] * len(requests)
        live: list[int] = []
        for index, request in enumerate(requests):
            if self.io.is_cancelled(request):
                results[index] = CancelledError("request cancelled by the client")
            else:
                live.append(index)
        started = time.perf_counter()
        # One scratch scope per execute: the arena buffers of this thread (decoded pixels, resize
        # passes, pixel outputs) come back to the next execute, so their pages fault in once per
        # stub, not once per request. Outputs may be arena memory: the stub copies each response
        # into its shared memory when execute returns, before it calls execute again.
        with scratch_scope(), warnings.catch_warnings(record=True) as raised:
            # Pillow's warnings (and any library's) land in the log with this model and the
            # requests of the execute, not as stray lines on the stub's stderr. A stub runs one
            # execute at a time, so what its decode threads warn in the meantime is this execute's.
            warnings.simplefilter("always")
            try:
                handled = self.handle([requests[i] for i in live]) if live else []
                for index, result in zip(live, handled, strict=True):
                    results[index] = result
            except Exception as exc:  # a bug; it must not take the stub down
                message = f"{self.name}: execute failed for {len(live)} request(s): {type(exc).__name__}: {exc}"
                self.io.log("error", message)
                error = self.failed(exc)
                for index in live:
                    results[index] = error
            self.metrics.add_stage_seconds(self.stage, time.perf_counter() - started)
            self._log_warnings(raised, [requests[i] for i in live])
            return [self._respond(request, result) for request, result in zip(requests, results, strict=True)]

    def _log_warnings(self, raised: Sequence[warnings.WarningMessage], requests: Sequence[Any]) -> None:
        """Each distinct warning of an execute, once, with the model and the request ids."""
        if not raised:
            return
        ids = ", ".join(self.io.request_id(request) for request in requests)
        for text in dict.fromkeys(f"{w.category.__name__}: {w.message}" for w in raised):
            self.io.log("warn", f"{self.name}: request {ids}: {text}")

    def _respond(self, request: Any, result: Result | None) -> Any:
        if result is None:
            result = RuntimeError("no result produced")
        if not isinstance(result, BaseException):
            try:
                return self.io.response(result)
            except Exception as exc:
                result = exc
        reason = reason_for(result)
        self.metrics.count_error(reason)
        if triton_code_for(result) in ("INVALID_ARG", "CANCELLED"):  # the client's doing: not a server error
            self.io.log("verbose", f"{self.name}: request failed ({reason}): {result}")
            return self.io.error_response(result)
        # UNAVAILABLE / INTERNAL: logged with the id the client sees in its error message.
        request_id = self.io.request_id(request)
        self.io.log("error", f"{self.name}: request {request_id} failed ({reason}): {type(result).__name__}: {result}")
        return self.io.error_response(result, request_id)

    def finalize(self) -> None:
        self.metrics.close()


class StreamingModel(ServingModel):
    """A decoupled model (``model_transaction_policy { decoupled: true }``): :meth:`stream` yields
    the outputs of each response of one request; they are sent as soon as each is ready, then an
    empty response flagged ``TRITONSERVER_RESPONSE_COMPLETE_FINAL``. An error, before or after
    some responses, is sent as one error response flagged final. A cancelled request stops the
    stream (the generator is closed, so the work behind it stops) and gets CANCELLED."""

    def stream(self, request: Any) -> Iterator[Outputs]:
        raise NotImplementedError

    def execute(self, requests: Sequence[Any]) -> None:
        for request in requests:
            self._send_stream(request)

    def _send_stream(self, request: Any) -> None:
        sender = request.get_response_sender()
        final = self.io.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        started = time.perf_counter()
        error: BaseException | None = None
        try:
            chunks = self.stream(request)
            try:
                for outputs in chunks:
                    if self.io.is_cancelled(sender) or self.io.is_cancelled(request):
                        error = CancelledError("stream cancelled by the client")
                        break
                    sender.send(self.io.response(outputs))
            finally:
                chunks.close()
        except Exception as exc:
            error = self.failed(exc)
        finally:
            self.metrics.add_stage_seconds(self.stage, time.perf_counter() - started)
        try:
            if error is None:
                sender.send(flags=final)
            else:
                self.metrics.count_error(reason_for(error))
                sender.send(self._error(request, error), flags=final)
        except Exception as exc:  # the client is gone; nothing left to tell it
            self.io.log("verbose", f"{self.name}: final response not sent: {type(exc).__name__}: {exc}")

    def _error(self, request: Any, error: BaseException) -> Any:
        if triton_code_for(error) in ("INVALID_ARG", "CANCELLED"):
            self.io.log("verbose", f"{self.name}: stream failed ({reason_for(error)}): {error}")
            return self.io.error_response(error)
        request_id = self.io.request_id(request)
        self.io.log("error", f"{self.name}: stream {request_id} failed ({reason_for(error)}): {error}")
        return self.io.error_response(error, request_id)


def triton_python_model(model_class: type[ServingModel]) -> type:
    """The ``TritonPythonModel`` class a ``model.py`` exports for ``model_class`` (the Python
    backend looks the name up in the module and calls ``initialize``/``execute``/``finalize``)."""

    class TritonPythonModel:
        def initialize(self, args: dict[str, Any]) -> None:
            import triton_python_backend_utils as pb_utils  # only importable inside the stub

            # A stub that stops answering (an initialize or execute that never returns keeps a load
            # or its requests waiting, its health thread still beating) shows where it is stuck:
            # ``kill -USR1 <stub pid>`` writes every Python thread's stack to the server's log.
            faulthandler.register(signal.SIGUSR1, all_threads=True)
            self.model = model_class(pb_utils, args)

        def execute(self, requests: list[Any]) -> list[Any] | None:
            return self.model.execute(requests)

        def finalize(self) -> None:
            self.model.finalize()

    TritonPythonModel.__qualname__ = f"TritonPythonModel[{model_class.__name__}]"
    return TritonPythonModel
