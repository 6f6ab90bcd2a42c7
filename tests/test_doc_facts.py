"""The counts, batch sizes and lists that docs/ states about the served models, recomputed from the
code that renders and serves them: a change to the code that makes a sentence false fails here."""

from __future__ import annotations

import re
from pathlib import Path

from kimi_vision_common.models import PATCH_EMBED_MODEL
from kimi_vision_common.wire import DEFAULT_PROBE_PORT
from kimi_vision_prep.numba_runtime import IDLE_SPIN_SETTING, USER_WAIT_SETTINGS
from kimi_vision_server.launch.command import CPU_ONLY_NOISE
from kimi_vision_server.render.repository import RenderOptions, repository_models

DOCS = Path(__file__).resolve().parents[1] / "docs"


def one_line(name: str) -> str:
    """A document with its line breaks folded into spaces (sentences wrap)."""
    return " ".join((DOCS / name).read_text().split())


def max_batch_sizes(kind: str) -> dict[str, int]:
    return {
        model.name: int(re.search(r"max_batch_size: (\d+)", model.config)[1])  # type: ignore[index]
        for model in repository_models(RenderOptions(kind=kind))
    }


def kind_of(name: str) -> str:
    """``kimi_k25_video_chunk`` -> ``video_chunk``; the patch-embed model -> ``patch_embed``."""
    return "patch_embed" if name == PATCH_EMBED_MODEL else name.split("_", 2)[2]


def test_serve_all_counts_models_and_python_stubs() -> None:
    models = repository_models(RenderOptions(kind="cpu"))
    python = [m for m in models if 'backend: "python"' in m.config]
    pattern = r"serves every model \((\d+) in a CPU rendering, (\d+) of them Python models"
    stated = re.search(pattern, one_line("serving.md"))
    assert stated is not None
    assert (int(stated[1]), int(stated[2])) == (len(models), len(python))


def test_the_relay_drops_the_patterns_the_docs_list() -> None:
    text = one_line("serving.md")
    stated = re.search(r"(\d+) patterns in `launch.command.CPU_ONLY_NOISE`", text)
    assert stated is not None and int(stated[1]) == len(CPU_ONLY_NOISE)
    for quoted in ("CudaDriverHelper has not been initialized", "failed to allocate pinned system memory"):
        assert quoted in text and any(quoted in pattern.pattern for pattern in CPU_ONLY_NOISE)


def test_batch_sizes_are_the_rendered_ones() -> None:
    """docs/models.md: 8 for tokens, video, video-chunk and patch-embed, and for decode on a GPU;
    1 for everything else, decode on a CPU included."""
    sentence = (
        "`max_batch_size` is 8 for the tokens, video, video-chunk and patch-embed models, and for the decode "
        "step of a GPU rendering (one nvImageCodec batch call); it is 1 for the models that return pixels and "
        "the ensembles through them"
    )
    assert sentence in one_line("models.md")
    batched = {"tokens", "video", "video_chunk", "patch_embed"}
    for kind, extra in (("cpu", set()), ("gpu", {"decode"})):
        sizes = max_batch_sizes(kind)
        assert {kind_of(name) for name, size in sizes.items() if size == 8} == batched | extra
        assert set(sizes.values()) == {1, 8}


def test_the_request_limits_the_readme_and_docs_give() -> None:
    from kimi_vision_common.presets import KIMI_K3, KIMI_K25
    from kimi_vision_common.wire import DEFAULT_MAX_IMAGES_PER_REQUEST
    from kimi_vision_server.render.blocks import ServingDefaults

    words = {2: "two", 3: "three", 4: "four"}
    readme = " ".join((DOCS.parent / "README.md").read_text().split())
    budget = ServingDefaults().budget_images
    assert f"Up to {DEFAULT_MAX_IMAGES_PER_REQUEST} images a request, at most {words[budget]} full images'" in readme
    assert f"`max_images_per_request` ({DEFAULT_MAX_IMAGES_PER_REQUEST})" in one_line("media.md")
    security = one_line("security.md")
    assert f"**{budget * KIMI_K25.in_patch_limit:,} patches** for" in security
    assert f"{budget * KIMI_K3.in_patch_limit:,}" in security


