"""A real DNS server for tests: dnsmasq on a free loopback port, answering one name from a hosts
file that the test rewrites (`set_addresses`: the file, then SIGHUP, which makes dnsmasq read it
again). Not installed is a test failure, not a skip: deploy/setup.sh installs it.

What it answers for a record type the file lacks (AAAA, for IPv4 addresses) is `missing`:

- `nodata` (the default): the name's domain is `--local`, so a type missing is NOERROR with no
  answer, and a name missing is NXDOMAIN, never asked upstream;
- `refused`: no `--local` and no upstream server: REFUSED, as a dnsmasq set up without
  `--local` answers;
- `servfail`: dnsmasq validates DNSSEC and forwards what the file lacks to a second dnsmasq
  (the `--local` one) that cannot prove the zone unsigned: SERVFAIL, as a validating resolver
  answers when it cannot validate.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
from pathlib import Path

import dns.exception
import dns.resolver
import pytest

from deploy.processes import free_port, wait_until

SBIN = ("/usr/sbin", "/sbin", "/usr/local/sbin")  # not on a plain user's PATH
MISSING = ("nodata", "refused", "servfail")
ROOT_ANCHOR = ".,20326,8,2,E06D44B80B8F1D39A95C0B0D7C65D08458E880409BBC683457104237C7F8EC8D"


def find_dnsmasq() -> str:
    path = shutil.which("dnsmasq") or shutil.which("dnsmasq", path=os.pathsep.join(SBIN))
    if path is None:
        pytest.fail(
            "dnsmasq is not installed: run deploy/setup.sh, or apt-get install dnsmasq-base",
            pytrace=False,
        )
    return path


def free_udp_tcp_port() -> int:
    """A loopback port free for TCP and for UDP (dnsmasq listens on both)."""
    for _ in range(100):
        port = free_port()
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            try:
                udp.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError("no free loopback port for both TCP and UDP")


class Dnsmasq:
    def __init__(self, folder: Path, name: str, addresses: list[str], missing: str = "nodata"):
        assert missing in MISSING, f"missing is one of {MISSING}, got {missing!r}"
        self.binary = find_dnsmasq()
        self.folder = folder
        self.name = name
        self.missing = missing
        self.hosts = folder / "hosts"
        self.log_path = folder / "dnsmasq.log"
        self.port = free_udp_tcp_port()
        self.proc: subprocess.Popen | None = None
        self.upstream: Dnsmasq | None = None  # the zone's server, for `servfail`
        self._write(addresses)
        if missing == "servfail":
            self.upstream = Dnsmasq(folder / "upstream", name, addresses)
        self.start()

    @property
    def server(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        cmd = [
            self.binary, "--keep-in-foreground", f"--port={self.port}",
            "--listen-address=127.0.0.1", "--bind-interfaces", "--no-resolv", "--no-hosts",
            f"--addn-hosts={self.hosts}", f"--pid-file={self.folder / 'dnsmasq.pid'}",
            "--log-facility=-", "--log-queries", *self._missing_args(),
        ]  # fmt: skip
        if os.geteuid() == 0:  # else it drops to `nobody`, who cannot read a private tmp dir
            cmd.append("--user=root")
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        if not wait_until(self._answers, timeout=10):
            raise RuntimeError(f"dnsmasq did not answer:\n{self.log()}")

    def set_addresses(self, addresses: list[str]) -> None:
        assert self.proc is not None and self.proc.poll() is None, "dnsmasq is not running"
        self._write(addresses)
        self.proc.send_signal(signal.SIGHUP)

    def resolve(self) -> set[str]:
        """The name's A records as dnsmasq answers them now (empty when NXDOMAIN)."""
        resolver = dns.resolver.Resolver(configure=False)
        resolver.nameservers, resolver.port = ["127.0.0.1"], self.port
        try:
            return {r.address for r in resolver.resolve(self.name, "A", lifetime=1)}
        except dns.resolver.NXDOMAIN:
            return set()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        if self.upstream is not None:
            self.upstream.stop()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def _missing_args(self) -> list[str]:
        if self.missing == "nodata":
            return [f"--local=/{self.name.split('.', 1)[1]}/"]
        if self.missing == "refused":
            return []
        assert self.upstream is not None
        return [
            "--dnssec",
            f"--trust-anchor={ROOT_ANCHOR}",
            f"--server=127.0.0.1#{self.upstream.port}",
        ]

    def _answers(self) -> bool:
        try:
            self.resolve()
            return True
        except dns.exception.DNSException:
            return False

    def _write(self, addresses: list[str]) -> None:
        self.folder.mkdir(exist_ok=True)
        tmp = self.hosts.with_suffix(".tmp")
        tmp.write_text("".join(f"{a} {self.name}\n" for a in addresses))
        tmp.replace(self.hosts)  # NOTE: atomic, so a reload never reads half a file
