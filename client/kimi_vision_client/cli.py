"""``kimi-prep``: preprocess in-process, render the model repository, serve, infer against a server,
benchmark, or run a demo.

``preprocess`` and ``infer`` take images and videos (told apart by content): a video gives one
line and one npz entry per chunk, with a progress bar per chunk; ``infer --images-per-request K``
sends K images in one request.

Every subcommand that processes images prints one summary line per image on stdout, one error line
per bad image on stderr, writes the good results (optionally) to an ``.npz`` with the processor's
layout, and exits non-zero when any image failed.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
from PIL import Image

from kimi_vision_prep import (
    PRESETS,
    PreprocessError,
    PreprocessResult,
    VideoChunkResult,
    concat_results,
    looks_like_video,
    preprocess_bytes,
    preprocess_video,
)
from kimi_vision_prep.serving.repository import RenderOptions, model_presets

from .client import KimiVisionClient, VisionResult

EXIT_OK, EXIT_SOME_FAILED, EXIT_USAGE, EXIT_UNAVAILABLE = 0, 1, 2, 3


class ImageOutput(Protocol):
    """What both :class:`PreprocessResult` and ``VisionResult`` provide."""

    pixel_values: np.ndarray
    grid_thw: np.ndarray
    num_tokens: int


@dataclass
class Outcome:
    """One input file and what became of it: a result or the error it raised."""

    name: str
    result: ImageOutput | None = None
    error: Exception | None = None


# -- shared by preprocess / infer / demo ------------------------------------------------------


VIDEO_SUFFIXES = frozenset({".mp4", ".mkv", ".webm", ".mov", ".avi", ".m4v"})


def image_suffixes() -> frozenset[str]:
    """File suffixes Pillow knows (``.jpg``, ``.png``, ...) and video containers': what a directory
    expands to."""
    Image.init()
    return frozenset(Image.registered_extensions()) | VIDEO_SUFFIXES


def expand_paths(paths: Sequence[Path]) -> list[Path]:
    """Files as given, directories replaced by their image files (recursive, sorted)."""
    suffixes = image_suffixes()
    expanded: list[Path] = []
    for path in paths:
        if path.is_dir():
            expanded.extend(sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in suffixes))
        else:
            expanded.append(path)
    return expanded


def grid_text(grid_thw: np.ndarray) -> str:
    return "x".join(str(int(v)) for v in grid_thw)


def summary_line(name: str, result: ImageOutput) -> str:
    """``name: [WxH -> new WxH, ]grid 1xHxW, T tokens, N patches[, decode path]``."""
    parts = []
    if isinstance(result, PreprocessResult):
        parts.append(f"{result.width}x{result.height} -> {result.target.new_width}x{result.target.new_height}")
    if isinstance(result, VideoChunkResult):
        parts.append(f"at {result.timestamp}, frames {','.join(map(str, result.frame_indices))}")
    parts += [f"grid {grid_text(result.grid_thw)}", f"{result.num_tokens} tokens"]
    parts.append(f"{len(result.pixel_values)} patches")
    if isinstance(result, PreprocessResult):
        parts.append(result.decode_path + (f" (fallback: {result.fallback_reason})" if result.fallback_reason else ""))
    return f"{name}: " + ", ".join(parts)


def error_line(name: str, error: Exception) -> str:
    return f"{name}: error: {type(error).__name__}: {error}"


def write_npz(path: Path, outcomes: Sequence[Outcome], patch_size: int = 14) -> None:
    """Save the good results as the processor returns them.

    ``pixel_values`` float32 ``(ΣN, 3, p, p)``, ``grid_thws`` int64 ``(n, 3)``, ``num_tokens``
    int64 ``(n,)``, ``names`` str ``(n,)``; failed images are left out.
    """
    good = [o for o in outcomes if o.result is not None]
    results = [o.result for o in good if o.result is not None]
    pixel_values, grid_thws = concat_results(results, patch_size)
    np.savez(
        path,
        pixel_values=pixel_values,
        grid_thws=grid_thws,
        num_tokens=np.array([r.num_tokens for r in results], dtype=np.int64),
        names=np.array([o.name for o in good], dtype=np.str_),
    )


def report(outcomes: Sequence[Outcome], out: Path | None) -> int:
    """Write the npz (if asked), print an error count, and return the exit code."""
    if out is not None:
        write_npz(out, outcomes)
    failed = sum(o.error is not None for o in outcomes)
    if failed:
        print(f"{failed} of {len(outcomes)} images failed", file=sys.stderr)
    return EXIT_SOME_FAILED if failed else EXIT_OK


def read_inputs(paths: Sequence[Path]) -> list[tuple[Outcome, bytes | None]]:
    """Each path's bytes, or an outcome already carrying the read error."""
    inputs: list[tuple[Outcome, bytes | None]] = []
    for path in paths:
        try:
            inputs.append((Outcome(str(path)), path.read_bytes()))
        except OSError as exc:
            inputs.append((Outcome(str(path), error=exc), None))
    return inputs