def test_the_ports_the_readme_gives_are_the_defaults() -> None:
    from kimi_vision_client.cli import front as cli

    parser = cli.build_parser()
    serve = parser._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    defaults = {a.dest: a.default for a in serve._actions}
    readme = (DOCS.parent / "README.md").read_text()
    makefile = (DOCS.parent / "Makefile").read_text()
    assert f"127.0.0.1:{defaults['http_port']} (HTTP) and :{defaults['grpc_port']} (gRPC)" in readme
    probe = re.search(r"kimi-prep serve --probe-port (\d+)", makefile)[1]  # type: ignore[index]
    assert int(probe) == DEFAULT_PROBE_PORT
    assert f"http://127.0.0.1:{probe}/readyz" in readme
    assert defaults["host"] == "127.0.0.1"


def test_the_watchdog_timings_faults_md_gives_are_its_defaults() -> None:
    import inspect

    from kimi_vision_server.launch.process import PINNED_ONLY_AFTER_S
    from kimi_vision_server.watch.probes import METRIC_FAMILIES
    from kimi_vision_server.watch.watchdog import SERVER_QUICK_EXIT_S, StubWatchdog

    defaults = {name: p.default for name, p in inspect.signature(StubWatchdog).parameters.items()}
    text = one_line("faults.md")
    assert f"Every {defaults['interval_s']:g} s it lists the stub children" in text
    assert f"has not grown for {defaults['replaced_idle_s']:g} s (`replaced_idle_s`;" in text
    assert f"(1 s, 2 s, ... at most {defaults['max_backoff_s']:g} s)" in text
    assert f"A load still running {defaults['load_stall_s']:g} s (`load_stall_s`)" in text
    assert f"reloads still running after {defaults['load_stall_s']:g} s (`load_stall_s`)" in text
    assert f"has not completed in {defaults['load_stall_s']:g} s;" in text
    assert f"has not grown for {defaults['stuck_after_s']:g} s (`stuck_after_s`," in text
    assert f"has not run for {defaults['stuck_after_s']:.1f} s ..." in text
    assert f"within {SERVER_QUICK_EXIT_S:g} s of its start (`watch.watchdog.SERVER_QUICK_EXIT_S`)" in text
    assert defaults["initial_backoff_s"] == 1.0
    assert f"has run no stub for {PINNED_ONLY_AFTER_S:g} s (`launch.process.PINNED_ONLY_AFTER_S`:" in text
    for key, (name, _) in METRIC_FAMILIES.items():
        assert f"`{name}`" in text if key == "server_restarts" else f"`{name}{{model}}`" in text


def test_the_idle_spin_library_md_gives_is_the_one_set() -> None:
    text = one_line("library.md")
    name, value = IDLE_SPIN_SETTING
    assert f"`{name}={value}`" in text
    assert "where the process set " + " or ".join(f"`{n}`" for n in USER_WAIT_SETTINGS) + " itself" in text


def test_the_vllm_plugin_library_md_describes_is_the_one_installed() -> None:
    """The extra, the entry point and the setting docs/library.md names are setup.py's, the shared
    package's pyproject's and the plugin's; the Makefile's vLLM venv installs the library and the
    client the way the document shows."""
    from kimi_vision_common.vllm_plugin import setting

    text = one_line("library.md")
    setup = (DOCS.parent / "setup.py").read_text()
    pyproject = (DOCS.parent / "client" / "common" / "pyproject.toml").read_text()
    assert "'./kimi-vision-prep[vllm]'" in text and '"vllm": [' in setup
    plugins = pyproject.split('[project.entry-points."vllm.general_plugins"]', 1)[1].split("\n\n", 1)[0]
    assert plugins.strip() == 'kimi_vision_prep = "kimi_vision_common.vllm_plugin:register"'
    assert "entry point `kimi_vision_prep`, declared by the package both depend on" in text
    stated = re.search(r"`(\w+)`: `(\w+)` \(default\) processes in the vLLM process; `(\w+)` leaves", text)
    assert stated is not None
    assert stated.groups() == (setting.SETTING, *setting.MODES[:2])
    assert "a server's gRPC address processes on that server" in text and setting.MODES[2] == "remote"
    assert f"{setting.SETTING}=off vllm serve" in text
    makefile = (DOCS.parent / "Makefile").read_text()
    assert './client/common ./client "kimi-vision-prep[vllm] @ file://$(CURDIR)"' in makefile


