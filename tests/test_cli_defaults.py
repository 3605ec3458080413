"""The workers' command line writes no default of its own: with no flags it gives the config
dataclasses' defaults, but for what `config.for_role` decides (port, step tokens, connector,
CUDA graphs), and `--help` shows each default."""

from __future__ import annotations

import dataclasses

import pytest

from common.api.cli import build_parser, parse_args
from common.api.server_config import ServerConfig
from common.config import (
    CacheConfig,
    KVEventsConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    TransferConfig,
    default,
    for_role,
)


@pytest.fixture(autouse=True)
def no_secrets_in_env(monkeypatch):
    for name in ("PDSERVE_INTERNAL_TOKEN", "PDSERVE_KV_EVENTS_SERVER_SECRET_KEY"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_no_flags_give_the_dataclasses_defaults_and_the_roles_policy(role):
    engine, server = parse_args(role, [])
    policy = for_role(role, "cpu", 1)
    assert engine.model == ModelConfig(cuda_graph_sizes=policy.cuda_graph_sizes)
    assert engine.cache == CacheConfig()
    assert engine.scheduler == SchedulerConfig(max_num_batched_tokens=policy.max_num_batched_tokens)
    assert engine.parallel == ParallelConfig()
    assert engine.kv_events == KVEventsConfig(bind_host=default(ServerConfig, "host"))
    transfer = dataclasses.replace(
        TransferConfig(connector=policy.connector, advertise_port=policy.port),
        engine_id=engine.transfer.engine_id,  # a fresh one per worker
    )
    assert engine.transfer == transfer
    assert server == ServerConfig(role=role, port=policy.port)


def test_the_roles_policy():
    prefill, decode = for_role("prefill", "cpu", 1), for_role("decode", "cpu", 1)
    assert (prefill.port, decode.port) == (8100, 8200)
    assert prefill.max_num_batched_tokens < decode.max_num_batched_tokens
    assert prefill.cuda_graph_sizes == () and decode.cuda_graph_sizes is None
    assert decode.connector == "nixl" and for_role("decode", "cpu", 2).connector == "nixl"
    assert for_role("decode", "cuda", 2).connector is None  # EngineConfig refuses NIXL there


def test_help_shows_the_defaults():
    text = " ".join(build_parser("decode").format_help().split())
    shown = ["tokens per KV block (default 16)", "(default 1GiB)", "(default 4MiB)"]
    shown += ["(default 256)", "(default recompute)", "(default 60.0)", "else 2048"]
    for default_text in shown:
        assert default_text in text, default_text


def test_default_reads_a_field_and_its_factory():
    assert default(CacheConfig, "block_size") == 16
    assert isinstance(default(TransferConfig, "engine_id"), str)
    with pytest.raises(AssertionError):
        default(CacheConfig, "no_such_field")
