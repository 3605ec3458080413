"""Discovery by DNS (`--decode dns://NAME:PORT`) against a real DNS server: dnsmasq on loopback
answers NAME from a hosts file the tests rewrite, and stub decode workers listen on 127.0.0.2,
127.0.0.3, ... at one shared port. The proxy starts with every address NAME resolves to (and
static and admin-added workers beside them, each listed with its source); a new address gets
traffic within two discovery intervals; a vanished one is drained under load, no request lost,
then dropped and its connections closed; a name that stops resolving keeps its last good set
and says so in the log and in /metrics; a server that fails one address family (REFUSED or
SERVFAIL for AAAA) still brings the other's workers; what a name may bring is bounded by
`--discovery-max-workers` and `--discovery-allow`. Every wait has a deadline; nothing is
asserted right after an action."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
import threading

import dns.resolver
import httpx
import pytest

from proxy.config import build_parser, from_dict, parse_args
from proxy.discovery import MAX_WORKERS, RESOLVE_TIMEOUT_S, DnsName, parse_dns_server
from proxy.state import Proxy
from tests.dnsmasq import MISSING, Dnsmasq
from tests.servers import ServerProcess, free_port, wait_until
from tests.stub_worker import StubWorkers

NAME = "workers.pdserve.test"
HOSTS = ["127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5", "127.0.0.6"]
INTERVAL = 0.5  # --discovery-interval
SLACK_S = 1.5  # a busy 2-core machine: a resolution, a health check, scheduling
KEY = "admin-secret"
DISCOVERED = "pdserve_proxy_discovered_workers"
ERRORS = "pdserve_proxy_discovery_errors_total"
LABEL = re.compile(r'(\w+)="([^"]*)"')


@pytest.fixture(scope="module")
def stubs(tmp_path_factory):
    log = tmp_path_factory.mktemp("stubs") / "stubs.log"
    workers = StubWorkers(HOSTS, free_port(), log).wait_ready()
    yield workers
    workers.stop()


@pytest.fixture
def cluster(tmp_path, stubs):
    """cluster(addresses, *proxy_args) → (dnsmasq answering NAME with them, a ready proxy)."""
    started: list = []

    def start(addresses: list[str], *args: str, missing: str = "nodata"):
        dnsmasq = Dnsmasq(tmp_path, NAME, addresses, missing)
        started.append(dnsmasq)
        proxy = ServerProcess(
            "proxy",
            ["--mode", "colocated", "--decode", f"dns://{NAME}:{stubs.port}",
             "--dns-server", dnsmasq.server, "--discovery-interval", str(INTERVAL),
             "--decode-policy", "round_robin", "--health-interval", "0.5", "--admin-key", KEY,
             *args],
            tmp_path / "proxy.log",
        )  # fmt: skip
        started.append(proxy)
        return dnsmasq, proxy.wait_ready(timeout=60, path="/ready")

    yield start
    for process in reversed(started):
        process.stop()


def workers(proxy) -> dict[str, dict]:
    r = httpx.get(f"{proxy.url}/admin/workers", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200, r.text
    return {w["url"]: w for w in r.json()["workers"]}


def complete(proxy) -> str:
    """One request through the proxy; the address of the stub that served it."""
    r = httpx.post(f"{proxy.url}/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"].strip()


def metric_sum(proxy, metric: str, **labels: str) -> float:
    """The sum of `metric`'s samples in /metrics whose labels include `labels`."""
    total = 0.0
    for line in httpx.get(f"{proxy.url}/metrics", timeout=5).text.splitlines():
        sample, _, value = line.rpartition(" ")
        sample_name, _, rest = sample.partition("{")
        if sample_name == metric and labels.items() <= dict(LABEL.findall(rest)).items():
            total += float(value)
    return total


