"""Several servers behind one client: gRPC balances each request, a failed replica is skipped.

A client is given one address (``host:port``), several (``"h1:p1,h2:p2"`` or a list), or one DNS
name that lists them (``dns:///name:port``: a Kubernetes headless Service). Two ways to spread the
requests (:data:`BALANCES`):

- ``round_robin``: one gRPC channel over every address, grpcio's ``round_robin`` policy picking a
  connected replica per request; a replica whose connection fails leaves the rotation until it
  reconnects (the reconnect backoff is capped at a second).
- ``rendezvous``: one channel per address; a request goes to the live replica that ranks highest
  for its bytes (rendezvous hashing), so every repeat of an image reaches the replica that answered
  it first and its response cache. A failed replica is passed over for :data:`DOWN_S`, its
  requests going to the next in rank.

A ``dns:///`` name is resolved here, again every :data:`REFRESH_S` (gRPC's own resolver asks again
only when a connection fails, so pods an autoscaler adds would wait for a failure): when the
addresses change, new channels take the next requests and the old ones close once the requests
they carry have answered.

A request is idempotent: its answer depends on its bytes alone (docs/contract.md), and the server
keeps nothing from it but a cache entry of the same answer. So a request that failed with
``UNAVAILABLE`` (refused, connection reset, queue full: :func:`unavailable_now`) is sent again,
to another replica where there is one; one that passed its deadline is never resent.
"""

from __future__ import annotations

import hashlib
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from kimi_vision_common.errors import DeadlineExceededError, PreprocessError, ServerUnavailableError
from kimi_vision_common.wire import BALANCES

Balance = Literal["round_robin", "rendezvous"]  # one of kimi_vision_common.wire.BALANCES
DNS_SCHEME = "dns:"
DOWN_S = 1.0  # how long a replica that failed is passed over (gRPC reconnects within a second)
REFRESH_S = 30.0  # how often a dns:/// name is resolved again
FAILOVER_BACKOFF_S = 0.05  # before the first resend; doubled for each next one


def unavailable_now(error: PreprocessError) -> bool:
    """True for an error that produced no answer and may be sent again (the server refused it, was
    unreachable or restarting); False for a deadline (the server may still be working on it) and
    for the server's verdict on the input."""
    return isinstance(error, ServerUnavailableError) and not isinstance(error, DeadlineExceededError)


def strip_scheme(url: str) -> str:
    """``http://host:port/`` -> ``host:port`` (tritonclient wants no scheme)."""
    return url.split("://", 1)[-1].rstrip("/")


def server_addresses(url: str | Sequence[str]) -> tuple[str, ...]:
    """``url`` as addresses: ``host:port`` items (a ``grpc://`` / ``http://`` scheme dropped) from a
    comma-separated string or a list, or one ``dns:///name:port`` kept whole."""
    items = [item.strip() for item in (url.split(",") if isinstance(url, str) else url)]
    addresses = tuple(item if item.startswith(DNS_SCHEME) else strip_scheme(item) for item in items)
    if not addresses or not all(addresses):
        raise ValueError(f"no server address in {url!r}")
    if len(addresses) > 1 and any(a.startswith(DNS_SCHEME) for a in addresses):
        raise ValueError(f"a dns:/// name stands alone: it lists the replicas itself ({url!r})")
    return addresses


def several_servers(addresses: Sequence[str]) -> bool:
    """Whether ``addresses`` (:func:`server_addresses`) may name more than one server."""
    return len(addresses) > 1 or addresses[0].startswith(DNS_SCHEME)


def resolved(address: str) -> list[str]:
    """The ``ip:port`` addresses of ``host:port`` or ``dns:///name:port`` (IPv6 in brackets), in
    the resolver's order, each once."""
    hostport = address.removeprefix(DNS_SCHEME).lstrip("/")
    host, _, port = hostport.rpartition(":")
    found = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
    ips = dict.fromkeys(info[4][0] for info in found)
    return [f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}" for ip in ips]


def grpc_target(addresses: Sequence[str]) -> str:
    """One gRPC target for ``addresses``: itself for one address or a ``dns:///`` name; otherwise
    gRPC's static list (``ipv4:a:p,b:p``), host names resolved once here."""
    if len(addresses) == 1:
        return addresses[0]
    ips = [ip for address in addresses for ip in resolved(address)[:1]]
    families = {"ipv6" if ip.startswith("[") else "ipv4" for ip in ips}
    if len(families) > 1:
        raise ValueError(f"{', '.join(addresses)} mix IPv4 and IPv6 addresses: gRPC balances one family")
    return f"{families.pop()}:{','.join(ips)}"


def rank(key: bytes, name: str) -> bytes:
    """The rendezvous weight of replica ``name`` for a request whose bytes hash to ``key``."""
    return hashlib.blake2b(name.encode(), key=key[:64], digest_size=8).digest()