def print_outcome(outcome: Outcome, write_line: Callable[..., object] = print) -> None:
    """Summary on stdout or error on stderr; ``write_line`` is ``print`` or ``tqdm.write``."""
    if outcome.result is not None:
        write_line(summary_line(outcome.name, outcome.result), file=sys.stdout)
    elif outcome.error is not None:
        write_line(error_line(outcome.name, outcome.error), file=sys.stderr)


def outcome_of(name: str, result: VisionResult | PreprocessError) -> Outcome:
    return Outcome(name, error=result) if isinstance(result, Exception) else Outcome(name, result=result)


# -- subcommands --------------------------------------------------------------------------------


def chunk_outcomes(name: str, chunks: Callable[[], Iterable[VideoChunkResult]], quiet: bool) -> list[Outcome]:
    """One outcome per chunk of a video (``name [chunk i]``), printed as each arrives, under a
    progress bar; an error ends the video with one error outcome."""
    from tqdm import tqdm

    outcomes = []
    with tqdm(desc=name, file=sys.stderr, unit="chunk", disable=quiet or not sys.stderr.isatty()) as progress:
        try:
            for index, chunk in enumerate(chunks()):
                outcome = Outcome(f"{name} [chunk {index}]", result=chunk)
                print_outcome(outcome, tqdm.write)
                outcomes.append(outcome)
                progress.update()
        except PreprocessError as exc:
            outcome = Outcome(name, error=exc)
            print_outcome(outcome, tqdm.write)
            outcomes.append(outcome)
    return outcomes


