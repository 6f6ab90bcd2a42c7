"""The parser's pieces, shared with the server's ``kimi-prep`` subcommands: help that shows every
default, the number types of the options, and how ``infer`` and ``bench`` reach a server."""

from __future__ import annotations

import argparse
from pathlib import Path

from kimi_vision_common.wire import DEFAULT_GRPC_PORT, DEFAULT_HTTP_PORT, DEFAULT_MAX_IMAGES_PER_REQUEST


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def images_per_request(text: str) -> int:
    """``--images-per-request``: 1 to the served models' ``max_images_per_request``."""
    value = positive_int(text)
    if value > DEFAULT_MAX_IMAGES_PER_REQUEST:
        raise argparse.ArgumentTypeError(
            f"at most {DEFAULT_MAX_IMAGES_PER_REQUEST} images per request (the served models' "
            f"max_images_per_request), got {value}: a folder of more is sent in several requests anyway"
        )
    return value


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Help that shows every option's default once: ``(default: X)`` appended to the help of an
    option that has one, unless its help already says it in words (``default: ...``). Flags and
    options whose absence is described in their help (``--out``: nothing written) show none."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS, []) or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


def command(sub: argparse._SubParsersAction, name: str, **kwargs: object) -> argparse.ArgumentParser:
    """A subcommand's parser, its help showing every default."""
    return sub.add_parser(name, formatter_class=DefaultsHelpFormatter, **kwargs)


def positive_int_list(text: str) -> list[int]:
    """``1,2,4,8`` -> ``[1, 2, 4, 8]``; every value must be >= 1."""
    return [positive_int(part) for part in text.split(",")]


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """``--url``, ``--protocol``, ``--model``, ``--shm``: how ``infer`` and ``bench`` reach a server."""
    parser.add_argument(
        "--url",
        default=None,
        help=f"host:port (default: localhost:{DEFAULT_GRPC_PORT} for grpc, :{DEFAULT_HTTP_PORT} for http); "
        "infer over grpc: also several, h1:p1,h2:p2, or dns:///name:port",
    )
    parser.add_argument("--protocol", choices=("http", "grpc"), default="grpc", help="how to reach the server")
    parser.add_argument("--model", default="kimi_k25_vision", help="the image model to send to")
    parser.add_argument("--shm", action="store_true", help="exchange tensors through system shared memory")
    parser.add_argument(
        "--admin-key-file",
        type=Path,
        default=None,
        help="with --shm against a server listening beyond loopback: its admin key (default: $KIMI_PREP_ADMIN_KEY)",
    )


def non_negative_int(text: str) -> int:
    return 0 if text.strip() == "0" else positive_int(text)
