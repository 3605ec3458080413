"""A real DNS server for tests: dnsmasq on a free loopback port, answering one name from a hosts
file that the test rewrites (`set_addresses`: the file, then SIGHUP, which makes dnsmasq read it
again). The name's domain is `--local`: a name missing from the file is NXDOMAIN, never asked
upstream. Not installed is a test failure, not a skip: deploy/setup.sh installs it.
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
    def __init__(self, folder: Path, name: str, addresses: list[str]):
        self.binary = find_dnsmasq()
        self.folder = folder
        self.name = name
        self.hosts = folder / "hosts"
        self.log_path = folder / "dnsmasq.log"
        self.port = free_udp_tcp_port()
        self.proc: subprocess.Popen | None = None
        self._write(addresses)
        self.start()

    @property
    def server(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        domain = self.name.split(".", 1)[1]
        cmd = [
            self.binary, "--keep-in-foreground", f"--port={self.port}",
            "--listen-address=127.0.0.1", "--bind-interfaces", "--no-resolv", "--no-hosts",
            f"--addn-hosts={self.hosts}", f"--local=/{domain}/",
            f"--pid-file={self.folder / 'dnsmasq.pid'}", "--log-facility=-", "--log-queries",
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

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def _answers(self) -> bool:
        try:
            self.resolve()
            return True
        except dns.exception.DNSException:
            return False

    def _write(self, addresses: list[str]) -> None:
        tmp = self.hosts.with_suffix(".tmp")
        tmp.write_text("".join(f"{a} {self.name}\n" for a in addresses))
        tmp.replace(self.hosts)  # NOTE: atomic, so a reload never reads half a file