def open_connections_to(host: str, port: int) -> int:
    """Client-side TCP sockets to host:port still open (established, or closed by the peer
    but not yet by their owner), from /proc/net/tcp."""
    remote = f"{socket.inet_aton(host)[::-1].hex().upper()}:{port:04X}"
    with open("/proc/net/tcp") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    return sum(
        row[2] == remote and row[3] in ("01", "08") for row in rows
    )  # ESTABLISHED, CLOSE_WAIT


class Stream(threading.Thread):
    """One streamed completion read to its end; `host` is known after the first chunk."""

    def __init__(self, proxy, max_tokens: int):
        super().__init__(daemon=True)
        self.max_tokens = max_tokens
        self.client = httpx.Client(timeout=30)
        body = {"prompt": "hi", "max_tokens": max_tokens, "stream": True}
        self.response = self.client.send(
            self.client.build_request("POST", f"{proxy.url}/v1/completions", json=body),
            stream=True,
        )
        self.lines = (line for line in self.response.iter_lines() if line)
        self.events = [next(self.lines)] if self.response.status_code == 200 else []
        self.host = (
            json.loads(self.events[0][6:])["choices"][0]["text"].strip() if self.events else None
        )

    def run(self) -> None:
        try:
            self.events.extend(self.lines)
        except httpx.HTTPError as e:
            self.events.append(f"error: {e!r}")
        finally:
            self.response.close()
            self.client.close()

    @property
    def is_complete(self) -> bool:
        ok = self.response.status_code == 200 and self.events[-1:] == ["data: [DONE]"]
        return (
            ok and len(self.events) == self.max_tokens + 1 and "error" not in "".join(self.events)
        )


class Load(threading.Thread):
    """Streamed requests back to back from `num_clients` threads until stopped."""

    def __init__(self, proxy, num_clients: int = 4, max_tokens: int = 10):
        super().__init__(daemon=True)
        self.proxy, self.num_clients, self.max_tokens = proxy, num_clients, max_tokens
        self.completed: list[str] = []
        self.failed: list[str] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        clients = [threading.Thread(target=self._client) for _ in range(self.num_clients)]
        for c in clients:
            c.start()
        for c in clients:
            c.join()

    def _client(self) -> None:
        while not self.stopping.is_set():
            try:
                stream = Stream(self.proxy, self.max_tokens)
                stream.run()
            except Exception as e:  # noqa: BLE001 — whatever it was, it is a failed request
                self.failed.append(repr(e))
                continue
            if stream.is_complete:
                self.completed.append(stream.host)
            else:
                self.failed.append(f"{stream.response.status_code}: {stream.events[-2:]}")

    def stop(self) -> None:
        self.stopping.set()
        self.join(60)


def stream_on(proxy, host: str, max_tokens: int) -> Stream:
    """A stream the worker at `host` serves: round robin reaches it within a turn of the pool
    when nothing else is routed meanwhile."""
    for _ in range(len(HOSTS)):
        stream = Stream(proxy, max_tokens)
        if stream.host == host:
            return stream
        stream.response.close()
        stream.client.close()
    raise AssertionError(f"no stream reached {host}")


def test_dns_entries_and_servers_parse():
    name = DnsName.parse("dns://pdserve-decode:8200")
    assert (name.host, name.port, name.source) == ("pdserve-decode", 8200, name.source)
    assert name.url("10.0.0.7") == "http://10.0.0.7:8200"
    assert name.url("fd00::7") == "http://[fd00::7]:8200"
    for bad in ("dns://pdserve-decode", "dns://:8200", "dns://a:8200/x", "dns://a:0", "dns://a:x"):
        with pytest.raises(ValueError, match="dns://NAME:PORT"):
            DnsName.parse(bad)
    assert parse_dns_server("10.0.0.2") == ("10.0.0.2", 53)
    assert parse_dns_server("127.0.0.1:5353") == ("127.0.0.1", 5353)
    assert parse_dns_server("[::1]:5353") == ("::1", 5353) and parse_dns_server("::1")[1] == 53
    for bad in ("dns.example:53", "127.0.0.1:99999", "[::1"):
        with pytest.raises(ValueError, match="dns_server"):
            parse_dns_server(bad)
    cfg = from_dict({"decode": ["dns://d:8200", "http://d0:8200"], "dns-server": "10.0.0.2"})
    assert [n.label for n in cfg.dns_names("decode")] == ["d:8200"]
    assert cfg.static_urls("decode") == ["http://d0:8200"]
    with pytest.raises(ValueError, match="twice"):
        from_dict({"decode": ["dns://d:8200", "dns://d:8200"]})


