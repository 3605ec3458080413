"""Discovery by DNS: a pool entry `dns://NAME:PORT` stands for every address NAME resolves to.

One `DnsDiscovery` per entry resolves NAME's A and AAAA records every `--discovery-interval`
seconds with dnspython's async resolver (the system's configuration from /etc/resolv.conf, its
search list included, or the one server `--dns-server` names) and makes the pool follow the
answer:

- a new address joins as the worker `http://ADDR:PORT` (`[ADDR]` for IPv6), checked at once and
  routable once its health check passes, like any worker;
- a vanished one is retired: drained (no new requests, running ones finish), then dropped from
  the pool and its client closed;
- a failed resolution (NXDOMAIN, no answer, a timeout, no server answering) changes nothing:
  the last good set stays. It is logged and counted in
  `pdserve_proxy_discovery_errors_total{role, name, reason}`;
  `pdserve_proxy_discovered_workers{role, name}` is the size of the set in use.
- A and AAAA are asked apart: one family failing (a server that answers REFUSED or SERVFAIL
  for AAAA) keeps that family's last good addresses and takes the other's answer. It is logged
  once and counted like a failed resolution.

What is admitted is bounded (`DiscoveryLimits`): addresses outside `--discovery-allow` (when
given) are dropped, and of the others at most `--discovery-max-workers` join, the lowest
addresses first, so that every proxy process keeps the same subset; both are logged when the
answer changes. Every admitted address is sent prompts and the internal token: the DNS server
is trusted as much as the workers are (docs/security.md).

The name's records are the truth: a worker removed through the admin API comes back at the
next resolution if its address still resolves; one drained through it stays drained.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol
from urllib.parse import urlsplit

import dns.asyncresolver
import dns.exception
import dns.name
import dns.nameserver
import dns.resolver

from proxy.metrics import ProxyMetrics
from proxy.workers import Worker

logger = logging.getLogger(__name__)

SCHEME = "dns://"
RESOLVE_TIMEOUT_S = 2.0  # one resolution, A and AAAA together
FAMILIES = ("A", "AAAA")
MAX_WORKERS = 64  # --discovery-max-workers: workers one name may bring


def parse_network(cidr: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    try:
        return ipaddress.ip_network(cidr, strict=False)
    except ValueError:
        raise ValueError(
            f"discovery_allow: expected a CIDR (10.0.0.0/8, fd00::/8), got {cidr!r}"
        ) from None


@dataclass(frozen=True)
class DiscoveryLimits:
    """What one name may bring into a pool: at most `max_workers` addresses, and only those in
    `allow` (any address when empty)."""

    max_workers: int = MAX_WORKERS
    allow: tuple[str, ...] = ()  # CIDRs

    def __post_init__(self) -> None:
        if self.max_workers < 1:
            raise ValueError(f"discovery_max_workers must be >= 1, got {self.max_workers}")
        for cidr in self.allow:
            parse_network(cidr)

    @cached_property
    def networks(self) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
        return [parse_network(cidr) for cidr in self.allow]

    def is_allowed(self, address: str) -> bool:
        ip = ipaddress.ip_address(address)
        return not self.allow or any(ip in network for network in self.networks)

    def admit(self, addresses: set[str]) -> tuple[list[str], list[str], list[str]]:
        """(admitted, outside `allow`, beyond `max_workers`): the lowest addresses are kept,
        the same in every process that sees the same answer."""
        allowed = sorted((a for a in addresses if self.is_allowed(a)), key=_address_order)
        denied = sorted(addresses.difference(allowed), key=_address_order)
        return allowed[: self.max_workers], denied, allowed[self.max_workers :]


@dataclass(frozen=True)
class DnsName:
    """`dns://NAME:PORT`: the workers at PORT on every address of NAME, within `limits`."""

    host: str
    port: int
    limits: DiscoveryLimits = field(default=DiscoveryLimits(), compare=False)

    @classmethod
    def parse(cls, entry: str, limits: DiscoveryLimits | None = None) -> DnsName:
        try:
            parts = urlsplit(entry)
            host, port = parts.hostname, parts.port
            if parts.scheme != "dns" or not host or ":" in host or not port:
                raise ValueError("a name and a port are needed")
            if parts.path or parts.query or parts.fragment or parts.username:
                raise ValueError("nothing after the port")
            dns.name.from_text(host)  # a label too long, an empty label, ...
        except (ValueError, dns.exception.DNSException) as e:
            raise ValueError(f"expected dns://NAME:PORT, got {entry!r} ({e})") from None
        return cls(host, port, limits or DiscoveryLimits())

    @property
    def label(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def source(self) -> str:
        return f"{SCHEME}{self.label}"

    def url(self, address: str) -> str:
        is_v6 = ipaddress.ip_address(address).version == 6
        return f"http://[{address}]:{self.port}" if is_v6 else f"http://{address}:{self.port}"


def is_dns_entry(entry: str) -> bool:
    return entry.startswith(SCHEME)


def parse_dns_server(text: str) -> tuple[str, int]:
    """`HOST[:PORT]` or `[V6][:PORT]`, HOST an IP address → (address, port); port 53 if absent."""
    host, port = text, "53"
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"dns_server: expected [ADDRESS]:PORT, got {text!r}")
        port = rest[1:] or port
    elif text.count(":") == 1:
        host, port = text.split(":")
    try:
        address, number = str(ipaddress.ip_address(host)), int(port)
    except ValueError:
        raise ValueError(f"dns_server: expected IP[:PORT], got {text!r}") from None
    if not 0 < number < 65536:
        raise ValueError(f"dns_server: port out of range in {text!r}")
    return address, number


def make_resolver(server: tuple[str, int] | None) -> dns.asyncresolver.Resolver:
    """The system's resolver, its search list and `ndots` applied as the C library would
    (NoResolverConfiguration without /etc/resolv.conf); or one that asks only `server`, for
    NAME as an absolute name."""
    if server is None:
        resolver = dns.asyncresolver.Resolver()
        resolver.use_search_by_default = True  # e.g. a Kubernetes service's short name
        return resolver
    resolver = dns.asyncresolver.Resolver(configure=False)
    resolver.nameservers = [dns.nameserver.Do53Nameserver(*server)]
    return resolver


class Membership(Protocol):
    """What discovery needs from the proxy (proxy/state.py's `Proxy`)."""

    def members(self, role: str, source: str) -> list[Worker]: ...

    def find_worker(self, url: str) -> Worker | None: ...

    async def admit_worker(self, role: str, url: str, source: str) -> Worker: ...

    async def retire_worker(self, worker: Worker) -> None: ...


class DnsDiscovery:
    """One `dns://NAME:PORT` entry of one pool, resolved every `interval` seconds."""

    def __init__(
        self,
        role: str,
        name: DnsName,
        resolver: dns.asyncresolver.Resolver,
        interval: float,
        membership: Membership,
        metrics: ProxyMetrics,
    ):
        self.role = role
        self.name = name
        self.resolver = resolver
        self.interval = interval
        self.membership = membership
        self.num_resolved = metrics.discovered.labels(role, name.label)
        self.errors = metrics.discovery_errors
        self.failing: str | None = None  # why the last resolution failed; None when it did not
        self.failing_families: dict[str, str | None] = {}  # the same, by family alone
        self._addresses: dict[str, set[str]] = {family: set() for family in FAMILIES}
        self._urls: set[str] = set()  # the last good answer, admitted
        self._leaving: dict[Worker, asyncio.Task] = {}
        self._task: asyncio.Task | None = None
        self._is_stopping = False

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        # NOTE: a flag as well as the cancel: Python 3.11's asyncio.wait_for, which dnspython
        # awaits, swallows a cancel that arrives as the answer does (fixed in 3.12)
        self._is_stopping = True
        tasks = [t for t in (self._task, *self._leaving.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self) -> None:
        while not self._is_stopping:
            await asyncio.sleep(self.interval)
            await self.refresh()

    async def refresh(self) -> None:
        """Resolve once and make the pool follow; on failure keep the last good set, and for a
        family that failed its last good addresses."""
        results = await asyncio.gather(*(self._resolve(family) for family in FAMILIES))
        if self._is_stopping:
            return
        answers = dict(zip(FAMILIES, results, strict=True))
        failed = {f: e for f, e in answers.items() if isinstance(e, Exception)}
        if len(failed) == len(FAMILIES):
            self._failed(failed[FAMILIES[0]])
            return
        addresses = {f: self._addresses[f] if f in failed else a for f, a in answers.items()}
        if not any(addresses.values()):
            self._failed(dns.resolver.NoAnswer())  # as the name had no address at all
            return
        if self.failing is not None:
            logger.warning("%s (%s) resolves again", self.name.source, self.role)
            self.failing = None
        self._families_failed(failed)
        is_new = addresses != self._addresses
        self._addresses = addresses
        urls = self._admitted(set().union(*addresses.values()), is_new)
        if is_new:
            logger.info("%s (%s) resolves to %s", self.name.source, self.role, sorted(urls))
        self._urls = urls
        self.num_resolved.set(len(urls))
        await self._follow(urls, is_new)

    async def _resolve(self, family: str) -> set[str] | Exception:
        """The family's addresses (empty when the name has none of it), or why it failed."""
        try:
            answer = await self.resolver.resolve(
                self.name.host, family, raise_on_no_answer=False, lifetime=RESOLVE_TIMEOUT_S
            )
        except (dns.exception.DNSException, OSError) as e:
            return e
        return {record.address for record in answer}

    def _failed(self, e: Exception) -> None:
        reason = _reason(e)
        self.errors.labels(self.role, self.name.label, reason).inc()
        if self.failing != reason:
            logger.warning(
                "%s (%s) did not resolve (%s: %s); keeping the last good set of %d workers",
                self.name.source, self.role, reason, e, len(self._urls),
            )  # fmt: skip
        self.failing = reason

    def _families_failed(self, failed: dict[str, Exception]) -> None:
        """One family failed, the other answered: counted, logged when its reason changes."""
        for family in FAMILIES:
            e = failed.get(family)
            reason = None if e is None else _reason(e)
            if reason is not None:
                self.errors.labels(self.role, self.name.label, reason).inc()
            if reason != self.failing_families.get(family):
                self._log_family(family, reason, e)
            self.failing_families[family] = reason

    def _log_family(self, family: str, reason: str | None, e: Exception | None) -> None:
        if reason is None:
            logger.warning("%s (%s): %s resolves again", self.name.source, self.role, family)
            return
        logger.warning(
            "%s (%s): %s did not resolve (%s: %s); using the other family's answer and %s's "
            "last good %d addresses",
            self.name.source, self.role, family, reason, e, family,
            len(self._addresses[family]),
        )  # fmt: skip

    def _admitted(self, addresses: set[str], is_new: bool) -> set[str]:
        """The URLs of the addresses within the name's limits; what is left out is logged when
        the answer changes."""
        admitted, denied, beyond = self.name.limits.admit(addresses)
        if is_new and denied:
            logger.warning(
                "%s (%s): dropped %s, outside --discovery-allow %s",
                self.name.source, self.role, denied, list(self.name.limits.allow),
            )  # fmt: skip
        if is_new and beyond:
            logger.warning(
                "%s (%s): %d addresses, kept the lowest %d (--discovery-max-workers); "
                "left out %s",
                self.name.source, self.role, len(admitted) + len(beyond), len(admitted), beyond,
            )  # fmt: skip
        return {self.name.url(address) for address in admitted}

    async def _follow(self, urls: set[str], is_new: bool) -> None:
        mine = {w.url: w for w in self.membership.members(self.role, self.name.source)}
        for url, worker in mine.items():
            if url in urls and worker in self._leaving:
                self._leaving.pop(worker).cancel()
                worker.is_draining = False
                logger.warning("%s worker %s resolves again: not draining", self.role, url)
            elif url not in urls and worker not in self._leaving:
                worker.is_draining = True  # now: no request is routed to it from here on
                self._leaving[worker] = asyncio.create_task(self._leave(worker))
        joining = []
        for url in sorted(urls - mine.keys()):
            other = self.membership.find_worker(url)
            if other is None:
                joining.append(url)
            elif is_new:  # NOTE: logged when the answer changes, not at each resolution
                logger.warning(
                    "%s: %s is already a worker (%s)", self.name.source, url, other.source
                )
        await asyncio.gather(
            *(self.membership.admit_worker(self.role, url, self.name.source) for url in joining)
        )

    async def _leave(self, worker: Worker) -> None:
        logger.warning("%s worker %s no longer resolves: draining", self.role, worker.url)
        try:
            await self.membership.retire_worker(worker)
            logger.warning("%s worker %s drained and dropped", self.role, worker.url)
        finally:
            if self._leaving.get(worker) is asyncio.current_task():
                del self._leaving[worker]


def _address_order(address: str) -> tuple[int, int]:
    ip = ipaddress.ip_address(address)
    return ip.version, int(ip)


def _reason(e: Exception) -> str:
    if isinstance(e, dns.resolver.NXDOMAIN):
        return "nxdomain"
    if isinstance(e, dns.resolver.NoAnswer):
        return "no_answer"
    if isinstance(e, dns.exception.Timeout):
        return "timeout"
    if isinstance(e, dns.resolver.NoNameservers):
        return "no_nameservers"
    return "error"