@dataclass
class Replica:
    """One gRPC channel (to one server, or to all of them for ``round_robin``) and when it may be
    picked again after a failure."""

    name: str
    client: Any
    down_until: float = field(default=0.0)
    in_flight: int = 0  # requests sent through it and not yet answered


class Replicas:
    """The servers of one client. ``connect(target, round_robin)`` opens a tritonclient.

    Attributes: ``addresses`` as given; ``primary`` the replica for calls about the models (their
    configs, readiness, shared memory): the first live one; ``balanced`` whether there is more
    than one server to go to.
    """

    def __init__(self, addresses: Sequence[str], balance: Balance, connect: Any) -> None:
        if balance not in BALANCES:
            raise ValueError(f"balance is one of {', '.join(BALANCES)}, not {balance!r}")
        self.addresses = tuple(addresses)
        self.balance = balance
        self.balanced = several_servers(addresses)
        self._connect = connect
        self._dns = addresses[0] if addresses[0].startswith(DNS_SCHEME) else None
        self._retired: list[Replica] = []
        self._members: tuple[str, ...] = ()
        self._replicas: list[Replica] = []
        self._resolved_at = time.monotonic()
        self._open(self._current_members() or self.addresses)

    def _current_members(self) -> tuple[str, ...]:
        """The servers now: the ``ip:port`` a ``dns:///`` name resolves to (empty where it does not
        resolve), else the addresses as given."""
        if self._dns is None:
            return self.addresses
        try:
            return tuple(resolved(self._dns))
        except OSError:  # no answer now: keep what was resolved last
            return ()

    def _open(self, members: tuple[str, ...]) -> None:
        """Channels to ``members``: one per server (``rendezvous``), or one balanced by gRPC."""
        self._retired += self._replicas
        self._members = members
        if self.balance == "rendezvous" and self.balanced:
            names = list(dict.fromkeys(ip for member in members for ip in resolved(member)))
            self._replicas = [Replica(name, self._connect(name, False)) for name in names]
        else:
            target = grpc_target(members)
            self._replicas = [Replica(target, self._connect(target, self.balanced))]
        self.close_idle_retired()

    def refresh(self) -> None:
        """Resolve a ``dns:///`` name again when :data:`REFRESH_S` has passed; new channels when its
        addresses changed."""
        if self._dns is None or time.monotonic() - self._resolved_at < REFRESH_S:
            return
        self._resolved_at = time.monotonic()
        members = self._current_members()
        if members and set(members) != set(self._members):
            self._open(members)

    def sent(self, replica: Replica) -> None:
        replica.in_flight += 1

    def answered(self, replica: Replica) -> None:
        """A request sent through ``replica`` answered or failed: close it where it was retired
        and carries no other."""
        replica.in_flight -= 1
        self.close_idle_retired()

    def close_idle_retired(self) -> None:
        for replica in [r for r in self._retired if r.in_flight == 0]:
            self._retired.remove(replica)
            replica.client.close()

    @property
    def primary(self) -> Replica:
        """The first replica not passed over after a failure (the first, where all are)."""
        now = time.monotonic()
        return next((replica for replica in self._replicas if replica.down_until <= now), self._replicas[0])

    @property
    def count(self) -> int:
        """The channels: one per server for ``rendezvous``, one for all of them otherwise."""
        return len(self._replicas)

    @property
    def stream_target(self) -> str:
        """Where a video stream goes (a stream stays on the replica it started on)."""
        return self.primary.name

    def pick(self, items: Sequence[bytes]) -> Replica:
        """The replica for a request of ``items``: the highest-ranked live one for their bytes
        (``rendezvous``, :func:`request_key`), else the one channel (gRPC balances it where it
        reaches several servers); a ``dns:///`` name resolved again first where due."""
        self.refresh()
        if len(self._replicas) == 1:
            return self._replicas[0]
        now, key = time.monotonic(), request_key(items)
        ranked = sorted(self._replicas, key=lambda replica: rank(key, replica.name), reverse=True)
        return next((replica for replica in ranked if replica.down_until <= now), ranked[0])

    def failed(self, replica: Replica) -> None:
        """``replica`` did not answer: pass it over for :data:`DOWN_S`."""
        replica.down_until = time.monotonic() + DOWN_S

    @property
    def failover_attempts(self) -> int:
        """How many times a request that got no answer is sent: once per replica known, and for a
        balanced channel (gRPC knows the replicas) a few more while it notices a dead one."""
        return len(self._replicas) + 3 if self.balanced else 1

    def clients(self) -> list[Any]:
        """Every open tritonclient, retired ones still carrying requests included."""
        return [replica.client for replica in (*self._replicas, *self._retired)]


def request_key(items: Sequence[bytes]) -> bytes:
    """What a request is routed by: a digest of its bytes (the same images, the same replica)."""
    digest = hashlib.blake2b(digest_size=16)
    for item in items:
        digest.update(len(item).to_bytes(8, "little"))
        digest.update(item)
    return digest.digest()
