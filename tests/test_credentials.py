"""Secrets (common/credentials.py): compared as bytes, read from a flag, a file or the
environment, and kept off the `--workers N` children's command line (proxy/config.py)."""

from __future__ import annotations

import json

import pytest

from common.api.cli import parse_args as worker_args
from common.credentials import is_same_secret
from proxy.config import child_argv, parse_args, secrets_env, with_inherited_secrets

D = ["--decode", "http://d:1"]


def test_a_header_is_compared_as_its_bytes():
    assert is_same_secret("sk-1", "sk-1") and not is_same_secret("sk-2", "sk-1")
    assert not is_same_secret("\xff\xfe", "sk-1") and not is_same_secret(None, "sk-1")
    assert not is_same_secret("\u20ac", "\u20ac")  # a str no header decodes to: never raises
    sent = "clé".encode().decode("latin-1")  # a UTF-8 key as Starlette hands it over
    assert is_same_secret(sent, "clé")


def test_a_secret_comes_from_the_flag_the_file_or_the_environment(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    env = {"PDSERVE_API_KEY": "from-env", "PDSERVE_ADMIN_KEY": "admin-env"}
    cfg = parse_args([*D], env)
    assert (cfg.api_key, cfg.admin_key, cfg.internal_token) == ("from-env", "admin-env", None)
    assert parse_args([*D, "--api-key-file", str(key_file)], env).api_key == "from-file"
    assert parse_args([*D, "--api-key", "from-flag"], env).api_key == "from-flag"
    assert parse_args([*D, "--internal-token-f", str(key_file)], {}).internal_token == "from-file"
    assert parse_args([*D], {"PDSERVE_API_KEY": ""}).api_key is None


def test_the_config_file_sits_between_flags_and_environment(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("from-file")
    config = tmp_path / "proxy.json"
    config.write_text(json.dumps({"decode": ["http://d:1"], "admin-key-file": str(key_file)}))
    env = {"PDSERVE_ADMIN_KEY": "from-env"}
    assert parse_args(["--config", str(config)], env).admin_key == "from-file"
    assert parse_args(["--config", str(config), "--admin-key", "flag"], env).admin_key == "flag"


@pytest.mark.parametrize(
    "argv",
    [
        ["--api-key", "k", "--api-key-file", "f"],  # both
        ["--api-key-file", "/nonexistent/key"],
        ["--api-key", "k\n"],
        ["--admin-key", " k"],
    ],
)
def test_a_bad_secret_is_refused_at_start(argv, capsys):
    with pytest.raises(SystemExit):
        parse_args([*D, *argv], {})
    assert "key" in capsys.readouterr().err


def test_children_get_the_command_line_without_secrets_and_the_secrets_in_their_env():
    argv = [*D, "--api-key", "k1", "--admin-key=k2", "--internal-token-fi", "/run/t"]
    argv += ["--workers", "2", "--api-key-file=/run/k"]
    assert child_argv(argv) == [*D, "--workers", "2"]
    assert child_argv([*D, "--", "--api-key"]) == [*D, "--", "--api-key"]
    cfg = parse_args([*D, "--api-key", "k1", "--admin-key", "k2"], {})
    env = secrets_env(cfg)
    assert env == {
        "PDSERVE_API_KEY": "k1",
        "PDSERVE_ADMIN_KEY": "k2",
        "PDSERVE_INTERNAL_TOKEN": None,
    }
    child = parse_args(child_argv([*D, "--api-key", "k1"]), {"PDSERVE_API_KEY": "stale"})
    inherited = with_inherited_secrets(child, {k: v for k, v in env.items() if v})
    assert (inherited.api_key, inherited.admin_key, inherited.internal_token) == ("k1", "k2", None)


def test_a_worker_reads_its_token_from_a_file_or_the_environment(tmp_path, monkeypatch):
    token_file = tmp_path / "token"
    token_file.write_text("from-file\n")
    monkeypatch.setenv("PDSERVE_INTERNAL_TOKEN", "from-env")
    assert worker_args("decode", [])[1].internal_token == "from-env"
    server = worker_args("decode", ["--internal-token-file", str(token_file)])[1]
    assert server.internal_token == "from-file"
    assert worker_args("decode", ["--internal-token", "flag"])[1].internal_token == "flag"
    with pytest.raises(SystemExit):
        worker_args("decode", ["--internal-token", "a", "--internal-token-file", str(token_file)])
