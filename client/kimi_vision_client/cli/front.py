"""``kimi-prep``: infer against a server, benchmark it, write perf_analyzer data; with the server
package installed also preprocess in-process, render the model repository, serve, and run a demo
(:data:`COMMANDS_GROUP`).

``preprocess`` and ``infer`` take images and videos (told apart by content): a video gives one
line and one npz entry per chunk, with a progress bar per chunk; ``infer --images-per-request K``
sends K images in one request.

Every subcommand that processes images prints one summary line per image on stdout, one error line
per bad image on stderr, writes the good results (optionally) to an ``.npz`` with the processor's
layout, and exits non-zero when any image failed.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points
from pathlib import Path

import numpy as np

from kimi_vision_common.errors import ModelNotServedError, PreprocessError, ServerUnavailableError
from kimi_vision_common.media import looks_like_video
from kimi_vision_common.wire import (
    DEFAULT_GRPC_PORT,
    DEFAULT_HTTP_PORT,
    DEFAULT_MAX_IMAGES_PER_REQUEST,
    IMAGE_BYTES,
    operator_key,
)

from ..client import KimiVisionClient, VisionResult
from ..request.media import require_grpc, sibling_model
from ..servers.replicas import BALANCES
from .arguments import (
    DefaultsHelpFormatter,
    add_server_arguments,
    command,
    images_per_request,
    positive_int,
    positive_int_list,
)
from .outcomes import (
    EXIT_OK,
    EXIT_SOME_FAILED,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    Outcome,
    chunk_outcomes,
    expand_paths,
    print_outcome,
    read_inputs,
    report,
)

# Other packages add subcommands here: ``kimi-vision-server`` adds serve, preprocess, render-repository,
# bench-local and demo (each entry point: ``add(subparsers)``).
COMMANDS_GROUP = "kimi_prep.commands"


# -- shared by preprocess / infer / demo ------------------------------------------------------


# -- subcommands --------------------------------------------------------------------------------


def run_ends(exc: PreprocessError) -> int:
    """Say why nothing can be sent; exit 3 when the server or a model it needs is not there, else 2."""
    print(f"kimi-prep: {exc}", file=sys.stderr)
    return EXIT_UNAVAILABLE if isinstance(exc, (ServerUnavailableError, ModelNotServedError)) else EXIT_USAGE


def cmd_infer(args: argparse.Namespace) -> int:
    """Send images to a running server, ``--concurrency`` requests in flight."""
    from tqdm import tqdm

    inputs = read_inputs(expand_paths(args.images))
    readable = [(outcome, data) for outcome, data in inputs if data is not None]
    is_video = [looks_like_video(data) for _, data in readable]
    videos = [item for item, video in zip(readable, is_video, strict=True) if video]
    to_send = [item for item, video in zip(readable, is_video, strict=True) if not video]
    for outcome, data in inputs:
        if data is None:
            print_outcome(outcome)
    outcomes = [outcome for outcome, data in inputs if data is None]
    admin_key = operator_key(args.admin_key_file) if args.shm else None
    with KimiVisionClient(
        args.url, args.protocol, args.model, args.shm, admin_key=admin_key, balance=args.balance
    ) as client:
        try:
            if to_send:
                client.require_model()
        except PreprocessError as exc:
            return run_ends(exc)
        if videos:
            try:
                require_grpc(args.protocol)
                client.require_model(sibling_model(args.model, "video"))
            except PreprocessError as exc:
                if not to_send:  # nothing else to send: the run ends here
                    return run_ends(exc)
                for outcome, _ in videos:  # each video is reported, the images still go
                    outcome.error = exc
                    print_outcome(outcome)
                outcomes += [outcome for outcome, _ in videos]
                videos = []
        for outcome, data in videos:
            outcomes += chunk_outcomes(outcome.name, lambda d=data: client.preprocess_video(d), args.quiet)
        if args.images_per_request > 1:
            outcomes += infer_groups(client, to_send, args.images_per_request)
            return report(outcomes, args.out)
        with tqdm(
            total=len(to_send), file=sys.stderr, unit="img", disable=args.quiet or not sys.stderr.isatty()
        ) as progress:

            def on_result(index: int, result: VisionResult | PreprocessError) -> None:
                outcome = to_send[index][0]
                outcome.result, outcome.error = (None, result) if isinstance(result, Exception) else (result, None)
                print_outcome(outcome, tqdm.write)
                progress.update()

            client.infer_many((data for _, data in to_send), concurrency=args.concurrency, on_result=on_result)
    return report([*outcomes, *(outcome for outcome, _ in to_send)], args.out)


def infer_groups(client: KimiVisionClient, to_send: list[tuple[Outcome, bytes]], size: int) -> list[Outcome]:
    """Images in requests of ``size`` (``client.preprocess_images``): each image's result cut out of
    its request's. A request fails as a whole (one verdict, naming its first bad image): that
    image gets the error, and the others are sent again without it."""
    for start in range(0, len(to_send), size):
        infer_group(client, to_send[start : start + size])
    return [outcome for outcome, _ in to_send]


def infer_group(client: KimiVisionClient, group: list[tuple[Outcome, bytes]]) -> None:
    while group:
        try:
            result = client.preprocess_images([data for _, data in group])
        except PreprocessError as exc:
            bad = failed_index(str(exc), len(group))
            if bad is None:  # the request as a whole: every image gets its error
                for outcome, _ in group:
                    outcome.error = exc
                    print_outcome(outcome)
                return
            outcome = group[bad][0]
            outcome.error = type(exc)(str(exc).split(": ", 1)[1])
            print_outcome(outcome)
            group = group[:bad] + group[bad + 1 :]
            continue
        counts = [int(np.prod(grid)) for grid in result.grid_thws]
        parts = np.split(result.pixel_values, np.cumsum(counts)[:-1])
        for (outcome, _), pixels, grid, tokens in zip(group, parts, result.grid_thws, result.num_tokens, strict=True):
            outcome.result = VisionResult(pixels, grid, int(tokens))
            print_outcome(outcome)
        return


def failed_index(message: str, count: int) -> int | None:
    """``i`` of a K-image request's ``"image i: ..."`` error, if ``i`` is one of its ``count``."""
    head, _, rest = message.partition(": ")
    kind, _, index = head.partition(" ")
    return int(index) if kind == "image" and index.isdigit() and int(index) < count and rest else None


