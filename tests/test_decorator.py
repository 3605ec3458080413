"""The KV-transfer decorator and the scoped forward context."""

from __future__ import annotations

import pytest
import torch

from common.attention.context import ForwardContext, forward_context, get_attention_context
from common.attention.decorator import maybe_transfer_kv_layer
from common.config import CacheConfig, EngineConfig, ModelConfig
from common.engine.engine import LLMEngine
from common.engine.sampling_params import SamplingParams
from common.kv_transfer.base import KVConnector


class RecordingConnector(KVConnector):
    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, str]] = []
        self.registered: dict = {}

    def register_kv_caches(self, kv_caches, shards=None):
        self.registered = kv_caches

    def start_load_kv(self, ctx):
        self.calls.append(("start_load_kv", ""))

    def wait_for_layer_load(self, layer_name):
        self.calls.append(("wait", layer_name))

    def save_kv_layer(self, layer_name, kv_cache, attn_metadata):
        _, _, expected = get_attention_context(layer_name)
        assert kv_cache is expected and attn_metadata is not None
        self.calls.append(("save", layer_name))

    def wait_for_save(self):
        self.calls.append(("wait_for_save", ""))


def test_decoration_requires_layer_name():
    with pytest.raises(TypeError, match="layer_name"):

        @maybe_transfer_kv_layer
        def attention(query, key, value):
            return query


def _recording_ctx(connector, events):
    @maybe_transfer_kv_layer
    def attention(query, key, value, layer_name):
        events.append(("attn", layer_name))
        return query

    ctx = ForwardContext(
        attn_metadata=object(), layers={"l0": None}, kv_caches={"l0": "cache"}, connector=connector
    )
    return attention, ctx


@pytest.mark.parametrize("keyword", [False, True])
def test_wait_attend_save_in_order(keyword):
    connector = RecordingConnector()
    connector.save_kv_layer = lambda name, kv, meta: connector.calls.append(("save", name))
    attention, ctx = _recording_ctx(connector, connector.calls)
    connector.bind_connector_metadata({"step": 1})
    with forward_context(ctx):
        if keyword:
            attention(1, 2, 3, layer_name="l0")
        else:
            attention(1, 2, 3, "l0")
    assert connector.calls == [("wait", "l0"), ("attn", "l0"), ("save", "l0")]


def test_plain_call_without_connector_or_metadata():
    connector = RecordingConnector()
    attention, ctx = _recording_ctx(connector, connector.calls)
    with forward_context(ctx):  # connector bound, no metadata this step
        assert attention(7, 2, 3, "l0") == 7
    assert connector.calls == [("attn", "l0")]
    ctx.connector = None
    with forward_context(ctx):
        attention(7, 2, 3, layer_name="l0")
    assert attention(7, 2, 3, "l0") == 7  # no forward context at all


def test_forward_context_refuses_nesting_and_resets():
    ctx = ForwardContext(attn_metadata=None, layers={}, kv_caches={})
    with forward_context(ctx), pytest.raises(RuntimeError, match="nest"), forward_context(ctx):
        pass
    with pytest.raises(RuntimeError, match="outside a forward context"):
        get_attention_context("l0")


def test_engine_calls_connector_per_layer(tiny_model):
    connector = RecordingConnector()
    config = EngineConfig(ModelConfig(str(tiny_model("llama"))), CacheConfig(num_blocks=32))
    engine = LLMEngine(config, make_connector=lambda *_: connector)
    assert set(connector.registered) == set(engine.model.attention_layers())
    engine.add_request("r", list(range(3, 40)), SamplingParams(max_tokens=3, temperature=0))
    engine.step()  # no metadata bound: the connector is not called at all
    assert connector.calls == []
    connector.calls.clear()
    connector.bind_connector_metadata({"transfer": "r"})
    engine.step()
    layers = list(engine.model.attention_layers())
    expected = [("start_load_kv", "")]
    for name in layers:
        expected += [("wait", name), ("save", name)]
    assert connector.calls == expected + [("wait_for_save", "")]
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.pool.is_all_free
    assert torch.is_tensor(next(iter(connector.registered.values())))
