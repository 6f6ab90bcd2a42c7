"""``kimi-prep``, the command line: its parser and subcommands (:mod:`.front`; the entry point
``kimi_vision_client.cli:main`` and ``python -m kimi_vision_client.cli``), each input's line, the
npz and the exit code (:mod:`.outcomes`), ``kimi-prep bench`` (:mod:`.bench_server`) and the
generated images (:mod:`.samples`). It sits on top: it may import the client's front and every
folder below it; nothing else in the client imports it.
"""

from .front import build_parser, main

__all__ = ["build_parser", "main"]
