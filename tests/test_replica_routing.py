"""kimi_vision_client.servers.replicas without a server: how addresses are read, the channels they make,
which replica a request goes to, how a ``dns:///`` name is resolved apart from the requests, and
what is refused."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

import pytest

from kimi_vision_client.client import KimiVisionClient
from kimi_vision_client.servers.replicas import Replicas, Resolver, rank, request_key, resolved, server_addresses
from kimi_vision_common.errors import ConnectionLostError

FAILSAFE_S = 60.0  # a wait that never ends fails its test instead
THREE = ("127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3")


def at_once(work: Callable[[], None]) -> None:
    """A resolution run in the calling thread: the test sees its outcome at the next look."""
    work()


class Channel:
    """A stand-in for a tritonclient: its target; closing it records the target in ``closed``."""

    def __init__(self, target: str, closed: list[str] | None = None) -> None:
        self.target = target
        self.closed = [] if closed is None else closed

    def close(self) -> None:
        self.closed.append(self.target)


def test_addresses_come_as_one_several_or_a_dns_name() -> None:
    assert server_addresses("grpc://a:1") == ("a:1",)
    assert server_addresses("a:1, grpc://b:2") == ("a:1", "b:2")
    assert server_addresses(["a:1", "b:2"]) == ("a:1", "b:2")
    assert server_addresses("dns:///prep-pods.ns.svc:8001") == ("dns:///prep-pods.ns.svc:8001",)
    for bad in ("", "a:1,", "dns:///a:1,b:2"):
        with pytest.raises(ValueError):
            server_addresses(bad)


def opened(balance: str, *addresses: str, resolver: Resolver | None = None) -> tuple[Replicas, list[str]]:
    channels: list[str] = []
    replicas = Replicas(addresses, balance, lambda target: channels.append(target) or target, resolver=resolver)  # type: ignore[arg-type]
    return replicas, channels


def test_each_listed_server_is_one_channel_to_its_name() -> None:
    """A listed ``host:port`` is one server whatever its name resolves to: one channel to the name,
    which gRPC resolves and tries address by address (``localhost``: ``::1`` and ``127.0.0.1``)."""
    one, channels = opened("round_robin", "localhost:8001")
    assert channels == ["localhost:8001"] and not one.balanced and one.failover_attempts == 1
    _, channels = opened("rendezvous", "127.0.0.1:1", "localhost:2", "[::1]:3", "127.0.0.1:1")
    assert channels == ["127.0.0.1:1", "localhost:2", "[::1]:3"]  # each server once, by its name
    with pytest.raises(ValueError, match="balance"):
        opened("random", "127.0.0.1:1")


def test_every_address_of_a_name_is_resolved_both_families() -> None:
    found = resolved("localhost:8001")
    assert "127.0.0.1:8001" in found
    assert set(found) <= {"127.0.0.1:8001", "[::1]:8001"}
    assert resolved("[::1]:8001") == ["[::1]:8001"]


def test_round_robin_takes_each_live_replica_in_turn() -> None:
    replicas, _ = opened("round_robin", *THREE)
    assert replicas.balanced and replicas.failover_attempts == len(THREE) + 1
    turns = [replicas.pick([b"same image"]).name for _ in range(9)]
    assert collections.Counter(turns) == dict.fromkeys(THREE, 3)
    down = replicas.pick([b"x"])
    replicas.failed(down)
    assert down.name not in {replicas.pick([b"x"]).name for _ in range(6)}


def test_rendezvous_sends_repeats_to_one_replica_and_spreads_the_rest() -> None:
    replicas, _ = opened("rendezvous", *THREE)
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
            ranked = sorted(THREE, key=lambda n: rank(key, n), reverse=True)
            assert after == ranked[1]


def test_the_request_key_is_the_bytes_and_their_order() -> None:
    assert request_key([b"a", b"b"]) == request_key([b"a", b"b"]) != request_key([b"b", b"a"])
    assert request_key([b"ab"]) != request_key([b"a", b"b"])


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
    resolved again every REFRESH_S; an added address gets a channel, a known one keeps its own (and
    whether it is passed over), and the channel of one gone closes once the requests it carries
    have answered. A name that stops resolving keeps its last addresses."""
    from kimi_vision_client.servers import replicas as module

    pods = ["10.0.0.1:8001"]
    answers: list[list[str] | OSError] = []

    def resolve(name: str) -> list[str]:
        answer = answers.pop(0) if answers else list(pods)
        if isinstance(answer, OSError):
            raise answer
        return answer

    closed: list[str] = []
    resolver = Resolver("dns:///pods.ns.svc:8001", resolve, start=at_once)
    group = Replicas(("dns:///pods.ns.svc:8001",), balance, lambda target: Channel(target, closed), resolver=resolver)
    first = group.pick([b"k"])
    assert first.name == "10.0.0.1:8001"
    group.sent(first)
    group.failed(first)
    pods.append("10.0.0.2:8001")
    group.pick([b"k"])  # not yet REFRESH_S: the same channels
    assert closed == [] and group.count == 1
    monkeypatch.setattr(module, "REFRESH_S", 0.0)
    group.pick([b"k"])
    assert sorted(replica.client.target for replica in group._replicas) == ["10.0.0.1:8001", "10.0.0.2:8001"]
    assert group._replicas[0] is first and first.down_until > 0  # known: the same channel, still passed over
    pods.remove("10.0.0.1:8001")
    group.pick([b"k"])
    assert [replica.client.target for replica in group._replicas] == ["10.0.0.2:8001"]
    assert closed == [] and first.client in group.clients()  # gone, but still carrying a request
    group.answered(first)
    assert closed == [first.client.target] and first.client not in group.clients()
    answers.append(OSError("no answer"))  # the name stops resolving for a moment: keep what there is
    group.pick([b"k"])
    assert [replica.client.target for replica in group._replicas] == ["10.0.0.2:8001"]


