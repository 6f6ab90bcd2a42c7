"""Every file, module and symbol the documents cite exists; the README and BENCHMARKS.md stay short.

Checked in README.md, BENCHMARKS.md, docs/*.md and the other READMEs: each code span (backticks)
that names a file of the checkout (``kimi_vision_server/models/requests.py``, ``docs/benchmarks/x.{json,png}``), a
module or an attribute of ours (``kimi_vision_prep.resized_decoded``, ``resample.vertical_pass_first``)
or calls a function (``configure_buffers(...)``) must resolve.
"""

from __future__ import annotations

import importlib
import json
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = sorted(
    [
        ROOT / "README.md",
        ROOT / "BENCHMARKS.md",
        ROOT / "docker" / "README.md",
        ROOT / "tests" / "gpu" / "README.md",
        *(ROOT / "docs").glob("*.md"),
    ]
)
PACKAGES = {
    "kimi_vision_prep": ROOT / "backend_src" / "kimi_vision_prep",
    "kimi_vision_server": ROOT / "backend_src" / "server" / "kimi_vision_server",
    "kimi_vision_common": ROOT / "client" / "common" / "kimi_vision_common",
    "kimi_vision_client": ROOT / "client" / "kimi_vision_client",
}
# Every file and folder of the checkout (git's list), for paths cited in full or by their tail.
TRACKED = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
FOLDERS = {str(parent) for path in TRACKED for parent in Path(path).parents if str(parent) != "."}
# Paths cited that are made by a run (git-ignored), a checkpoint's files, or not files at all
# (Kubernetes names).
NOT_FILES = frozenset(
    {"bench_results", "tests/gpu/served", "tests/gpu/wheels", "machine.txt", "gpu_report.json", "served_check.json"}
    | {"preprocessor_config.json"}
    | {"nvidia.com/gpu", "autoscaling/v2"}
)
FILE = re.compile(r"^[\w.\-/{},*]+\.(py|c|md|sh|json|png|pbtxt|toml|yaml|yml|tsv|txt|jpg|so)$|^[\w.\-]+/[\w.\-/]*$")
DOTTED = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")
CALL = re.compile(r"^(?P<name>[A-Za-z_][\w.]*)\(.*\)$")
# Calls the documents cite that are Triton's, Python's or a library's, not ours.
FOREIGN_CALLS = frozenset(
    {"requested_output_names", "as_numpy", "to_ndarray", "cached_get_image_processor", "open", "convert"}
)
SOURCES = "\n".join(
    path.read_text(errors="replace")
    for folder in PACKAGES.values()
    for path in [*folder.rglob("*.py"), *folder.rglob("*.c")]
)


def spans(document: Path) -> list[str]:
    """The code spans of ``document`` (fenced blocks left out: they are commands and examples)."""
    text = re.sub(r"```.*?```", "", document.read_text(), flags=re.S)
    return [span.strip() for span in re.findall(r"`([^`\n]+)`", text)]


def expand(path: str) -> list[str]:
    """``a.{json,png}`` -> ``a.json``, ``a.png``."""
    match = re.search(r"\{([^}]*)\}", path)
    if not match:
        return [path]
    return [p for option in match[1].split(",") for p in expand(path[: match.start()] + option + path[match.end() :])]


def file_exists(path: str) -> bool:
    """Each expansion of ``path`` is a tracked file or folder, in full or as the tail of one."""

    def found(candidate: str) -> bool:
        tail = candidate.rstrip("/")
        return any(p == tail or p.endswith("/" + tail) for p in (*TRACKED, *FOLDERS))

    if path.rstrip("/") in NOT_FILES:
        return True
    return all(found(candidate) for candidate in expand(path))


def our_module(name: str) -> str | None:
    """The module of ours that a dotted name starts with (``kimi_vision_prep.x`` or a short ``resample``)."""
    first = name.split(".", maxsplit=1)[0]
    if first in PACKAGES:
        return first
    for package, folder in PACKAGES.items():
        if (folder / f"{first}.py").exists() or (folder / first).is_dir():
            return f"{package}.{first}"
        if (folder / "serving" / f"{first}.py").exists():
            return f"{package}.serving.{first}"
    return None


def resolves(name: str) -> bool:
    """``module.attr...`` of ours: import the longest module prefix, then walk the attributes."""
    start = our_module(name)
    assert start is not None
    parts = [*start.split("."), *name.split(".")[1:]]
    for cut in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            if not hasattr(value, attribute):
                return False
            value = getattr(value, attribute)
        return True
    return False


