"""kimi_vision_client.replicas without a server: how addresses are read, the gRPC target they make,
which replica a request goes to, and what is refused."""

from __future__ import annotations

import collections

import pytest

from kimi_vision_client.client import KimiVisionClient
from kimi_vision_client.replicas import (
    Replicas,
    grpc_target,
    rank,
    request_key,
    server_addresses,
    unavailable_now,
)
from kimi_vision_client.transport import channel_args
from kimi_vision_common.errors import DeadlineExceededError, InvalidImageError, ServerUnavailableError


def test_addresses_come_as_one_several_or_a_dns_name() -> None:
    assert server_addresses("grpc://a:1") == ("a:1",)
    assert server_addresses("a:1, grpc://b:2") == ("a:1", "b:2")
    assert server_addresses(["a:1", "b:2"]) == ("a:1", "b:2")
    assert server_addresses("dns:///prep-pods.ns.svc:8001") == ("dns:///prep-pods.ns.svc:8001",)
    for bad in ("", "a:1,", "dns:///a:1,b:2"):
        with pytest.raises(ValueError):
            server_addresses(bad)


def test_several_addresses_make_one_balanced_grpc_target() -> None:
    assert grpc_target(["localhost:8001"]) == "localhost:8001"
    assert grpc_target(["dns:///x:8001"]) == "dns:///x:8001"
    assert grpc_target(["localhost:8001", "127.0.0.2:9001"]) == "ipv4:127.0.0.1:8001,127.0.0.2:9001"
    assert grpc_target(["[::1]:8001", "[::1]:8002"]) == "ipv6:[::1]:8001,[::1]:8002"
    with pytest.raises(ValueError, match="IPv4 and IPv6"):
        grpc_target(["127.0.0.1:8001", "[::1]:8002"])
    assert ("grpc.lb_policy_name", "round_robin") in channel_args(round_robin=True)
    assert not any(key == "grpc.lb_policy_name" for key, _ in channel_args())


def opened(balance: str, *addresses: str) -> tuple[Replicas, list[tuple[str, bool]]]:
    channels: list[tuple[str, bool]] = []
    replicas = Replicas(addresses, balance, lambda target, rr: channels.append((target, rr)) or target)  # type: ignore[arg-type]
    return replicas, channels


def test_round_robin_is_one_channel_and_rendezvous_one_per_replica() -> None:
    one, channels = opened("round_robin", "127.0.0.1:8001")
    assert channels == [("127.0.0.1:8001", False)] and not one.balanced and one.failover_attempts == 1
    three, channels = opened("round_robin", "127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3")
    assert channels == [("ipv4:127.0.0.1:1,127.0.0.1:2,127.0.0.1:3", True)] and three.balanced
    _, channels = opened("rendezvous", "127.0.0.1:1", "localhost:2", "127.0.0.1:1")
    assert channels == [("127.0.0.1:1", False), ("127.0.0.1:2", False)]  # each server once
    with pytest.raises(ValueError, match="balance"):
        opened("random", "127.0.0.1:1")


def test_rendezvous_sends_repeats_to_one_replica_and_spreads_the_rest() -> None:
    replicas, _ = opened("rendezvous", "127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3")
    requests = [[f"image {i}".encode()] for i in range(3000)]
    first = [replicas.pick(items).name for items in requests]
    assert [replicas.pick(items).name for items in requests] == first  # repeats go where the first went
    shares = collections.Counter(first)
    assert len(shares) == 3 and min(shares.values()) > 800  # about a third each
    # A failed replica's keys move to their next in rank; the others stay where they were.
    down = replicas.pick(requests[0])
    replicas.failed(down)
    moved = [replicas.pick(items).name for items in requests]
    assert down.name not in moved
    assert all(after == before for before, after in zip(first, moved, strict=True) if before != down.name)
    for items, before, after in zip(requests, first, moved, strict=True):
        if before == down.name:
            key = request_key(items)
            ranked = sorted(("127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"), key=lambda n: rank(key, n), reverse=True)
            assert after == ranked[1]


def test_the_request_key_is_the_bytes_and_their_order() -> None:
    assert request_key([b"a", b"b"]) == request_key([b"a", b"b"]) != request_key([b"b", b"a"])
    assert request_key([b"ab"]) != request_key([b"a", b"b"])


def test_only_a_request_that_got_no_answer_is_sent_again() -> None:
    assert unavailable_now(ServerUnavailableError("connection reset"))
    assert not unavailable_now(DeadlineExceededError("past its deadline"))  # may still be running
    assert not unavailable_now(InvalidImageError("the server's verdict"))


def test_several_servers_need_grpc_and_no_shared_memory() -> None:
    with pytest.raises(ValueError, match="grpc"):
        KimiVisionClient("127.0.0.1:1,127.0.0.1:2", "http")
    with pytest.raises(ValueError, match="shared memory"):
        KimiVisionClient("127.0.0.1:1,127.0.0.1:2", "grpc", use_shared_memory=True)


@pytest.mark.parametrize("balance", ["round_robin", "rendezvous"])
def test_a_dns_name_is_resolved_again_and_old_channels_close_once_idle(
    balance: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pods an autoscaler adds are used without waiting for a connection to fail: the name is
    resolved again every REFRESH_S; a changed set opens new channels, and an old channel closes
    once the requests it carries have answered."""
    from kimi_vision_client import replicas as module

    pods = ["10.0.0.1:8001"]
    monkeypatch.setattr(module, "resolved", lambda address: list(pods) if address.startswith("dns:") else [address])
    closed: list[str] = []

    class Channel:
        def __init__(self, target: str) -> None:
            self.target = target

        def close(self) -> None:
            closed.append(self.target)

    group = Replicas(("dns:///pods.ns.svc:8001",), balance, lambda target, rr: Channel(target))  # type: ignore[arg-type]
    first = group.pick([b"k"])
    assert first.name == "10.0.0.1:8001"
    group.sent(first)
    pods.append("10.0.0.2:8001")
    group.pick([b"k"])  # not yet REFRESH_S: the same channels
    assert closed == [] and group.count == 1
    monkeypatch.setattr(module, "REFRESH_S", 0.0)
    group.pick([b"k"])
    names = sorted(replica.client.target for replica in group._replicas)
    expected = ["ipv4:10.0.0.1:8001,10.0.0.2:8001"] if balance == "round_robin" else ["10.0.0.1:8001", "10.0.0.2:8001"]
    assert names == expected
    assert closed == [] and first.client in group.clients()  # still carrying a request
    group.answered(first)
    assert closed == [first.client.target] and first.client not in group.clients()

    def unresolved(address: str) -> list[str]:
        if address.startswith("dns:"):
            raise OSError("no answer")  # the name stops resolving for a moment: keep what there is
        return [address]

    monkeypatch.setattr(module, "resolved", unresolved)
    group.pick([b"k"])
    assert sorted(replica.client.target for replica in group._replicas) == expected
