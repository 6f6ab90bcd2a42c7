"""Several servers behind one client: each request goes to one, a failed replica is skipped.

A client is given one address (``host:port``), several (``"h1:p1,h2:p2"`` or a list) or one DNS
name that lists them (``dns:///name:port``: a Kubernetes headless Service). Each server gets one
gRPC channel: a listed ``host:port`` is one server whatever its name resolves to (gRPC resolves it
and tries every address, so ``localhost`` reaches a server on ``::1`` or on ``127.0.0.1``); each
address a ``dns:///`` name lists is one server. Two ways to spread the requests
(:data:`BALANCES`):

- ``round_robin``: each request to the next live replica in turn;
- ``rendezvous``: to the live replica that ranks highest for the request's bytes (rendezvous
  hashing), so every repeat of an image reaches the replica that answered it first and its
  response cache.

A replica whose request got no answer (refused, reset, restarting: not a verdict on the input) is
passed over for :data:`DOWN_S`, its requests going to the next. A ``dns:///`` name is resolved
off the request path (:class:`Resolver`, one a name in a process): once when the first client of
it starts, waiting at most :data:`RESOLVE_TIMEOUT_S`, then again every :data:`REFRESH_S` in a
thread of its own while requests
keep going to the servers resolved last (gRPC's own resolver asks again only when a connection
fails, so pods an autoscaler adds would wait for a failure). When the addresses change, new
channels take the next requests and the old ones close once the requests they carry have answered.

A request is idempotent: its answer depends on its bytes alone (docs/contract.md), and the server
keeps nothing from it but a cache entry of the same answer. So a request that failed for the
server's state (:func:`~kimi_vision_common.faults.retry_elsewhere`) is sent again, to another
replica where there is one; one that passed its deadline is never resent.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from kimi_vision_common.errors import ConnectionLostError
from kimi_vision_common.wire import BALANCES

log = logging.getLogger("kimi_vision_client.replicas")

Balance = Literal["round_robin", "rendezvous"]  # one of kimi_vision_common.wire.BALANCES
DNS_SCHEME = "dns:"
DOWN_S = 1.0  # how long a replica that failed is passed over (gRPC reconnects within a second)
REFRESH_S = 30.0  # how often a dns:/// name is resolved again
RESOLVE_TIMEOUT_S = 5.0  # the longest a client's start waits for a dns:/// name's first answer
FAILOVER_BACKOFF_S = 0.05  # before the first resend; doubled for each next one


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
    the resolver's order, each once (both families)."""
    hostport = address.removeprefix(DNS_SCHEME).lstrip("/")
    host, _, port = hostport.rpartition(":")
    found = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
    ips = dict.fromkeys(info[4][0] for info in found)
    return [f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}" for ip in ips]


def in_thread(work: Callable[[], None]) -> None:
    """Run ``work`` in a daemon thread of its own (a resolution that hangs holds nobody)."""
    threading.Thread(target=work, name="kimi-vision-client resolve", daemon=True).start()


class Resolver:
    """A ``dns:///`` name's addresses, resolved apart from the requests (``start`` runs a
    resolution: in a thread of its own by default) so that no request waits on DNS.

    :meth:`members` returns the addresses resolved last, starting a new resolution (one at a time)
    once they are :data:`REFRESH_S` old, or at once while none has answered. A name that stops
    resolving keeps its last addresses.
    """

    def __init__(
        self,
        name: str,
        resolve: Callable[[str], list[str]] = resolved,
        start: Callable[[Callable[[], None]], None] = in_thread,
    ) -> None:
        self.name = name
        self._resolve = resolve
        self._start = start
        self._answered = threading.Condition()
        self._members: tuple[str, ...] = ()
        self._resolved_at = -REFRESH_S  # due at once
        self._running = False
        self._attempts = 0  # resolutions finished, answered or not

    def members(self, timeout_s: float = 0.0) -> tuple[str, ...]:
        """The addresses resolved last (empty before a first answer: an attempt finishing after
        this call began is waited for up to ``timeout_s``)."""
        with self._answered:
            due = not self._running and time.monotonic() - self._resolved_at >= REFRESH_S
            self._running = self._running or due
            attempts = self._attempts
        if due:
            self._start(self._run)
        with self._answered:
            if not self._members and timeout_s > 0:
                self._answered.wait_for(lambda: bool(self._members) or self._attempts > attempts, timeout_s)
            return self._members

    def _run(self) -> None:
        try:
            found = tuple(self._resolve(self.name))
        except Exception as exc:  # no answer now (or a name that cannot be): keep what was resolved last
            log.debug("kimi-vision-client: %s did not resolve: %s: %s", self.name, type(exc).__name__, exc)
            found = ()
        with self._answered:
            if found:  # else asked again at the next request
                self._members, self._resolved_at = found, time.monotonic()
            self._running = False
            self._attempts += 1
            self._answered.notify_all()