def problems(document: Path) -> list[str]:
    found = []
    for span in spans(document):
        if span.startswith(("/", "~", "$", "<", "http", "-")) or " " in span or span == "..":
            continue
        if FILE.match(span):
            if not file_exists(span):
                found.append(f"file {span}")
        elif DOTTED.match(span) and our_module(span) and not resolves(span):
            found.append(f"name {span}")
        elif call := CALL.match(span):
            name = call["name"]
            if "." in name and our_module(name) and not resolves(name):
                found.append(f"name {span}")
            elif "." not in name and name not in FOREIGN_CALLS and not re.search(rf"\b(def|class) {name}\b", SOURCES):
                found.append(f"function {span}")
    return found


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_cited_name_exists(document: Path) -> None:
    assert not problems(document), problems(document)


def test_readme_and_benchmarks_stay_short() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 170
    assert len((ROOT / "BENCHMARKS.md").read_text().splitlines()) <= 270


# A section of BENCHMARKS.md cited by name: `(BENCHMARKS.md, "Served: memory")` or `"Served:
# memory" in BENCHMARKS.md`; a commit's BENCHMARKS.md (`abc1234`'s BENCHMARKS.md) is history.
CITED_SECTION = re.compile(r'(?<!\'s )BENCHMARKS\.md\)?,\s+"([^"]+)"|"([^"]+)"\s+in\s+\[?BENCHMARKS\.md')


def missing_sections(document: Path) -> list[str]:
    """Sections of BENCHMARKS.md that ``document`` cites by a name no heading of it contains."""
    headings = [line for line in (ROOT / "BENCHMARKS.md").read_text().splitlines() if line.startswith("#")]
    cited = [a or b for a, b in CITED_SECTION.findall(document.read_text())]
    return [name for name in cited if not any(" ".join(name.split()) in heading for heading in headings)]


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_cited_benchmarks_section_exists(document: Path) -> None:
    assert not missing_sections(document)


def test_a_missing_benchmarks_section_is_found(tmp_path: Path) -> None:
    cites = tmp_path / "cites.md"
    cites.write_text(
        'Measured (BENCHMARKS.md, "Served: memory"); "No such\nsection" in BENCHMARKS.md;\n'
        '(BENCHMARKS.md,\n"late"); (`abc1234`\'s BENCHMARKS.md, "gone since").\n'
    )
    assert missing_sections(cites) == ["No such\nsection", "late"]


def test_the_device_memory_the_memory_doc_gives_is_the_gpu_reports() -> None:
    """docs/memory.md's C_ctx and M_dec are what the checked-in GPU report measured."""
    memory = json.loads((ROOT / "docs" / "benchmarks" / "gpu_report.json").read_text())["memory"]
    context = next(value for key, value in memory.items() if key.startswith("device_used_at_start_mib"))
    per_decoder = [decoder["after_warm_decode_mib"] for decoder in memory["per_decoder"]]
    text = " ".join((ROOT / "docs" / "memory.md").read_text().split())
    assert f"`C_ctx` was {round(context)} MiB" in text
    image = memory["warm_decode_image"].split()[0]
    assert f"`M_dec` {round(min(per_decoder))}-{round(max(per_decoder))} MiB a decoder after a {image}" in text


def test_the_readmes_speed_claim_is_the_processor_benchmarks() -> None:
    """README's "about Nx its speed" is the checkpoint processor's benchmark, both inputs, rounded."""
    benchmarks = (ROOT / "BENCHMARKS.md").read_text()
    section = benchmarks.split("## In process: `KimiVisionProcessor`", 1)[1].split("\n## ", 1)[0]
    medians = [float(x) for x in re.findall(r"\| \*\*([0-9.]+)x\*\* \|", section)]
    claimed = re.search(r"about (\d+)x its speed", " ".join((ROOT / "README.md").read_text().split()))
    assert len(medians) == 2 and claimed
    assert {round(median) for median in medians} == {int(claimed.group(1))}


# -- links and the repository's edges ------------------------------------------------------------

MARKDOWN = sorted(ROOT / path for path in TRACKED if path.endswith(".md"))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def dead_links(document: Path) -> list[str]:
    """Relative links of ``document`` that do not resolve from its own folder inside the checkout."""
    text = re.sub(r"```.*?```", "", document.read_text(), flags=re.S)
    found = []
    for target in LINK.findall(text):
        if target.startswith(("http://", "https://", "mailto:", "#")):
            continue
        path = (document.parent / target.split("#", 1)[0]).resolve()
        if not path.is_relative_to(ROOT) or not path.exists():
            found.append(target)
    return found