class Scripted:
    """A resolver answering each family from the test's script: a list of addresses (the
    records, read at each call), or an exception to raise."""

    def __init__(self, script: dict[str, list[str] | Exception]):
        self.script = script

    async def resolve(self, name, family, raise_on_no_answer, lifetime):
        answer = self.script[family]
        if isinstance(answer, Exception):
            raise answer
        return [type("Record", (), {"address": address}) for address in answer]


def test_an_address_back_while_draining_is_kept_and_a_gone_one_dropped_once_idle():
    """The pool's side of discovery on its own, with a scripted resolver: a worker comes back
    while it drains, leaves for good once idle; a static worker at a resolved address is left
    alone."""

    async def scenario():
        static = "http://127.0.0.4:9"
        cfg = {"decode": ["dns://w:9", static], "dns_server": "127.0.0.1:1"}
        proxy = Proxy(from_dict({**cfg, "health": {"timeout": 0.2}}))
        proxy.add_worker("decode", static)
        discovery = proxy.discoveries[0]
        answer: list[str] = []

        discovery.resolver = Scripted({"A": answer, "AAAA": []})
        answer[:] = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
        await discovery.refresh()
        a, b, c = (proxy.pools["decode"].get(f"http://{h}:9") for h in answer)
        assert a.source == b.source == "dns://w:9" and c.source == "static"
        a.num_outstanding = 1  # a request is running on it
        answer[:] = ["127.0.0.3"]
        await discovery.refresh()
        assert a.is_draining and proxy.pools["decode"].get(a.url) is a
        answer[:] = ["127.0.0.2", "127.0.0.3"]
        await discovery.refresh()  # back before it was idle: it stays, routable again
        assert not a.is_draining and proxy.pools["decode"].get(a.url) is a
        answer[:] = ["127.0.0.3"]
        await discovery.refresh()
        await asyncio.sleep(0.2)
        assert proxy.pools["decode"].get(a.url) is a and not a.client.is_closed
        a.num_outstanding = 0
        for _ in range(100):  # NOTE: dropped by a background task: wait for it, 2 s at most
            if a.client.is_closed:
                break
            await asyncio.sleep(0.02)
        assert proxy.pools["decode"].get(a.url) is None and a.client.is_closed
        assert proxy.pools["decode"].workers == [c, b] and not c.is_draining
        await proxy.stop()

    asyncio.run(scenario())


def test_the_proxy_starts_with_every_address_beside_static_and_admin_workers(cluster, stubs):
    static = stubs.url_of(HOSTS[4])
    dnsmasq, proxy = cluster(HOSTS[:3], "--decode", static)
    source = f"dns://{NAME}:{stubs.port}"
    expected = {**{stubs.url_of(h): source for h in HOSTS[:3]}, static: "static"}
    assert {url: w["source"] for url, w in workers(proxy).items()} == expected
    assert wait_until(lambda: all(w["healthy"] for w in workers(proxy).values()))
    added = httpx.post(
        f"{proxy.url}/admin/workers",
        json={"role": "decode", "url": stubs.url_of(HOSTS[3])},
        headers={"Authorization": f"Bearer {KEY}"},
    )
    assert added.status_code == 200 and added.json()["source"] == "admin"
    assert wait_until(lambda: all(w["healthy"] for w in workers(proxy).values()))
    assert sorted(complete(proxy) for _ in range(10)) == sorted(HOSTS[:5] * 2)  # round robin
    assert metric_sum(proxy, DISCOVERED) == 3
    assert metric_sum(proxy, ERRORS) == 0


