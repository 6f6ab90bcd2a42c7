"""The vLLM plugin's one setting, ``KIMI_PREP_VLLM``, parsed without vLLM: a mode or a server."""

from __future__ import annotations

import pytest

from kimi_vision_common.vllm_plugin import MODES, PROCESSORS, REMOTE_OPTIONS, remote_settings, setting_mode


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
