"""The compiled forward is one graph for the whole model (docs/design.md): a step enters compiled
code once, not once per layer, and one graph serves every token count without recompiling."""

from __future__ import annotations

import torch
from torch._dynamo.utils import counters
from torch.profiler import ProfilerActivity, profile

from common.engine.llm import LLM
from common.engine.sampling_params import SamplingParams
from tests.oracle import engine_greedy


def test_one_compiled_call_per_step_and_no_recompiles(tiny_model):
    llm = LLM(str(tiny_model("llama")), num_blocks=64, block_size=16, dtype="float32")
    engine = llm.engine
    assert len(engine.model.layers) > 1, "one layer would not tell one call from one per layer"
    graphs = counters["stats"]["unique_graphs"]  # after the start-up compile
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    # token counts 1 (padded to 2), 2, 21, 21 + 1, ...: prefills and decodes of other sizes
    engine.add_request("a", list(range(3, 24)), params)
    engine.step()
    engine.add_request("b", list(range(5, 17)), params)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.step()  # a's decode + b's prefill
    regions = [e for e in prof.events() if e.name.startswith("Torch-Compiled Region")]
    assert len(regions) == 1, [e.name for e in regions]
    while engine.has_unfinished_requests():
        engine.step()
    assert counters["stats"]["unique_graphs"] == graphs, "a token count recompiled the model"
    assert engine.pool.num_used_blocks == 0


def test_layers_read_their_own_weights(tiny_model):
    """One graph stamped out for every layer: each layer must still run on its own weights.
    Zeroing the last layer's input norm silences its attention; the compiled model must follow
    the eager one there, and move away from its own earlier logits."""
    model_dir = str(tiny_model("llama"))
    llm = LLM(model_dir, num_blocks=64, block_size=16, dtype="float32")
    eager = LLM(model_dir, num_blocks=64, block_size=16, dtype="float32", enforce_eager=True)
    prompt = list(range(3, 40))
    _, before = engine_greedy(llm, prompt, 8)
    for engine in (llm.engine, eager.engine):
        with torch.no_grad():
            engine.model.layers[-1].input_layernorm.weight.zero_()
        engine.pool.reset_prefix_cache()
    tokens, after = engine_greedy(llm, prompt, 8)
    ref_tokens, reference = engine_greedy(eager, prompt, 8)
    assert (after - before).abs().max().item() > 1e-3, "the graph ignored the last layer's weight"
    assert tokens == ref_tokens
    assert (after - reference).abs().max().item() < 1e-5