def test_a_new_address_gets_traffic_within_two_intervals(cluster, stubs):
    dnsmasq, proxy = cluster(HOSTS[:3])
    new = stubs.url_of(HOSTS[3])
    served = stubs.served(HOSTS[3])
    dnsmasq.set_addresses(HOSTS[:4])
    joined = lambda: workers(proxy).get(new, {}).get("healthy")  # noqa: E731
    assert wait_until(joined, timeout=2 * INTERVAL + SLACK_S, interval=0.05)
    assert sorted(complete(proxy) for _ in range(8)) == sorted(HOSTS[:4] * 2)  # round robin
    assert stubs.served(HOSTS[3]) == served + 2
    assert metric_sum(proxy, DISCOVERED) == 4


def test_a_vanished_address_drains_under_load_then_is_dropped(cluster, stubs):
    dnsmasq, proxy = cluster(HOSTS[:3])
    gone = stubs.url_of(HOSTS[1])
    pinned = stream_on(proxy, HOSTS[1], 60)
    pinned.start()  # 3 s of stream on the worker about to vanish
    load = Load(proxy)
    load.start()
    dnsmasq.set_addresses([HOSTS[0], HOSTS[2]])
    assert wait_until(lambda: workers(proxy).get(gone, {}).get("draining"), interval=0.05)
    assert pinned.is_alive() and workers(proxy)[gone]["outstanding"] >= 1
    assert wait_until(lambda: gone not in workers(proxy), timeout=10)
    pinned.join(10)
    assert pinned.is_complete, pinned.events[-3:]  # the in-flight stream finished whole
    assert wait_until(lambda: open_connections_to(HOSTS[1], stubs.port) == 0, timeout=5)
    served = stubs.served(HOSTS[1])
    num_completed = len(load.completed)
    assert wait_until(lambda: len(load.completed) >= num_completed + 8)
    load.stop()
    assert not load.failed and len(load.completed) >= 8
    assert stubs.served(HOSTS[1]) == served  # nothing routed to it once dropped
    assert stubs.stats()[HOSTS[1]]["running"] == 0
    assert set(workers(proxy)) == {stubs.url_of(HOSTS[0]), stubs.url_of(HOSTS[2])}
    assert metric_sum(proxy, DISCOVERED) == 2
    log = proxy.log_path.read_text()
    assert log.index(f"{gone} no longer resolves: draining") < log.index(f"{gone} drained and")


def test_a_name_that_stops_resolving_keeps_its_last_good_set(cluster, stubs):
    dnsmasq, proxy = cluster(HOSTS[:3])
    urls = {stubs.url_of(h) for h in HOSTS[:3]}
    name = f"{NAME}:{stubs.port}"
    dnsmasq.set_addresses([])  # NXDOMAIN
    assert wait_until(lambda: metric_sum(proxy, ERRORS, name=name, reason="nxdomain") >= 3)
    dnsmasq.stop()  # no answer at all: each resolution times out

    def timeouts() -> float:
        return metric_sum(proxy, ERRORS, role="decode", name=name, reason="timeout")

    assert wait_until(lambda: timeouts() >= 1, timeout=2 * (RESOLVE_TIMEOUT_S + INTERVAL) + SLACK_S)
    listed = workers(proxy)
    assert set(listed) == urls and all(w["healthy"] and not w["draining"] for w in listed.values())
    assert sorted(complete(proxy) for _ in range(6)) == sorted(HOSTS[:3] * 2)
    assert metric_sum(proxy, DISCOVERED) == 3
    assert metric_sum(proxy, ERRORS, role="decode", name=name) >= 3 + 1
    log = proxy.log_path.read_text()
    failures = [line for line in log.splitlines() if "did not resolve" in line]
    assert len(failures) == 2, failures  # once per reason, not once per resolution
    assert "(nxdomain" in failures[0] and "(timeout" in failures[1]
    assert all("keeping the last good set of 3 workers" in line for line in failures)


