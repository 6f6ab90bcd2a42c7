"""The server's and the library's ``kimi-prep`` subcommands: ``preprocess`` (in-process),
``render-repository``, ``serve``, ``bench-local`` and ``demo``.

The ``kimi-prep`` front (:mod:`kimi_vision_client.cli`, with ``infer``, ``bench`` and
``perf-data``) finds them through the ``kimi_prep.commands`` entry point, so the client installs
without this package and this package's commands join it when both are installed.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from kimi_vision_client.cli.arguments import command, non_negative_int, positive_int
from kimi_vision_client.cli.outcomes import (
    EXIT_OK,
    EXIT_SOME_FAILED,
    EXIT_USAGE,
    chunk_outcomes,
    expand_paths,
    outcome_of,
    print_outcome,
    read_inputs,
    report,
)
from kimi_vision_client.client import KimiVisionClient
from kimi_vision_common.errors import PreprocessError
from kimi_vision_common.media import looks_like_video
from kimi_vision_common.presets import PRESETS
from kimi_vision_common.wire import DEFAULT_GRPC_PORT, DEFAULT_HTTP_PORT, DEFAULT_METRICS_PORT

from ..render.blocks import SERVING_DEFAULTS
from ..render.repository import RenderOptions, model_presets


def set_codec_env() -> None:
    """Before nvImageCodec is first imported: a GPU-less host loads only its CPU extensions (set
    when a command runs, not while the parser is built)."""
    from ..host import codec_env
    from ..triton_install import cache_root

    for key, value in codec_env(cache_root()).items():
        os.environ.setdefault(key, value)


def cmd_preprocess(args: argparse.Namespace) -> int:
    """In-process, exactly the library calls the Triton models make."""
    from kimi_vision_prep.pipeline import preprocess_bytes
    from kimi_vision_prep.video_pipeline import preprocess_video

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


def render_options(args: argparse.Namespace) -> RenderOptions | None:
    """``--instances`` / ``--threads`` / ``--kind`` as :class:`RenderOptions` (None: none given)."""
    given = {key: getattr(args, key) for key in ("instances", "threads", "kind") if getattr(args, key) is not None}
    return RenderOptions(**given) if given else None


def cmd_render_repository(args: argparse.Namespace) -> int:
    """Write the model repository rendered from the presets."""
    from ..render.repository import render_repository

    out = render_repository(args.out, render_options(args) or RenderOptions())
    print(f"rendered {len(list(out.glob('*/config.pbtxt')))} models into {out}")
    return EXIT_OK


def served_models(args: argparse.Namespace, options: RenderOptions | None) -> tuple[str, ...] | None:
    """The models ``serve`` renders with ``options``: the default set (the image ensembles and their
    steps), ``--all`` or ``--models``, narrowed by ``--preset``; None when a repository is given as is."""
    from ..render.repository import default_model_names, repository_models, select_models

    if args.model_repository is not None:
        if args.all or args.models or args.preset:
            raise ValueError("--all/--models/--preset select from the rendered repository: drop --model-repository")
        return None
    names = None if args.all else (args.models or default_model_names())
    rendered = repository_models(options or RenderOptions())
    selected = [model.name for model in select_models(rendered, names, args.preset)]
    needs_torch = [m.name for m in rendered if m.name in selected and needs_torch_model(m.name, m.config)]
    if needs_torch and importlib.util.find_spec("torch") is None:
        if args.models:
            raise ValueError(f"{', '.join(needs_torch)} need torch, which is not installed: pip install torch")
        print(f"kimi-prep: not serving {', '.join(needs_torch)}: they need torch (pip install torch)", file=sys.stderr)
        selected = [name for name in selected if name not in needs_torch]
    return tuple(selected)


def needs_torch_model(name: str, config: str) -> bool:
    """The chaining example's patch embedding (a torch Conv2d) and the ensembles through it."""
    from ..render.repository import PATCH_EMBED_MODEL

    return name == PATCH_EMBED_MODEL or f'model_name: "{PATCH_EMBED_MODEL}"' in config


