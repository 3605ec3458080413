"""Decode steps through the CUDA graphs' static buffers (common/engine/decode_graphs.py), on a CPU.

A CPU captures nothing, but with --cuda-graph-sizes a decode step runs the same padded static
buffers and static metadata a captured graph replays: the answers must equal the plain
forward's, the padding rows must write only the pad block, and the steps a graph must not run
(prefill chunks, batches over the largest size, steps that load KV) must run the forward. The
capture itself runs on a GPU only (tests/gpu/check.py, parts `graphs` and `speed`).
"""

from __future__ import annotations

import pytest
import torch

from common.config import EngineConfig, ModelConfig, SchedulerConfig
from common.engine.decode_graphs import DEFAULT_SIZES, decode_graph_sizes
from common.engine.llm import LLM
from common.engine.sampling_params import SamplingParams
from tests.gpu.graphs import SIZES, drive, expected_replays, watch_padding
from tests.servers import complete, kv_sources, wait_until
from tests.tiny_models import VOCAB


def engine(model_dir: str, **options):
    return LLM(model_dir, num_blocks=64, block_size=16, dtype="float32", **options).engine


@pytest.mark.parametrize("arch", ["llama", "mistral-swa"])
def test_padded_static_decodes_equal_the_forward(tiny_model, arch):
    """The schedule of tests/gpu/graphs.py: decode batches of 5 (over the largest size), 4, 3
    (padded to 4), 2 and 1 (padded to 2), and a step of decodes with a prefill."""
    model_dir = str(tiny_model(arch))
    graphs = engine(model_dir, cuda_graph_sizes=SIZES)
    plain = engine(model_dir)
    assert plain.runner.graphs is None and graphs.runner.graphs is not None
    problems = watch_padding(graphs)
    tokens, logits, shapes = drive(graphs, VOCAB)
    ref_tokens, ref_logits, ref_shapes = drive(plain, VOCAB)
    assert problems == []
    assert shapes == ref_shapes
    assert tokens == ref_tokens
    assert (logits - ref_logits).abs().max().item() < 1e-4
    # the path was taken: every decode-only step of at most 4 ran the buffers, in its bucket
    decode_only = [d for d, t in shapes if d == t]
    assert 5 in decode_only and any(d < t for d, t in shapes if d), "no oversize or mixed step"
    assert {3, 1} <= set(decode_only), "no padded batch"
    replays = graphs.runner.graphs.num_replays
    assert {s: replays[s] for s in SIZES} == expected_replays(shapes, SIZES) == {2: 3, 4: 4}
    assert sum(replays.values()) == 7, "a size outside SIZES replayed"
    assert graphs.pool.num_used_blocks == 0


@pytest.fixture(scope="module")
def _engine_of_size_4(tiny_model):
    return engine(str(tiny_model("llama")), cuda_graph_sizes=(4,))


@pytest.fixture
def engine_of_size_4(_engine_of_size_4):
    """The llama engine with graph size 4, compiled once (~5 CPU-s) for the tests below and
    handed to each as a fresh one would be: after a test, the padding watch removed, the pad
    slot restored, the replay counts zeroed, the prefix cache emptied (every block empty
    again, so that the pool hands out block 0 first) and the KV zeroed, as allocated (the watch
    sees a write by the change it makes: the same prompt's KV again would look unwritten)."""
    llm = _engine_of_size_4
    graphs = llm.runner.graphs
    pad_slot = graphs.pad_slot
    yield llm
    graphs.__dict__.pop("run", None)  # watch_padding's wrapper
    graphs.pad_slot = pad_slot
    graphs.num_replays.clear()
    llm.pool.reset_prefix_cache()
    for kv_cache in llm.runner.kv_caches.values():
        kv_cache.zero_()
    assert llm.pool.is_all_free and not llm.has_unfinished_requests()


def test_padding_writes_only_the_pad_block(engine_of_size_4):
    llm = engine_of_size_4
    pad = llm.runner.graphs.pad_block
    assert pad == llm.num_blocks - 1 and llm.pool.num_blocks == llm.num_blocks - 1
    problems = watch_padding(llm)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm.add_request("a", list(range(3, 40)), params)
    llm.add_request("b", list(range(9, 20)), params)
    while llm.has_unfinished_requests():
        llm.step()
    assert llm.runner.graphs.num_replays == {4: 5}  # two decodes padded to 4, five steps
    assert problems == []


