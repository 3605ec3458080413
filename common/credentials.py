"""Secrets (the proxy's API and admin keys, the cluster token): where they are read from, and
how a request's copy is checked.

A secret given as a flag sits on the command line, which every user of the host can read
(`ps`, `/proc/PID/cmdline`). So each secret also comes from a file (`--NAME-file PATH`: its
content, without surrounding whitespace) or from an environment variable, which only its owner
can read. An empty value means no secret.

A header's value may hold any byte, and Starlette hands it over decoded as latin-1;
`hmac.compare_digest` refuses a non-ASCII str. So `is_same_secret` compares bytes: the header's
own bytes against the secret's UTF-8 bytes (a client sends a non-ASCII secret in UTF-8).
"""

from __future__ import annotations

import hmac
from pathlib import Path

FORBIDDEN = ("\r", "\n", "\0")  # cannot be sent in a header


def read_secret_file(path: str | Path) -> str | None:
    """The secret in a file (a trailing newline, as `echo` writes, is no part of it)."""
    try:
        return Path(path).read_text(encoding="utf-8", errors="surrogateescape").strip() or None
    except OSError as e:
        raise ValueError(f"cannot read the secret file {path}: {e.strerror}") from None


def pick_secret(name: str, value: str | None, path: str | Path | None) -> str | None:
    """The secret given as `--NAME VALUE` or `--NAME-file PATH` (never both), None if neither."""
    if value is not None and path is not None:
        raise ValueError(f"give --{name} or --{name}-file, not both")
    return read_secret_file(path) if path is not None else value or None


def check_secret(name: str, secret: str | None) -> None:
    """A secret a client can send in a header: raises ValueError for one it cannot."""
    if secret is None:
        return
    if secret != secret.strip() or any(c in secret for c in FORBIDDEN):
        raise ValueError(f"{name} must not begin or end with whitespace nor hold line breaks")
    try:
        secret.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        raise ValueError(f"{name} is not valid text") from None


def is_same_secret(given: str | None, secret: str) -> bool:
    """Whether a header's value is the secret, in constant time; never raises."""
    if given is None:
        return False
    try:
        raw = given.encode("latin-1")  # the header's own bytes (Starlette decodes as latin-1)
    except UnicodeEncodeError:  # not a header's value: nothing a client can have sent
        return False
    return hmac.compare_digest(raw, secret.encode("utf-8", "surrogateescape"))