def serve_options(args: argparse.Namespace) -> RenderOptions | None:
    """The rendering ``serve`` uses: the host's layout (:func:`~kimi_vision_server.host.host_layout`,
    printed in one line), each of ``--instances`` / ``--threads`` / ``--kind`` overriding its part;
    None when a repository is served as it is."""
    from ..host import host_layout

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
    from kimi_vision_common.wire import operator_key

    from ..launch.command import Ports
    from ..launch.launcher import LaunchSpec
    from ..launch.serve import serve

    ports = Ports(args.http_port, args.grpc_port, args.metrics_port, args.probe_port)
    try:
        options = serve_options(args)
        models = served_models(args, options)
        key = operator_key(args.admin_key_file)
        spec = LaunchSpec(
            ports, args.model_repository, options, models, args.tritonserver_args,
            host=args.host, admin_key=key, open_apis=tuple(args.open_api), verbose=args.verbose,
            response_cache_bytes=None if args.response_cache_mib is None else args.response_cache_mib << 20,
        )  # fmt: skip
    except (ValueError, OSError) as exc:
        print(f"kimi-prep serve: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return serve(spec)


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
    from kimi_vision_client.cli.samples import sample_images
    from kimi_vision_prep.pipeline import preprocess_bytes

    from ..launch.embedded import EmbeddedServer

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


def add_render_arguments(parser: argparse.ArgumentParser, defaults: tuple[str, str, str], note: str = "") -> None:
    """``--instances``, ``--threads``, ``--kind``: the host-dependent knobs of a rendered repository;
    ``defaults``: what each means when not given, in words."""
    instances, threads, kind = defaults
    parser.add_argument(
        "--instances",
        type=positive_int,
        default=None,
        help=f"instances of every Python model{note} (default: {instances})",
    )
    parser.add_argument(
        "--threads",
        type=non_negative_int,
        default=None,
        help="CPU threads per instance (numba_threads, codec_threads, cpu_decode_threads, ffmpeg_threads; "
        "0: all cores). CPU-only hosts: "
        f"keep instances x threads <= cores, e.g. --instances 2 --threads 1 on 2 cores{note} (default: {threads})",
    )
    parser.add_argument("--kind", choices=("cpu", "gpu"), default=None, help=f"instance kind{note} (default: {kind})")


def with_codec_env(command: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """``command``, run after :func:`set_codec_env`."""

    @functools.wraps(command)
    def run(args: argparse.Namespace) -> int:
        set_codec_env()
        return command(args)

    return run


# Over 60 lines: the argparse declaration of every server command and flag (the CLI's surface in one place).
def add_commands(sub: argparse._SubParsersAction) -> None:
    """Add this package's subcommands to the ``kimi-prep`` parser (the entry point); building the
    parser changes nothing in the process."""
    pre = command(sub, "preprocess", help="preprocess images in-process (no server)")
    pre.add_argument("--preset", default="kimi-k2.5", choices=sorted(PRESETS), help="the checkpoint's preset")
    pre.add_argument(
        "--out", type=Path, help="write pixel_values, grid_thws, num_tokens, names to this .npz (default: none written)"
    )
    pre.add_argument("--quiet", action="store_true", help="no progress bar (videos)")
    pre.add_argument("images", nargs="+", type=Path, metavar="IMAGE|VIDEO|DIR")
    pre.set_defaults(run=with_codec_env(cmd_preprocess))

    render = command(sub, "render-repository", help="write the model repository rendered from the presets")
    render.add_argument("--out", type=Path, required=True, help="the repository folder to write")
    add_render_arguments(render, ("1", "0, all cores", "unset: GPU where there is one"))
    render.set_defaults(run=with_codec_env(cmd_render_repository))

    srv = command(
        sub,
        "serve",
        help="run tritonserver on the model repository",
        description="Arguments after -- go to tritonserver as they are, last (e.g. -- --log-verbose=1).",
    )
    srv.add_argument(
        "--model-repository",
        type=Path,
        default=None,
        help="serve this repository as is (default: a fresh rendering from the presets)",
    )
    which = srv.add_mutually_exclusive_group()
    which.add_argument("--all", action="store_true", help="every model (default: the image ensembles and their steps)")
    which.add_argument(
        "--models",
        nargs="+",
        metavar="NAME",
        help="exactly these models, ensembles with their steps (default: the image ensembles, as --all says)",
    )
    srv.add_argument(
        "--preset",
        default=None,
        help="only this preset's models (kimi-k2.5 / kimi-k2.6, kimi-k3; default: every preset)",
    )
    srv.add_argument("--http-port", type=int, default=DEFAULT_HTTP_PORT, help="HTTP (KServe v2 REST)")
    srv.add_argument("--grpc-port", type=int, default=DEFAULT_GRPC_PORT, help="gRPC (KServe v2)")
    srv.add_argument("--metrics-port", type=int, default=DEFAULT_METRICS_PORT, help="Prometheus /metrics")
    host = "this host's layout, printed at start"
    add_render_arguments(srv, (host, host, "GPU if any"), " (serves a fresh rendering from the presets)")
    srv.add_argument(
        "--probe-port",
        type=int,
        default=None,
        help="serve /livez, /readyz and the watchdog's /metrics on this port (default: no probe port)",
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
        help="open a restricted API to clients without the key (shared-memory: for a trusted network; default: none)",
    )
    srv.add_argument(
        "--response-cache-mib",
        type=int,
        default=None,
        help="Triton's response cache, which answers repeats of a request to the image ensembles (default: "
        f"{SERVING_DEFAULTS.response_cache_bytes >> 20} on loopback, none beyond it; docs/serving.md, Repeats)",
    )
    srv.add_argument("--verbose", action="store_true", help="relay tritonserver's info lines and start-up tables too")
    srv.set_defaults(run=with_codec_env(cmd_serve))

    local = command(sub, "bench-local", help="in-process timings: ours vs the decode floor, our decode and Pillow's")
    local.add_argument("--preset", default="kimi-k2.5", choices=sorted(PRESETS), help="the checkpoint's preset")
    local.add_argument("--repeats", type=int, default=5, help="timed runs per image (min and median reported)")
    local.add_argument("--images", nargs="+", type=Path, metavar="FILE|DIR", help="default: generated photos")
    local.add_argument("--out-dir", type=Path, default=Path("bench_results"), help="bench_local.json and .png")
    local.add_argument(
        "--keep-large-buffers",
        action="store_true",
        help="apply the served models' malloc retention (allocator.py; default: glibc's, as in an engine)",
    )
    local.set_defaults(run=with_codec_env(cmd_bench_local))

    demo = command(sub, "demo", help="start a server, send sample images over HTTP and gRPC, stop")
    demo.add_argument("--model", default="kimi_k25_vision", choices=sorted(model_presets()), help="the model to try")
    demo.set_defaults(run=with_codec_env(cmd_demo))