@functools.lru_cache(maxsize=64)
def shared_resolver(name: str) -> Resolver:
    """The one :class:`Resolver` of ``name`` in this process: every client of the name (a processor
    makes one per thread) shares its answers, so only the first start waits for one."""
    return Resolver(name)


# A child process starts with no resolver (one a resolution was running in would never run again).
os.register_at_fork(after_in_child=shared_resolver.cache_clear)


def rank(key: bytes, name: str) -> bytes:
    """The rendezvous weight of replica ``name`` for a request whose bytes hash to ``key``."""
    return hashlib.blake2b(name.encode(), key=key[:64], digest_size=8).digest()


@dataclass
class Replica:
    """One gRPC channel to one server, and when it may be picked again after a failure."""

    name: str
    client: Any
    down_until: float = field(default=0.0)
    in_flight: int = 0  # requests sent through it and not yet answered


class Replicas:
    """The servers of one client. ``connect(target)`` opens a tritonclient of one server;
    ``resolve_timeout_s``: the longest the start waits for a ``dns:///`` name's first answer
    (``resolver``: its :class:`Resolver`, default one of the name).

    Attributes: ``addresses`` as given; ``primary`` the replica for calls about the models (their
    configs, readiness, shared memory): the first live one; ``balanced`` whether there is more
    than one server to go to.
    """

    def __init__(
        self,
        addresses: Sequence[str],
        balance: Balance,
        connect: Any,
        resolve_timeout_s: float = RESOLVE_TIMEOUT_S,
        resolver: Resolver | None = None,
    ) -> None:
        if balance not in BALANCES:
            raise ValueError(f"balance is one of {', '.join(BALANCES)}, not {balance!r}")
        self.addresses = tuple(addresses)
        self.balance = balance
        self.balanced = several_servers(addresses)
        self._connect = connect
        dns = addresses[0].startswith(DNS_SCHEME)
        self._dns = (resolver or shared_resolver(addresses[0])) if dns else None
        self._retired: list[Replica] = []
        self._members: tuple[str, ...] = ()
        self._replicas: list[Replica] = []
        self._turn = itertools.count()
        members = self.addresses if self._dns is None else self._dns.members(resolve_timeout_s)
        if not members:
            raise ConnectionLostError(
                f"{self.addresses[0]} did not resolve within {resolve_timeout_s:g} s: "
                "check the name, or the cluster's DNS"
            )
        self._open(members)

    def _open(self, members: tuple[str, ...]) -> None:
        """One channel per server in ``members``: a server already known keeps its channel (and
        whether it is passed over), a new one gets one, and those of servers gone close once idle."""
        known = {replica.name: replica for replica in self._replicas}
        names = list(dict.fromkeys(members))
        self._retired += [replica for replica in self._replicas if replica.name not in names]
        self._members = members
        self._replicas = [known.get(name) or Replica(name, self._connect(name)) for name in names]
        self.close_idle_retired()

    def refresh(self) -> None:
        """New channels where a ``dns:///`` name's addresses changed since the last look (never waits)."""
        if self._dns is None:
            return
        members = self._dns.members()
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
    def members(self) -> tuple[str, ...]:
        """The servers requests go to now (a ``dns:///`` name's addresses as last resolved)."""
        return self._members

    @property
    def count(self) -> int:
        """The channels: one per server."""
        return len(self._replicas)

    @property
    def stream_target(self) -> str:
        """Where a video stream goes (a stream stays on the replica it started on)."""
        return self.primary.name

    def pick(self, items: Sequence[bytes]) -> Replica:
        """The replica for a request of ``items``: the next live one in turn (``round_robin``) or the
        highest-ranked live one for their bytes (``rendezvous``, :func:`request_key`); a
        ``dns:///`` name's newest addresses taken first where they changed."""
        self.refresh()
        if len(self._replicas) == 1:
            return self._replicas[0]
        if self.balance == "rendezvous":
            key = request_key(items)
            order = sorted(self._replicas, key=lambda replica: rank(key, replica.name), reverse=True)
        else:
            start = next(self._turn) % len(self._replicas)
            order = self._replicas[start:] + self._replicas[:start]
        now = time.monotonic()
        return next((replica for replica in order if replica.down_until <= now), order[0])

    def failed(self, replica: Replica) -> None:
        """``replica`` did not answer: pass it over for :data:`DOWN_S`."""
        replica.down_until = time.monotonic() + DOWN_S

    @property
    def failover_attempts(self) -> int:
        """How many times a request that got no answer is sent: once per replica, and once more
        (the first may have been down for a moment only); once with one server."""
        return len(self._replicas) + 1 if self.balanced else 1

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