def cmd_preprocess(args: argparse.Namespace) -> int:
    """In-process, exactly the library calls the Triton models make."""
    outcomes = []
    for outcome, data in read_inputs(expand_paths(args.images)):
        if data is not None and looks_like_video(data):
            outcomes += chunk_outcomes(outcome.name, lambda d=data: preprocess_video(d, args.preset), args.quiet)
            continue
        if data is not None:
            try:
                outcome.result = preprocess_bytes(data, args.preset)
            except PreprocessError as exc:
                outcome.error = exc
        print_outcome(outcome)
        outcomes.append(outcome)
    return report(outcomes, args.out)


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
    from kimi_vision_prep.serving.access import operator_key

    admin_key = operator_key(args.admin_key_file) if args.shm else None
    with KimiVisionClient(args.url, args.protocol, args.model, args.shm, admin_key=admin_key) as client:
        if not client.is_ready():
            print(f"kimi-prep: no ready model {args.model!r} at {args.url} ({args.protocol})", file=sys.stderr)
            return EXIT_UNAVAILABLE
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
    its request's; a failed request's error (naming the image) for each of its images."""
    for start in range(0, len(to_send), size):
        group = to_send[start : start + size]
        try:
            result = client.preprocess_images([data for _, data in group])
        except PreprocessError as exc:
            for outcome, _ in group:
                outcome.error = exc
                print_outcome(outcome)
            continue
        counts = [int(np.prod(grid)) for grid in result.grid_thws]
        parts = np.split(result.pixel_values, np.cumsum(counts)[:-1])
        for (outcome, _), pixels, grid, tokens in zip(group, parts, result.grid_thws, result.num_tokens, strict=True):
            outcome.result = VisionResult(pixels, grid, int(tokens))
            print_outcome(outcome)
    return [outcome for outcome, _ in to_send]


def render_options(args: argparse.Namespace) -> RenderOptions | None:
    """``--instances`` / ``--threads`` / ``--kind`` as :class:`RenderOptions` (None: none given)."""
    given = {key: getattr(args, key) for key in ("instances", "threads", "kind") if getattr(args, key) is not None}
    return RenderOptions(**given) if given else None


def cmd_render_repository(args: argparse.Namespace) -> int:
    """Write the model repository rendered from the presets."""
    from kimi_vision_prep.serving.repository import render_repository

    out = render_repository(args.out, render_options(args) or RenderOptions())
    print(f"rendered {len(list(out.glob('*/config.pbtxt')))} models into {out}")
    return EXIT_OK


def served_models(args: argparse.Namespace, options: RenderOptions | None) -> tuple[str, ...] | None:
    """The models ``serve`` renders with ``options``: the default set (the image ensembles and their
    steps), ``--all`` or ``--models``, narrowed by ``--preset``; None when a repository is given as is."""
    from kimi_vision_prep.serving.repository import default_model_names, repository_models, select_models

    if args.model_repository is not None:
        if args.all or args.models or args.preset:
            raise ValueError("--all/--models/--preset select from the rendered repository: drop --model-repository")
        return None
    names = None if args.all else (args.models or default_model_names())
    rendered = repository_models(options or RenderOptions())
    return tuple(model.name for model in select_models(rendered, names, args.preset))


def serve_options(args: argparse.Namespace) -> RenderOptions | None:
    """The rendering ``serve`` uses: the host's layout (:func:`~kimi_vision_prep.host.host_layout`,
    printed in one line), each of ``--instances`` / ``--threads`` / ``--kind`` overriding its part;
    None when a repository is served as it is."""
    from kimi_vision_prep.host import host_layout

    if args.model_repository is not None:
        return render_options(args)
    layout = host_layout()
    options = RenderOptions(
        instances=layout.instances if args.instances is None else args.instances,
        threads=layout.threads if args.threads is None else args.threads,
        kind=args.kind or layout.kind,  # type: ignore[arg-type]
    )
    print(f"kimi-prep: {layout.describe()}; serving {options} (flags override)", file=sys.stderr)
    return options


def cmd_serve(args: argparse.Namespace) -> int:
    from kimi_vision_prep.serving.access import operator_key
    from kimi_vision_prep.serving.launcher import LaunchSpec, Ports, serve

    ports = Ports(args.http_port, args.grpc_port, args.metrics_port, args.probe_port)
    try:
        options = serve_options(args)
        models = served_models(args, options)
        key = operator_key(args.admin_key_file)
        spec = LaunchSpec(
            ports, args.model_repository, options, models, args.tritonserver_args,
            host=args.host, admin_key=key, open_apis=tuple(args.open_api),
        )  # fmt: skip
    except (ValueError, OSError) as exc:
        print(f"kimi-prep serve: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return serve(spec)


def cmd_bench(args: argparse.Namespace) -> int:
    """Concurrency sweep against a running server (``bench_server``)."""
    from . import bench_server

    config = bench_server.BenchConfig(
        args.url, args.protocol, args.model, args.shm, args.concurrency_levels, args.duration, args.requests
    )
    with KimiVisionClient(args.url, args.protocol, args.model) as client:
        if not client.is_ready():
            print(f"kimi-prep: no ready model {args.model!r} at {args.url} ({args.protocol})", file=sys.stderr)
            return EXIT_UNAVAILABLE
    images = [(str(path), path.read_bytes()) for path in expand_paths(args.images)] if args.images else None
    result = bench_server.run(config, images, args.out_dir, args.quiet)
    return EXIT_SOME_FAILED if any(level["errors"] for level in result["levels"]) else EXIT_OK


def perf_input_data(images: Sequence[bytes], name: str = "IMAGE_BYTES") -> dict[str, object]:
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


def cmd_bench_local(args: argparse.Namespace) -> int:
    """In-process side-by-side timings (``bench_local``)."""
    from . import bench_local

    allocator = bench_local.apply_allocator(args.keep_large_buffers)
    print(f"allocator: {allocator}")
    sources = [(str(path), path.read_bytes()) for path in expand_paths(args.images)] if args.images else None
    bench_local.run(args.preset, args.repeats, args.out_dir, allocator, sources)
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    """Start the embedded server, send the sample images over HTTP and gRPC, compare, stop."""
    from kimi_vision_prep.serving.launcher import EmbeddedServer

    from .samples import sample_images

    samples = sample_images()
    failed = 0
    print(f"starting tritonserver with {', '.join(samples)} ...", file=sys.stderr)
    with EmbeddedServer(models=(args.model,)) as server:  # rendered: works without a checkout
        for protocol, url in (("http", server.http_url), ("grpc", server.grpc_url)):
            with KimiVisionClient(url, protocol, args.model) as client:
                results = client.infer_many(samples.values(), concurrency=len(samples))
                preset = client.preset
            for (name, data), result in zip(samples.items(), results, strict=True):
                outcome = outcome_of(f"[{protocol}] {name}", result)
                if outcome.result is not None:
                    reference = preprocess_bytes(data, preset)
                    if not np.array_equal(outcome.result.pixel_values, reference.pixel_values):
                        outcome.result, outcome.error = None, AssertionError("pixel_values differ from in-process")
                failed += outcome.error is not None
                print_outcome(outcome)
    print("all results bit-equal to in-process preprocessing" if not failed else f"{failed} failed", file=sys.stderr)
    return EXIT_SOME_FAILED if failed else EXIT_OK


# -- argument parsing ---------------------------------------------------------------------------


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def positive_int_list(text: str) -> list[int]:
    """``1,2,4,8`` -> ``[1, 2, 4, 8]``; every value must be >= 1."""
    return [positive_int(part) for part in text.split(",")]


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """``--url``, ``--protocol``, ``--model``, ``--shm``: how ``infer`` and ``bench`` reach a server."""
    parser.add_argument("--url", default=None, help="host:port (default localhost:8001 for grpc, :8000 for http)")
    parser.add_argument("--protocol", choices=("http", "grpc"), default="grpc")
    parser.add_argument("--model", default="kimi_k25_vision")
    parser.add_argument("--shm", action="store_true", help="exchange tensors through system shared memory")
    parser.add_argument(
        "--admin-key-file",
        type=Path,
        default=None,
        help="with --shm against a server listening beyond loopback: its admin key (default: $KIMI_PREP_ADMIN_KEY)",
    )


def non_negative_int(text: str) -> int:
    return 0 if text.strip() == "0" else positive_int(text)


def add_render_arguments(parser: argparse.ArgumentParser, note: str = "") -> None:
    """``--instances``, ``--threads``, ``--kind``: the host-dependent knobs of a rendered repository."""
    parser.add_argument("--instances", type=positive_int, default=None, help=f"instances of every Python model{note}")
    parser.add_argument(
        "--threads",
        type=non_negative_int,
        default=None,
        help="CPU threads per instance (numba_threads and decoder_threads; 0: all cores). CPU-only hosts: "
        f"keep instances x threads <= cores, e.g. --instances 2 --threads 1 on 2 cores{note}",
    )
    parser.add_argument(
        "--kind", choices=("cpu", "gpu"), default=None, help=f"instance kind (default: GPU if any){note}"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kimi-prep", description="Bit-exact Kimi vision preprocessing.")
    sub = parser.add_subparsers(dest="command", required=True)

    pre = sub.add_parser("preprocess", help="preprocess images in-process (no server)")
    pre.add_argument("--preset", default="kimi-k2.5", choices=sorted(PRESETS))
    pre.add_argument("--out", type=Path, help="write pixel_values, grid_thws, num_tokens, names to this .npz")
    pre.add_argument("--quiet", action="store_true", help="no progress bar (videos)")
    pre.add_argument("images", nargs="+", type=Path, metavar="IMAGE|VIDEO|DIR")
    pre.set_defaults(run=cmd_preprocess)

    render = sub.add_parser("render-repository", help="write the model repository rendered from the presets")
    render.add_argument("--out", type=Path, required=True, help="the repository folder to write")
    add_render_arguments(render)
    render.set_defaults(run=cmd_render_repository)

    srv = sub.add_parser(
        "serve",
        help="run tritonserver on the model repository",
        description="Arguments after -- go to tritonserver as they are, last (e.g. -- --log-verbose=1).",
    )
    srv.add_argument(
        "--model-repository", type=Path, default=None, help="serve this repository as is (default: model_repository/)"
    )
    which = srv.add_mutually_exclusive_group()
    which.add_argument("--all", action="store_true", help="every model (default: the image ensembles and their steps)")
    which.add_argument("--models", nargs="+", metavar="NAME", help="exactly these models (ensembles bring their steps)")
    srv.add_argument("--preset", default=None, help="only this preset's models (kimi-k2.5 / kimi-k2.6, kimi-k3)")
    srv.add_argument("--http-port", type=int, default=8000)
    srv.add_argument("--grpc-port", type=int, default=8001)
    srv.add_argument("--metrics-port", type=int, default=8002)
    add_render_arguments(srv, " (serves a fresh rendering from the presets)")
    srv.add_argument(
        "--probe-port", type=int, default=None, help="serve /livez, /readyz and the watchdog's /metrics on this port"
    )
    srv.add_argument(
        "--host",
        default="127.0.0.1",
        help="the address HTTP, gRPC, metrics and probes listen on (default: %(default)s; 0.0.0.0: every interface)",
    )
    srv.add_argument(
        "--admin-key-file",
        type=Path,
        default=None,
        help="the key of the restricted APIs (model repository, logging, trace; shared memory beyond loopback); "
        "default: $KIMI_PREP_ADMIN_KEY, else a random key per start in a file only you can read (docs/security.md)",
    )
    srv.add_argument(
        "--open-api",
        action="append",
        default=[],
        choices=("shared-memory",),
        help="open a restricted API to clients without the key (shared-memory: for a trusted network)",
    )
    srv.set_defaults(run=cmd_serve)

    inf = sub.add_parser("infer", help="preprocess images on a running server")
    add_server_arguments(inf)
    inf.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    inf.add_argument("--out", type=Path, help="write pixel_values, grid_thws, num_tokens, names to this .npz")
    inf.add_argument("--images-per-request", type=positive_int, default=1, metavar="K", help="images in one request")
    inf.add_argument("--quiet", action="store_true", help="no progress bar")
    inf.add_argument("images", nargs="+", type=Path, metavar="IMAGE|VIDEO|DIR")
    inf.set_defaults(run=cmd_infer)

    bench = sub.add_parser("bench", help="throughput and latency of a running server over a concurrency sweep")
    add_server_arguments(bench)
    bench.add_argument(
        "--concurrency",
        dest="concurrency_levels",
        type=positive_int_list,
        default=[1, 2, 4, 8],
        metavar="N[,N...]",
        help="requests in flight per level, comma-separated (default 1,2,4,8)",
    )
    amount = bench.add_mutually_exclusive_group()
    amount.add_argument("--duration", type=float, default=10.0, metavar="S", help="seconds per level (default 10)")
    amount.add_argument("--requests", type=positive_int, default=None, metavar="N", help="requests per level")
    bench.add_argument(
        "--images", nargs="+", type=Path, metavar="FILE|DIR", help="default: bench-local's generated photos"
    )
    bench.add_argument("--out-dir", type=Path, default=Path("bench_results"), help="bench_server.json and .png")
    bench.add_argument("--quiet", action="store_true", help="no progress bar")
    bench.set_defaults(run=cmd_bench)

    perf = sub.add_parser("perf-data", help="write perf_analyzer --input-data JSON for images")
    perf.add_argument("-o", "--out", type=Path, required=True, help="the JSON file to write")
    perf.add_argument("images", nargs="+", type=Path, metavar="IMAGE|DIR")
    perf.set_defaults(run=cmd_perf_data)

    local = sub.add_parser("bench-local", help="in-process timings: ours vs the plain reference and the decode floor")
    local.add_argument("--preset", default="kimi-k2.5", choices=sorted(PRESETS))
    local.add_argument("--repeats", type=int, default=5, help="timed runs per image (min and median reported)")
    local.add_argument("--images", nargs="+", type=Path, metavar="FILE|DIR", help="default: generated photos")
    local.add_argument("--out-dir", type=Path, default=Path("bench_results"), help="bench_local.json and .png")
    local.add_argument(
        "--keep-large-buffers",
        action="store_true",
        help="apply kimi_vision_prep.allocator's malloc retention (default: glibc's, as in an inference engine)",
    )
    local.set_defaults(run=cmd_bench_local)

    demo = sub.add_parser("demo", help="start a server, send sample images over HTTP and gRPC, stop")
    demo.add_argument("--model", default="kimi_k25_vision", choices=sorted(model_presets()))
    demo.set_defaults(run=cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from kimi_vision_prep.host import codec_env
    from kimi_vision_prep.serving.triton_install import cache_root

    # Before nvImageCodec is first imported: a GPU-less host loads only its CPU extensions.
    for key, value in codec_env(cache_root()).items():
        os.environ.setdefault(key, value)
    argv = list(sys.argv[1:] if argv is None else argv)
    # `kimi-prep serve [options] -- <tritonserver args>`: the rest goes to tritonserver, last.
    passthrough = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = build_parser().parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if passthrough and args.command != "serve":
        print("kimi-prep: only serve passes arguments after -- (to tritonserver)", file=sys.stderr)
        return EXIT_USAGE
    args.tritonserver_args = passthrough
    if args.command in ("infer", "bench") and args.url is None:
        args.url = "localhost:8001" if args.protocol == "grpc" else "localhost:8000"
    if getattr(args, "concurrency", 1) < 1:
        print("kimi-prep: --concurrency must be >= 1", file=sys.stderr)
        return EXIT_USAGE
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
