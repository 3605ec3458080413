"""`--kv-host auto`: the address a worker advertises to its peers, found at start-up.

In a container bound to 0.0.0.0 that is the container's IP (its hostname resolved), which is what
lets every replica of a scaled compose service advertise its own address (deploy/compose.py).
"""

from __future__ import annotations

import socket

import pytest

from common.api.cli import parse_args, resolve_kv_host


@pytest.fixture
def container(monkeypatch):
    """This host is `c0ffee` and its name resolves to `address` (a dict, so a test can set it)."""
    answer = {"address": "172.18.0.5"}

    def gethostbyname(name: str) -> str:
        assert name == "c0ffee"
        if answer["address"] is None:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return answer["address"]

    monkeypatch.setattr(socket, "gethostname", lambda: "c0ffee")
    monkeypatch.setattr(socket, "gethostbyname", gethostbyname)
    return answer


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_auto_on_a_wildcard_bind_advertises_this_hosts_address(container, role):
    engine, server = parse_args(role, ["--host", "0.0.0.0", "--kv-host", "auto"])
    assert engine.transfer.advertise_host == "172.18.0.5"
    assert server.host == "0.0.0.0"


def test_auto_on_one_bind_address_advertises_that_address(container):
    container["address"] = None  # not asked: the side channel listens on --host alone
    assert resolve_kv_host("auto", "10.0.0.11") == "10.0.0.11"
    assert resolve_kv_host("auto", "127.0.0.1") == "127.0.0.1"


def test_an_explicit_kv_host_or_none_is_taken_as_is(container):
    assert resolve_kv_host("decode-0", "0.0.0.0") == "decode-0"
    assert resolve_kv_host(None, "0.0.0.0") == "0.0.0.0"  # the default: --host


@pytest.mark.parametrize("address", ["127.0.1.1", "127.0.0.1"])
def test_auto_refuses_a_loopback_answer(container, address, capsys):
    container["address"] = address  # Debian's /etc/hosts maps the hostname to 127.0.1.1
    with pytest.raises(SystemExit) as e:
        parse_args("decode", ["--host", "0.0.0.0", "--kv-host", "auto"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"'c0ffee' resolves to {address}, a loopback address" in err
    assert "pass --kv-host ADDRESS" in err


def test_auto_refuses_a_name_that_does_not_resolve(container):
    container["address"] = None
    with pytest.raises(ValueError, match="'c0ffee' does not resolve .*pass --kv-host ADDRESS"):
        resolve_kv_host("auto", "0.0.0.0")