@pytest.mark.parametrize("missing", MISSING)
def test_one_family_failing_keeps_the_other(tmp_path, caplog, missing):
    """dnsmasq answers NAME's A records and, for AAAA, NOERROR with no data, REFUSED or
    SERVFAIL: the A records' workers join, and follow the name as it changes."""
    dnsmasq = Dnsmasq(tmp_path, NAME, HOSTS[:2], missing)

    async def scenario() -> None:
        cfg = {"decode": [f"dns://{NAME}:9"], "dns_server": dnsmasq.server}
        proxy = Proxy(from_dict({**cfg, "health": {"timeout": 0.2}}))
        discovery = proxy.discoveries[0]
        await discovery.refresh()
        await discovery.refresh()
        members = lambda: {w.url for w in proxy.pools["decode"].workers}  # noqa: E731
        assert members() == {f"http://{h}:9" for h in HOSTS[:2]} and discovery.failing is None
        dnsmasq.set_addresses(HOSTS[1:4])
        assert wait_until(lambda: dnsmasq.resolve() == set(HOSTS[1:4]), timeout=10)
        await discovery.refresh()
        assert members() == {f"http://{h}:9" for h in HOSTS[1:4]}
        errors = proxy.metrics.discovery_errors.labels("decode", f"{NAME}:9", "no_nameservers")
        assert errors._value.get() == (0 if missing == "nodata" else 3)
        await proxy.stop()

    try:
        with caplog.at_level(logging.WARNING, logger="proxy.discovery"):
            asyncio.run(scenario())
    finally:
        dnsmasq.stop()
    family_failed = [r.message for r in caplog.records if "AAAA did not resolve" in r.message]
    if missing == "nodata":
        assert not family_failed
    else:  # logged once, with the server's answer
        assert len(family_failed) == 1 and missing.upper() in family_failed[0], family_failed


def test_both_families_failing_keeps_the_last_good_set_and_a_family_comes_back(caplog):
    async def scenario() -> None:
        proxy = Proxy(from_dict({"decode": ["dns://w:9"], "health": {"timeout": 0.2}}))
        discovery = proxy.discoveries[0]
        v4, v6 = ["127.0.0.2"], ["::1"]
        discovery.resolver = resolver = Scripted({"A": v4, "AAAA": v6})
        await discovery.refresh()
        urls = {"http://127.0.0.2:9", "http://[::1]:9"}
        assert {w.url for w in proxy.pools["decode"].workers} == urls
        resolver.script["AAAA"] = dns.resolver.NoNameservers()
        v4.append("127.0.0.3")
        await discovery.refresh()  # A followed, AAAA's last good kept
        assert {w.url for w in proxy.pools["decode"].workers} == urls | {"http://127.0.0.3:9"}
        resolver.script["A"] = dns.resolver.NXDOMAIN()
        await discovery.refresh()  # nothing answered: nothing changes
        assert len(proxy.pools["decode"].workers) == 3 and discovery.failing == "nxdomain"
        resolver.script.update(A=[], AAAA=[])
        await discovery.refresh()  # no address at all: as no answer
        assert len(proxy.pools["decode"].workers) == 3 and discovery.failing == "no_answer"
        resolver.script.update(A=["127.0.0.2"], AAAA=v6)
        await discovery.refresh()  # 127.0.0.3 gone: drained
        assert {w.url for w in proxy.pools["decode"].workers if not w.is_draining} == urls
        await proxy.stop()

    with caplog.at_level(logging.WARNING, logger="proxy.discovery"):
        asyncio.run(scenario())
    log = [r.message for r in caplog.records]
    assert any("AAAA did not resolve (no_nameservers" in line for line in log), log
    assert any("AAAA resolves again" in line for line in log), log