def cmd_bench(args: argparse.Namespace) -> int:
    """Concurrency sweep against a running server (``bench_server``)."""
    from . import bench_server

    admin_key = operator_key(args.admin_key_file) if args.shm else None
    config = bench_server.BenchConfig(
        args.url, args.protocol, args.model, args.shm, args.concurrency_levels, args.duration, args.requests, admin_key
    )
    with KimiVisionClient(args.url, args.protocol, args.model) as client:
        try:
            client.require_model()
        except PreprocessError as exc:
            print(f"kimi-prep: {exc}", file=sys.stderr)
            return EXIT_UNAVAILABLE
    images = [(str(path), path.read_bytes()) for path in expand_paths(args.images)] if args.images else None
    result = bench_server.run(config, images, args.out_dir, args.quiet)
    return EXIT_SOME_FAILED if any(level["errors"] for level in result["levels"]) else EXIT_OK


def perf_input_data(images: Sequence[bytes], name: str = IMAGE_BYTES) -> dict[str, object]:
    """perf_analyzer ``--input-data`` JSON: one single-image request per image. A BYTES tensor's
    ``b64`` content is the 4-byte little-endian length of each element, then its bytes."""
    import base64
    import struct

    return {
        "data": [
            {name: {"content": {"b64": base64.b64encode(struct.pack("<I", len(data)) + data).decode()}, "shape": [1]}}
            for data in images
        ]
    }


def cmd_perf_data(args: argparse.Namespace) -> int:
    """Write perf_analyzer ``--input-data`` JSON for the given images."""
    import json

    inputs = [(outcome, data) for outcome, data in read_inputs(expand_paths(args.images)) if data is not None]
    args.out.write_text(json.dumps(perf_input_data([data for _, data in inputs])))
    print(f"{len(inputs)} single-image requests in {args.out} (perf_analyzer --input-data {args.out})")
    return EXIT_OK