def test_the_padding_watch_sees_a_write_outside_the_step(engine_of_size_4):
    """watch_padding, which the GPU check runs too, reports padding rows aimed at slot 0 (a
    request's first token, as the pool hands out block 0 first) instead of the pad block."""
    llm = engine_of_size_4
    llm.runner.graphs.pad_slot = 0
    problems = watch_padding(llm)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    llm.add_request("a", list(range(3, 40)), params)
    while llm.has_unfinished_requests():
        llm.step()
    assert problems and all("wrote [0]" in p for p in problems), problems


def test_default_sizes_by_device_backend_and_flags():
    def sizes(fits=True, tp=None, spare=True, device="cuda", **model):
        config = EngineConfig(
            model=ModelConfig(**model), scheduler=SchedulerConfig(max_num_seqs=100)
        )
        return decode_graph_sizes(config, torch.device(device), fits, tp, spare)

    assert sizes() == tuple(s for s in DEFAULT_SIZES if s < 100) + (100,)
    assert sizes(device="cpu") == ()
    assert sizes(fits=False) == ()  # the torch backend reads up to max_model_len captured
    assert sizes(enforce_eager=True) == () == sizes(tp=object()) == sizes(spare=False)
    assert sizes(device="cpu", cuda_graph_sizes=(8, 1, 8)) == (1, 8)
    assert sizes(fits=False, cuda_graph_sizes=()) == ()
    with pytest.raises(ValueError, match="cuda_graph_sizes"):
        ModelConfig(cuda_graph_sizes=(0, 4))


def test_cli_sizes():
    from common.api.cli import parse_args

    def sizes(*argv: str, role="decode"):
        return parse_args(role, list(argv))[0].model.cuda_graph_sizes

    assert sizes("--cuda-graph-sizes", "8", "2") == (8, 2)
    assert sizes("--cuda-graph-sizes") == ()
    assert sizes() is None  # the engine's default
    assert sizes(role="prefill") == ()  # P decodes one token a request
    assert sizes("--cuda-graph-sizes", "4", role="prefill") == (4,)


@pytest.fixture(scope="module")
def pd(start_server, tiny_model):
    common = ["--model", str(tiny_model("llama")), "--num-blocks", "64", "--max-model-len", "256"]
    common += ["--no-prefix-caching"]  # every prompt's KV read from P, none served locally
    p = start_server("prefill", *common, "--kv-lease-timeout", "30")
    graphs = ["--no-enforce-eager", "--cuda-graph-sizes", "1", "4"]
    d = start_server("decode", *common, "--kv-load-timeout", "10", *graphs)
    return p, d


def test_pd_decodes_through_the_buffers_after_loading_kv(pd):
    """D loads each prompt's KV from P in an ordinary step (its connector's calls run per
    layer), then decodes through the buffers; the answers equal P's own colocated ones."""
    p, d = pd
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (9, 33, 70)]
    body = dict(max_tokens=10, temperature=0, ignore_eos=True, return_token_ids=True)
    before = kv_sources(d)
    for prompt in prompts:
        remote = dict(max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        params = complete(p.url, {**body, "prompt": prompt, **remote})["kv_transfer_params"]
        answer = complete(d.url, {**body, "prompt": prompt, "kv_transfer_params": params})
        reference = complete(p.url, {**body, "prompt": prompt})
        assert answer["choices"][0]["token_ids"] == reference["choices"][0]["token_ids"]
    assert wait_until(lambda: kv_sources(d)["pull"] - before["pull"] == len(prompts))
    assert kv_sources(d)["recomputed"] == before["recomputed"]
    assert d.metric("pdserve_num_graph_steps") >= len(prompts) * 8  # 9 decode steps each
    assert p.metric("pdserve_num_graph_steps") == 0
    assert wait_until(lambda: d.metric("pdserve_kv_blocks_used") == 0)
