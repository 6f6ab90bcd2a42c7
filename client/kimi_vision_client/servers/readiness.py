"""Whether a server answers and serves a model, and why not: a fault of its state or a missing model.

A server that does not answer (refused, unreachable, past the call's deadline) or whose model is
loading or reloading is a :class:`~kimi_vision_common.errors.ServerUnavailableError` (asked again
later); one that answers without the model in its repository is
:class:`~kimi_vision_common.errors.ModelNotServedError`, naming the flag that serves it.
"""

from __future__ import annotations

from typing import Any

from kimi_vision_common.errors import (
    ModelNotServedError,
    ModelRestartingError,
    PreprocessError,
    ServerUnavailableError,
)
from kimi_vision_common.models import default_model_names, is_project_model

from ..transport.deadline import Deadline
from ..transport.server_errors import connection_failure, error_from_server
from .replicas import Replicas


def require_model(adapter: Any, replicas: Replicas, url: str, name: str, deadline: Deadline) -> None:
    """Return when a server of ``replicas`` (at ``url``) is live and its model ``name`` ready, each
    call within ``deadline`` (and the adapter's per-call bound), else raise why."""
    where = f"{url} ({adapter.protocol})"
    if not server_live(adapter, replicas, where, deadline):
        raise ServerUnavailableError(f"the server at {where} is not live yet; retry")
    try:
        ready = adapter.is_model_ready(replicas.primary.client, name, deadline.timeout(adapter.timeout_s))
    except PreprocessError:
        raise
    except Exception as exc:  # an unknown model is an error on some transports, False on others
        error = error_from_server(exc)
        if isinstance(error, ServerUnavailableError):
            raise error from None
        ready = False
    if not ready:
        raise_not_ready(adapter, replicas.primary.client, url, name, deadline)


def server_live(adapter: Any, replicas: Replicas, where: str, deadline: Deadline) -> bool:
    """Whether the first replica that answers is live (the ones that do not are passed over); the
    last one's failure, in words, where none answers (``where``: its address and protocol)."""
    for attempt in range(replicas.count):
        try:
            return bool(adapter.is_server_live(replicas.primary.client, deadline.timeout(adapter.timeout_s)))
        except PreprocessError:
            raise
        except Exception as exc:  # refused / unreachable / timed out, whatever the transport calls it
            if attempt + 1 < replicas.count:
                replicas.failed(replicas.primary)  # ask the next replica
                continue
            error = error_from_server(exc)
            raise type(error)(
                f"cannot connect to {where}: {connection_failure(exc)}; is the server running? start one with "
                "`kimi-prep serve`"
            ) from None
    return False


def raise_not_ready(adapter: Any, client: Any, url: str, name: str, deadline: Deadline) -> None:
    """Why a live server's ``name`` is not ready: a model its repository has but is loading or
    reloading (its config answers, or Triton says it has no version loaded now) is
    :class:`ModelRestartingError`; one it does not have, :class:`ModelNotServedError`."""
    try:
        adapter.model_config(client, name, deadline.timeout(adapter.timeout_s))
    except PreprocessError:
        raise
    except Exception as exc:  # the server's answer about the model, whatever its transport calls it
        error = error_from_server(exc)
        if isinstance(error, ServerUnavailableError):
            raise error from None
    else:
        raise ModelRestartingError(f"{name!r} at {url} is loading or reloading; retry")
    if not is_project_model(name):
        raise ModelNotServedError(
            f"the server at {url} does not serve {name!r}, and no kimi-prep repository has a model of that name: "
            f"check --model (the default image models: {', '.join(default_model_names())})"
        )
    raise ModelNotServedError(
        f"the server at {url} does not serve {name!r}: start it with `kimi-prep serve --models {name}` "
        "(or `--all` for every model)"
    )