# -- the parser -------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kimi-prep", description="Bit-exact Kimi vision preprocessing.", formatter_class=DefaultsHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)

    add_infer(sub)
    add_bench(sub)
    add_perf_data(sub)
    for plugin in entry_points(group=COMMANDS_GROUP):
        plugin.load()(sub)
    return parser


def add_infer(sub: argparse._SubParsersAction) -> None:
    """``kimi-prep infer``."""
    inf = command(sub, "infer", help="preprocess images on a running server")
    add_server_arguments(inf)
    inf.add_argument(
        "--balance",
        choices=BALANCES,
        default=BALANCES[0],
        help="with several servers in --url (h1:p1,h2:p2 or dns:///name:port, gRPC): round_robin spreads the "
        "requests; rendezvous sends an image's repeats to the same server (its response cache)",
    )
    inf.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    inf.add_argument(
        "--out", type=Path, help="write pixel_values, grid_thws, num_tokens, names to this .npz (default: none written)"
    )
    inf.add_argument(
        "--images-per-request",
        type=images_per_request,
        default=1,
        metavar="K",
        help=f"images in one request (at most {DEFAULT_MAX_IMAGES_PER_REQUEST}, the served models' limit)",
    )
    inf.add_argument("--quiet", action="store_true", help="no progress bar")
    inf.add_argument("images", nargs="+", type=Path, metavar="IMAGE|VIDEO|DIR")
    inf.set_defaults(run=cmd_infer)


def add_bench(sub: argparse._SubParsersAction) -> None:
    """``kimi-prep bench``."""
    bench = command(sub, "bench", help="throughput and latency of a running server over a concurrency sweep")
    add_server_arguments(bench)
    bench.add_argument(
        "--concurrency",
        dest="concurrency_levels",
        type=positive_int_list,
        default=[1, 2, 4, 8],
        metavar="N[,N...]",
        help="requests in flight per level, comma-separated (default: 1,2,4,8)",
    )
    amount = bench.add_mutually_exclusive_group()
    amount.add_argument("--duration", type=float, default=10.0, metavar="S", help="seconds per level")
    amount.add_argument(
        "--requests",
        type=positive_int,
        default=None,
        metavar="N",
        help="requests per level (default: --duration decides)",
    )
    bench.add_argument(
        "--images",
        nargs="+",
        type=Path,
        metavar="FILE|DIR",
        help="the photos to send (default: bench-local's generated photos)",
    )
    bench.add_argument("--out-dir", type=Path, default=Path("bench_results"), help="bench_server.json and .png")
    bench.add_argument("--quiet", action="store_true", help="no progress bar")
    bench.set_defaults(run=cmd_bench)


def add_perf_data(sub: argparse._SubParsersAction) -> None:
    """``kimi-prep perf-data``."""
    perf = command(sub, "perf-data", help="write perf_analyzer --input-data JSON for images")
    perf.add_argument("-o", "--out", type=Path, required=True, help="the JSON file to write")
    perf.add_argument("images", nargs="+", type=Path, metavar="IMAGE|DIR")
    perf.set_defaults(run=cmd_perf_data)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # `kimi-prep serve [options] -- <tritonserver args>`: the rest goes to tritonserver, last.
    passthrough = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = build_parser().parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if passthrough and args.command != "serve":
        print("kimi-prep: only serve passes arguments after -- (to tritonserver)", file=sys.stderr)
        return EXIT_USAGE
    args.tritonserver_args = passthrough
    if args.command in ("infer", "bench") and args.url is None:
        args.url = f"localhost:{DEFAULT_GRPC_PORT if args.protocol == 'grpc' else DEFAULT_HTTP_PORT}"
    if getattr(args, "concurrency", 1) < 1:
        print("kimi-prep: --concurrency must be >= 1", file=sys.stderr)
        return EXIT_USAGE
    return args.run(args)