def test_one_resolver_a_name_in_a_process() -> None:
    """Every client of a ``dns:///`` name (a processor makes one per thread) shares one resolver, so
    only the first client's start waits for the name's answer."""
    from kimi_vision_client.servers.replicas import shared_resolver

    assert shared_resolver("dns:///a.test:8001") is shared_resolver("dns:///a.test:8001")
    assert shared_resolver("dns:///a.test:8001") is not shared_resolver("dns:///b.test:8001")


def test_no_request_waits_for_the_names_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    """A resolution that hangs (a DNS server that does not answer) runs in its own thread: requests
    keep going to the addresses resolved last meanwhile, and take the new ones once it answers."""
    from kimi_vision_client.servers import replicas as module

    answer, hung, started = threading.Event(), threading.Event(), threading.Event()
    calls: list[str] = []
    seen_by_pick: list[bool] = []

    def resolve(name: str) -> list[str]:
        calls.append(name)
        if len(calls) == 1:
            return ["10.0.0.1:8001"]
        if len(calls) == 2:  # the second resolution hangs until the test lets it answer
            started.set()
            hung.set()
            answer.wait(60)
            hung.clear()
        return ["10.0.0.2:8001"]

    resolver = Resolver("dns:///pods:8001", resolve)
    group = Replicas(("dns:///pods:8001",), "round_robin", Channel, resolver=resolver)
    monkeypatch.setattr(module, "REFRESH_S", 0.0)
    assert group.pick([b"k"]).name == "10.0.0.1:8001"  # starts the second resolution
    assert started.wait(60)
    seen_by_pick.append(hung.is_set())
    assert group.pick([b"k"]).name == "10.0.0.1:8001"  # while it hangs
    seen_by_pick.append(hung.is_set())
    answer.set()
    assert seen_by_pick == [True, True]  # pick returned while the resolution still hung
    for _ in range(6000):  # until the resolution's thread has stored its answer
        if group.pick([b"k"]).name == "10.0.0.2:8001":
            break
        never_set = threading.Event()
        never_set.wait(0.01)
    else:
        pytest.fail("the resolution's answer was never taken")


def test_a_name_that_does_not_resolve_is_refused_at_the_start_within_its_bound() -> None:
    never = threading.Event()

    def hangs(name: str) -> list[str]:
        never.wait(60)
        return []

    with pytest.raises(ConnectionLostError, match=r"did not resolve within 0\.1 s"):
        Replicas(("dns:///nowhere:8001",), "rendezvous", str, 0.1, Resolver("dns:///nowhere:8001", hangs))
    never.set()


def test_a_start_after_a_failed_resolution_waits_for_the_next_answer() -> None:
    """Clients of one name share its resolver: where its first attempt found no answer, the next
    client's start waits for a new attempt (not the old one's outcome)."""
    answers: list[list[str] | OSError] = [OSError("no answer"), ["10.0.0.1:8001"]]

    def resolve(name: str) -> list[str]:
        answer = answers.pop(0)
        if isinstance(answer, OSError):
            raise answer
        return answer

    resolver = Resolver("dns:///x.test:8001", resolve)
    with pytest.raises(ConnectionLostError, match="did not resolve"):
        Replicas(("dns:///x.test:8001",), "round_robin", Channel, FAILSAFE_S, resolver)
    group = Replicas(("dns:///x.test:8001",), "round_robin", Channel, FAILSAFE_S, resolver)
    assert group.members == ("10.0.0.1:8001",)