def test_the_remote_form_library_md_describes_is_the_code() -> None:
    """The remote processor's defaults and the setting's options as docs/library.md states them,
    and the fault test's figures it cites."""
    import test_remote_faults as faults

    from kimi_vision_client import remote_processor
    from kimi_vision_common import remote_setting

    text = one_line("library.md")
    assert f"`deadline_s` (default {remote_processor.DEFAULT_DEADLINE_S:g})" in text
    assert f"`concurrency` (default {remote_processor.DEFAULT_CONCURRENCY})" in text
    example = re.search(r"grpc://host:8001\?(\S+)`", text)
    assert example is not None
    assert [pair.split("=")[0] for pair in example.group(1).split("&")] == list(remote_setting.REMOTE_OPTIONS)
    assert "`fallback=local`" in text and "local" in remote_setting.REMOTE_OPTIONS["fallback"]
    assert "`shared_memory` (`auto`: on a loopback address)" in text
    assert remote_setting.REMOTE_OPTIONS["shared_memory"][0] == "auto"
    words = {4: "four"}
    assert f"under load from {words[faults.THREADS]} threads" in text
    assert f"(deadline {faults.DEADLINE_S:g} s)" in text and f"{faults.AT_ONCE} requests at once" in text
    served = re.search(r"kimi-prep serve --models ([\w ]+?)  ", (DOCS / "library.md").read_text())
    assert served is not None and "kimi_k25_video_chunk" in served.group(1).split()


def test_the_balancing_serving_md_describes_is_the_code() -> None:
    """docs/serving.md, "How clients balance across replicas": the client's constants and the
    failover test's load as stated."""
    import test_replicas as failover

    from kimi_vision_client.servers import replicas
    from kimi_vision_client.transport import adapters

    text = one_line("serving.md")
    from kimi_vision_client import client

    assert f"passed over for {replicas.DOWN_S:g} s" in text
    assert f"(waiting at most {replicas.RESOLVE_TIMEOUT_S:g} s, `RESOLVE_TIMEOUT_S`)" in text
    assert f"manager (within {client.CLOSE_DEADLINE_S:g} s: a stalled server" in text
    assert f"again every {replicas.REFRESH_S:g} s (`REFRESH_S` in" in text
    assert f"the reconnect backoff is capped at {adapters.MAX_RECONNECT_BACKOFF_MS / 1000:g} s" in text
    assert f"({failover.IN_FLIGHT} in flight:" in text
    assert "three images the reference refuses" in text and len(failover.REFUSED) == 3
    assert f"over {len(failover.PHOTOS)} images sent {failover.REPEATS} times each" in text
    assert f"starts {['no', 'one', 'two', 'three'][failover.REPLICAS]} `kimi-prep serve`" in text
    assert replicas.BALANCES[0] == "round_robin" and "`round_robin` (default)" in text


def test_the_deadline_and_shared_memory_library_md_describes_are_the_code() -> None:
    """docs/library.md's remote form: the deadline tests' load, the shared-memory headroom and the
    refused burst as stated."""
    import test_remote_deadlines as deadlines
    import test_remote_shared_memory as shared

    from kimi_vision_client.request import shm_slots

    text = one_line("library.md")
    load = f"{deadlines.IMAGES} images {deadlines.CONCURRENCY} at a time"
    assert f"(SIGSTOP, deadline {deadlines.DEADLINE_S:g} s): {load}" in text
    assert f"`KimiVisionClient.infer_many(deadline={deadlines.DEADLINE_S:g})`" in text
    assert f"beside {shm_slots.SHM_HEADROOM_BYTES >> 20} MiB of headroom (`shm_slots.SHM_HEADROOM_BYTES`)" in text
    import shm_namespace_side as side

    assert "of eight 12-megapixel requests at once where two regions fit" in text and side.IN_FLIGHT == 8
    assert f"{shared.BURST:,} refused images, {shared.IN_FLIGHT} in flight, left {shared.IN_FLIGHT} regions" in text


def test_the_sglang_package_library_md_describes_is_the_code() -> None:
    """The package, its setting and its modes, the proven release and the Makefile's SGLang pin."""
    import ast

    text = one_line("library.md")
    package = DOCS.parent / "client" / "common" / "kimi_vision_common" / "sglang_processors" / "__init__.py"
    source = package.read_text()
    assert "SGLANG_EXTERNAL_MM_PROCESSOR_PACKAGE=kimi_vision_common.sglang_processors" in text
    assert 'SETTING = "KIMI_PREP_SGLANG"' in source and "`KIMI_PREP_SGLANG`: `local` (default), `off`" in text
    proven = ast.literal_eval(source.split("PROVEN_SGLANG = ", 1)[1].split("\n", 1)[0])
    release = ".".join(map(str, proven[0]))
    assert proven == (tuple(int(p) for p in release.split(".")),)
    assert f"Proven on SGLang {release} only" in text
    assert f"SGLANG_RELEASE := {release}" in (DOCS.parent / "Makefile").read_text()
