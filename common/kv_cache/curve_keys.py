"""CURVE keys of the KV events sockets, from the environment (never the command line).

Each key is the value of a variable, or the contents of the file its `_FILE` twin names (a
mounted secret): Z85 text, 40 characters; a list of keys is separated by commas, whitespace or
lines (Z85 uses `#`: there are no comments).

    worker  PDSERVE_KV_EVENTS_SERVER_SECRET_KEY   its own secret key (turns CURVE on)
            PDSERVE_KV_EVENTS_CLIENT_KEYS         the public keys of the subscribers it admits
    proxy   PDSERVE_KV_EVENTS_SERVER_KEY          the workers' public key
            PDSERVE_KV_EVENTS_CLIENT_SECRET_KEY   its own secret key (its public key is derived)

    python -m common.kv_cache.curve_keys DIR      writes a key pair for the workers and one for
                                                  the proxy: DIR/{server,client}.{key,pub}
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import zmq

SERVER_SECRET_KEY = "PDSERVE_KV_EVENTS_SERVER_SECRET_KEY"
CLIENT_KEYS = "PDSERVE_KV_EVENTS_CLIENT_KEYS"
SERVER_KEY = "PDSERVE_KV_EVENTS_SERVER_KEY"
CLIENT_SECRET_KEY = "PDSERVE_KV_EVENTS_CLIENT_SECRET_KEY"


def read_keys(name: str, environ: dict[str, str] | None = None) -> tuple[str, ...]:
    """The keys in variable `name`, or in the file `name`_FILE names; () when neither is set."""
    env = os.environ if environ is None else environ
    text = env.get(name) or ""
    if not text and env.get(f"{name}_FILE"):
        text = Path(env[f"{name}_FILE"]).read_text()
    return tuple(k for k in re.split(r"[\s,]+", text) if k)


def read_key(name: str, environ: dict[str, str] | None = None) -> str | None:
    keys = read_keys(name, environ)
    if len(keys) > 1:
        raise ValueError(f"{name} holds {len(keys)} keys; it takes one")
    return keys[0] if keys else None


def public_key(secret_key: str) -> str:
    return zmq.curve_public(secret_key.encode()).decode()


@dataclass(frozen=True)
class CurveClientKeys:
    """A subscriber's CURVE keys: the publisher's public key and its own key pair."""

    server_key: str
    secret_key: str

    @property
    def public_key(self) -> str:
        return public_key(self.secret_key)

    def __repr__(self) -> str:  # never log a secret
        return f"CurveClientKeys(server_key={self.server_key!r}, <secret>)"

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> CurveClientKeys | None:
        """The proxy's keys; None when neither is set, an error when only one is."""
        server, secret = read_key(SERVER_KEY, environ), read_key(CLIENT_SECRET_KEY, environ)
        if server is None and secret is None:
            return None
        if server is None or secret is None:
            raise ValueError(f"KV events CURVE needs both {SERVER_KEY} and {CLIENT_SECRET_KEY}")
        return cls(server, secret)

    def secure(self, sock: zmq.Socket) -> None:
        sock.curve_serverkey = self.server_key.encode()
        sock.curve_publickey = self.public_key.encode()
        sock.curve_secretkey = self.secret_key.encode()


def write_key_pairs(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("server", "client"):
        public, secret = zmq.curve_keypair()
        (folder / f"{name}.pub").write_bytes(public + b"\n")
        key = folder / f"{name}.key"
        key.touch(mode=0o600)
        key.write_bytes(secret + b"\n")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    write_key_pairs(Path(sys.argv[1]))