@pytest.mark.parametrize("document", MARKDOWN, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_resolves_from_its_own_file(document: Path) -> None:
    assert not dead_links(document)


def test_no_tracked_file_reaches_outside_the_checkout() -> None:
    """The repository stands alone: no file names the folder beside a CI checkout (the corpus and
    the contract live in tests/data/ and docs/)."""
    # Spelled in pieces so that this file does not match itself.
    beside = "shared"
    outside = re.compile("|".join([f"\\.\\./{beside}", f'"{beside}" / "corpus"', f"{beside}/corpus", f"{beside}/spec"]))
    offenders = []
    for path in TRACKED:
        file = ROOT / path
        if file.suffix in {".py", ".md", ".sh", ".toml", ".yaml", ".yml", ".txt", ".cfg", ""} and file.is_file():
            if outside.search(file.read_text(errors="replace")):
                offenders.append(path)
    assert not offenders


def test_num_tokens_has_the_wire_dtype_wherever_a_document_gives_one() -> None:
    """``num_tokens`` / ``NUM_TOKENS`` have one dtype (the wire's) in the library, the client, the npz
    and every document that names one."""
    from kimi_vision_common.wire import NUM_TOKENS_DTYPE

    stated = []
    for document in DOCUMENTS:
        for line in document.read_text().splitlines():
            stated += re.findall(r"num_tokens\W{0,6}(?:#\s*)?(int\d+)", line, re.I)
    assert stated, "the documents give num_tokens' dtype somewhere"
    assert {dtype.lower() for dtype in stated} == {NUM_TOKENS_DTYPE.name}, stated


def test_the_vllm_table_is_the_benchmarks_json() -> None:
    """BENCHMARKS.md's vLLM rows are docs/benchmarks/bench_vllm_<version>.json's medians and ratios, as
    printed: a version's three rows for each vLLM the plugin is proven on (both ends of the range),
    each meeting the wall targets the section says it meets."""
    from kimi_vision_common.vllm_plugin.checks import PROVEN_VLLM

    section = (ROOT / "BENCHMARKS.md").read_text().split("## In vLLM: the plugin", 1)[1].split("\n## ", 1)[0]
    files = sorted((ROOT / "docs" / "benchmarks").glob("bench_vllm_*.json"))
    versions = [path.stem.removeprefix("bench_vllm_") for path in files]
    assert versions == [f"{major}.{minor}" for major, minor in PROVEN_VLLM]
    for path, version in zip(files, versions, strict=True):
        measured = json.loads(path.read_text())
        assert measured["vllm"].startswith(version + ".")
        summary = measured["summary"]
        rows = [line for line in section.splitlines() if line.startswith(f"| {version} | (")]
        assert len(rows) == len(summary) == 3
        for row, way in zip(rows, ("pil", "chat", "chat_1080p"), strict=True):
            cells = [cell.strip().strip("*") for cell in row.strip("|").split("|")][2:]
            assert cells == vllm_row(summary[way]), (version, way)
        targets = re.search(r"stock / ours wall >= (\d+)x \(a\), >= (\d+)x \(b\) in each vLLM \(met\)", section)
        assert targets is not None
        assert summary["pil"]["stock_over_ours_wall_ms_median"] >= int(targets[1]), version
        assert summary["chat"]["stock_over_ours_wall_ms_median"] >= int(targets[2]), version


def vllm_row(x: dict[str, float]) -> list[str]:
    """A way's cells in BENCHMARKS.md's vLLM table, as bench_vllm.py's summary prints them."""
    return [
        f"{x['stock_wall_ms_median']:.1f}", f"{x['ours_wall_ms_median']:.1f}", f"{x['remote_wall_ms_median']:.1f}",
        f"{x['stock_over_ours_wall_ms_median']:.2f}x", f"{x['stock_over_ours_wall_ms_min']:.2f}x",
        f"{x['stock_cpu_ms_median']:.1f}", f"{x['ours_cpu_ms_median']:.1f}", f"{x['remote_cpu_ms_median']:.1f}",
        f"{100 * x['remote_over_stock_cpu_ms_median']:.1f}%", f"{x['remote_server_cpu_ms_median']:.1f}",
        f"{x['remote_over_ours_wall_ms_median']:.2f}x", f"{x['remote_received_over_patches']:.4f}",
    ]  # fmt: skip


def test_the_sglang_row_is_the_benchmarks_json() -> None:
    """BENCHMARKS.md's SGLang row is docs/benchmarks/bench_sglang.json as bench_sglang.py prints it,
    measured with the SGLang release the package is proven on; the target it says is met, is."""
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_sglang import markdown_row

    from kimi_vision_common.sglang_processors import PROVEN_SGLANG

    section = (ROOT / "BENCHMARKS.md").read_text().split("## In SGLang:", 1)[1].split("\n## ", 1)[0]
    measured = json.loads((ROOT / "docs" / "benchmarks" / "bench_sglang.json").read_text())
    assert tuple(int(part) for part in measured["sglang"].split(".")[:3]) in PROVEN_SGLANG
    rows = [line for line in section.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert rows == [markdown_row(measured)]
    target = re.search(r"stock / ours wall >= (\d+)x \(met\)", section)
    assert target is not None and measured["ratios"]["stock_over_ours_wall"] >= int(target[1])