def test_a_name_brings_at_most_max_workers_and_only_allowed_addresses(caplog):
    async def scenario() -> None:
        cfg = {
            "decode": ["dns://w:9"],
            "discovery_max_workers": 3,
            "discovery_allow": ["127.0.0.0/8", "fd00::/64"],
            "health": {"timeout": 0.2},
        }
        proxy = Proxy(from_dict(cfg))
        discovery = proxy.discoveries[0]
        a = ["127.0.0.9", "10.1.2.3", "127.0.0.10", "127.0.0.2", "192.0.2.1"]
        aaaa = ["fd00::5", "fd01::1"]
        discovery.resolver = Scripted({"A": a, "AAAA": aaaa})
        await discovery.refresh()
        kept = {"http://127.0.0.2:9", "http://127.0.0.9:9", "http://127.0.0.10:9"}
        assert {w.url for w in proxy.pools["decode"].workers} == kept  # the lowest, v4 first
        a.remove("127.0.0.9")
        await discovery.refresh()  # room for the next one
        kept = {"http://127.0.0.2:9", "http://127.0.0.10:9", "http://[fd00::5]:9"}
        assert {w.url for w in proxy.pools["decode"].workers if not w.is_draining} == kept
        assert proxy.metrics.discovered.labels("decode", "w:9")._value.get() == 3
        await discovery.refresh()  # the same answer: nothing logged again
        await proxy.stop()

    with caplog.at_level(logging.WARNING, logger="proxy.discovery"):
        asyncio.run(scenario())
    denied = [r.message for r in caplog.records if "outside --discovery-allow" in r.message]
    beyond = [r.message for r in caplog.records if "--discovery-max-workers" in r.message]
    assert len(denied) == 2 and "'10.1.2.3', '192.0.2.1', 'fd01::1'" in denied[0], denied
    assert len(beyond) == 1 and "left out ['fd00::5']" in beyond[0], beyond


def test_discovery_limit_flags():
    cfg = parse_args(
        ["--decode", "dns://d:1", "--discovery-max-workers", "8",
         "--discovery-allow", "10.0.0.0/8", "--discovery-allow", "fd00::/8"]
    )  # fmt: skip
    limits = cfg.dns_names("decode")[0].limits
    assert (limits.max_workers, limits.allow) == (8, ("10.0.0.0/8", "fd00::/8"))
    assert from_dict({"decode": ["dns://d:1"]}).discovery_limits.max_workers == MAX_WORKERS
    assert from_dict({"decode": ["dns://d:1"], "discovery_allow": "10.0.0.0/8"}).discovery_allow
    for bad in ({"discovery_max_workers": 0}, {"discovery_allow": ["10.0.0.0/33"]}):
        with pytest.raises(ValueError, match="discovery_"):
            from_dict({"decode": ["dns://d:1"], **bad})
    text = " ".join(build_parser().format_help().split())
    assert "--discovery-max-workers" in text and "--discovery-allow CIDR" in text


def test_the_proxy_routes_to_the_a_records_when_aaaa_is_refused(cluster, stubs):
    dnsmasq, proxy = cluster(HOSTS[:2], missing="refused")
    assert set(workers(proxy)) == {stubs.url_of(h) for h in HOSTS[:2]}
    assert wait_until(lambda: all(w["healthy"] for w in workers(proxy).values()))
    assert sorted(complete(proxy) for _ in range(4)) == sorted(HOSTS[:2] * 2)
    name = f"{NAME}:{stubs.port}"
    assert metric_sum(proxy, ERRORS, name=name, reason="no_nameservers") >= 1
    assert metric_sum(proxy, DISCOVERED) == 2
