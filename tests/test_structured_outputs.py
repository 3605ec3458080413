"""Structured outputs in the engine (common/engine/structured.py), colocated and between a
prefill and a decode engine over the FakeConnector: a tiny random model under a grammar still
writes only what the grammar allows, P's first token is constrained too, and D continues the
grammar from it. HTTP, the OpenAI SDK and the proxy: test_structured_api.py.
"""

from __future__ import annotations

import json
from concurrent.futures import Future

import jsonschema
import pytest
import torch

from common.engine.llm import LLM
from common.engine.request import Resume
from common.engine.sampling_params import SamplingParams, StructuredOutputs
from common.engine.structured import GrammarMasks, PendingMasks, block_by_bits, block_by_fill
from common.kv_transfer.fake import Loopback
from tests.test_pd_inprocess import connect, make_engine, prefill, reserve, run, settle

SCHEMAS = {
    "flat": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 10},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer"},
                    "email": {"type": "string", "maxLength": 12},
                },
                "required": ["id"],
                "additionalProperties": False,
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
        "additionalProperties": False,
    },
    "array_of_enums": {
        "type": "object",
        "properties": {
            "colors": {
                "type": "array",
                "items": {"enum": ["red", "green", "blue"]},
                "minItems": 1,
                "maxItems": 4,
            },
            "score": {"type": "number", "minimum": -1, "maximum": 1},
        },
        "required": ["colors"],
        "additionalProperties": False,
    },
    "optional_and_null": {
        "type": "object",
        "properties": {
            "kind": {"const": "point"},
            "x": {"type": "integer"},
            "note": {"anyOf": [{"type": "string", "maxLength": 6}, {"type": "null"}]},
        },
        "required": ["kind", "x"],
        "additionalProperties": False,
    },
    "top_level_array": {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 99},
        "minItems": 2,
        "maxItems": 5,
    },
}

PROMPTS = ["Describe a person", "JSON please:", "The answer is", "x"]


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(str(tiny_model("llama")), dtype="float32", num_blocks=256, enforce_eager=True)


def constrained(max_tokens: int = 200, seed: int | None = None, **spec) -> SamplingParams:
    sampling = dict(temperature=1.0, seed=seed) if seed is not None else dict(temperature=0)
    return SamplingParams(max_tokens=max_tokens, structured=StructuredOutputs(**spec), **sampling)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_random_model_output_validates_against_its_schema(llm, name):
    """Greedy and sampled, a random model's output parses and validates, and ends because the
    grammar is complete (finish_reason stop, no EOS needed), not at max_tokens."""
    schema = SCHEMAS[name]
    params = [constrained(json=json.dumps(schema))] + [
        constrained(json=json.dumps(schema), seed=seed) for seed in range(3)
    ]
    for answer in llm.generate(PROMPTS, params):  # one batch
        out = answer.outputs[0]
        assert out.finish_reason == "stop", (out.text, out.finish_reason)
        jsonschema.validate(json.loads(out.text), schema)


def test_json_object_choice_regex_and_grammars(llm):
    out = llm.generate(PROMPTS[0], constrained(json_object=True))[0].outputs[0]
    assert out.finish_reason == "stop" and isinstance(json.loads(out.text), dict)
    choices = ("yes", "no way", 'say "so"\n')
    texts = {o.outputs[0].text for o in llm.generate(PROMPTS, constrained(choice=choices, seed=2))}
    assert texts <= set(choices) and texts
    for o in llm.generate(PROMPTS, constrained(regex=r"[0-9]{3}-[a-z]{2,4}")):
        assert o.outputs[0].finish_reason == "stop"
        head, tail = o.outputs[0].text.split("-")
        assert len(head) == 3 and head.isascii() and head.isdigit() and 2 <= len(tail) <= 4
    lark = 'start: "(" item ("," item)* ")"\nitem: /[a-c]/'
    gbnf = 'root ::= "(" item ("," item)* ")"\nitem ::= [a-c]'
    for grammar in (lark, gbnf):
        for o in llm.generate(PROMPTS, constrained(grammar=grammar, seed=3, max_tokens=30)):
            text = o.outputs[0].text
            assert text.startswith("(") and set(text) <= set("(a,bc)"), text


def test_unconstrained_request_is_unchanged_by_a_constrained_neighbour(llm):
    plain = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    alone = llm.generate("x", plain)[0].outputs[0].token_ids
    schema = json.dumps(SCHEMAS["nested"])
    both = llm.generate(["x", "The answer is"], [plain, constrained(json=schema)])
    assert both[0].outputs[0].token_ids == alone
    assert json.loads(both[1].outputs[0].text)  # and the neighbour was constrained


def test_n_choices_each_follow_the_grammar(llm):
    params = constrained(json=json.dumps(SCHEMAS["flat"]), seed=5)
    params.n = 3
    outs = llm.generate("JSON please:", params)[0].outputs
    assert len(outs) == 3 and len({o.text for o in outs}) > 1
    for o in outs:
        jsonschema.validate(json.loads(o.text), SCHEMAS["flat"])


@pytest.mark.parametrize(
    "spec",
    [
        dict(json='{"type": "object", "properties": {"a": {"type": "nope"}}}'),
        dict(json="{not json"),
        dict(regex="[a-"),
        dict(grammar="start: undefined_rule"),
        dict(grammar='root ::= "a" missing'),
    ],
)
def test_spec_that_cannot_compile_is_a_value_error(llm, spec):
    with pytest.raises(ValueError, match="cannot compile"):
        llm.engine.grammars.check(StructuredOutputs(**spec))
    with pytest.raises(ValueError, match="cannot compile"):
        llm.engine.add_request("bad", "x", constrained(**spec))
    assert not llm.engine.has_unfinished_requests()


def test_structured_outputs_needs_exactly_one_kind():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs(regex="a", grammar="start: a")
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs()
    with pytest.raises(ValueError, match="non-empty"):
        StructuredOutputs(choice=("a", ""))


# -- between a prefill and a decode engine ---------------------------------------------------


@pytest.fixture(scope="module")
def pd(tiny_model):
    fabric = Loopback()
    model = str(tiny_model("llama"))
    p = make_engine(model, fabric, kv_checksum=True)
    d = make_engine(model, fabric, failure_policy="fail", load_timeout=10)
    connect(p, d)
    return p, d


def pd_params(max_tokens: int, seed: int | None = None) -> SamplingParams:
    spec = StructuredOutputs(json=json.dumps(SCHEMAS["array_of_enums"]))
    sampling = dict(temperature=0.9, seed=seed) if seed is not None else dict(temperature=0)
    return SamplingParams(max_tokens=max_tokens, structured=spec, **sampling)


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("seed", [None, 11])
def test_pd_output_equals_colocated_under_a_grammar(pd, mode, seed):
    """P's first token is constrained (it is the grammar's `{`); D advances its grammar over it
    and continues: the same tokens as colocated, from KV that was loaded, not recomputed."""
    p, d = pd
    prompt = list(range(5, 45))
    colocated, out = run(d, prompt, pd_params(120, seed))
    assert out["error"] is None
    jsonschema.validate(json.loads(d.tokenizer.decode(colocated)), SCHEMAS["array_of_enums"])
    before = d.connector.stats_snapshot()
    push_to = reserve(d, len(prompt)) if mode == "push" else None
    kv = {"do_remote_decode": True, **({"push_to": push_to} if push_to else {})}
    first, p_out = run(p, prompt, pd_params(1, seed), kv, rid="prefill")
    assert p_out["error"] is None and d.tokenizer.decode(first) == "{"
    tokens, out = run(d, prompt, pd_params(120, seed), p_out["kv"])
    assert out["error"] is None and tokens == colocated
    after = d.connector.stats_snapshot()
    assert after.loaded_requests.get(mode, 0) - before.loaded_requests.get(mode, 0) == 1
    assert after.recomputed == before.recomputed
    settle(p, d)


def test_first_token_the_grammar_refuses_ends_the_request_with_an_error(pd):
    """D's grammar refuses a first token from an unconstrained P: the request ends with an
    error that is the request's own (a 400 at the API), never with output off the grammar;
    its KV is given back."""
    p, d = pd
    prompt = list(range(50, 70))
    kv = prefill(p, prompt)
    assert d.tokenizer.decode([kv["first_token_id"]]) != "{"
    d.add_request("refused", prompt, pd_params(40), kv)
    for _ in range(200):
        outs = [o for o in d.step() if o.request_id == "refused" and o.finished]
        if outs:
            break
    assert outs[0].error is not None and "does not follow the grammar" in outs[0].error
    assert outs[0].error_is_request_fault
    settle(p, d)


def test_a_resumed_request_continues_its_grammar(pd):
    """A stream moved to this worker: the grammar is advanced over the outputs the client has,
    and the answer goes on as if never interrupted; outputs off the grammar are refused."""
    _, d = pd
    prompt = list(range(7, 30))
    whole, out = run(d, prompt, pd_params(120))
    assert out["error"] is None
    resumed, out = run(d, prompt, pd_params(120), resume=Resume(0, tuple(whole[:6]), 0))
    assert out["error"] is None and resumed == whole
    off = tuple(d.tokenizer.encode("nope", add_special_tokens=False))
    with pytest.raises(ValueError, match="does not follow the grammar"):
        d.add_request("off", prompt, pd_params(40), resume=Resume(0, off, 0))
    assert not d.has_unfinished_requests()


def test_masks_block_exactly_the_tokens_the_grammar_refuses(llm):
    """GrammarMasks on real grammars: the rows with one keep their allowed logits and get -inf
    elsewhere (bit for bit against a plain `where`), a row without one is untouched, and a
    grammar with nothing allowed is a dead end."""
    compiler, vocab_size = llm.engine.grammars, llm.engine.arch.vocab_size
    tokenizer = llm.tokenizer
    grammars = [
        compiler.grammar(StructuredOutputs(json=json.dumps(SCHEMAS["flat"]))),
        compiler.grammar(StructuredOutputs(choice=("yes", "no"))),
        compiler.grammar(StructuredOutputs(regex="[0-9]+")),
    ]
    grammars[0].accept(tokenizer.encode('{"name":"', add_special_tokens=False))
    done = compiler.grammar(StructuredOutputs(choice=("a",)))
    done.accept(tokenizer.encode("a", add_special_tokens=False))
    assert done.is_terminated  # only EOS is left
    broken = compiler.grammar(StructuredOutputs(regex="[0-9]+"))
    broken.accept(tokenizer.encode("x", add_special_tokens=False))
    assert "does not follow" in broken.error  # and no token can follow it

    class Seq:
        def __init__(self, grammar):
            self.grammar = grammar

    seqs = [Seq(grammars[0]), Seq(None), Seq(grammars[1]), Seq(grammars[2]), Seq(done), Seq(broken)]
    logits = torch.randn(len(seqs), vocab_size)
    before = logits.clone()
    masks = GrammarMasks(vocab_size)
    pending = masks.start(seqs)
    assert pending.rows == [0, 2, 3, 4, 5]
    masks.apply(pending, logits)
    assert torch.equal(logits[1], before[1])
    for row, grammar in zip(pending.rows, pending.grammars):
        bits = torch.empty((vocab_size + 31) // 32, dtype=torch.int32)
        grammar.fill_mask(bits)
        allowed = torch.tensor(
            [bool((int(bits[t // 32]) >> (t % 32)) & 1) for t in range(vocab_size)]
        )
        assert torch.equal(logits[row], torch.where(allowed, before[row], -torch.inf)), row
    # a finished or broken grammar allows EOS alone (the request has already ended by then)
    eos = llm.engine.eos_token_ids
    for row in (4, 5):
        assert logits[row].isfinite().nonzero().flatten().tolist() == list(eos), row
    # a mask with no token allowed is a dead end: the grammar says so, the row is all -inf
    empty = Future()
    empty.set_result(torch.zeros(1, (vocab_size + 31) // 32, dtype=torch.int32))
    grammar = compiler.grammar(StructuredOutputs(regex="[0-9]+"))
    masks.apply(PendingMasks([1], [grammar], empty), logits)
    assert logits[1].isinf().all() and "allows no token after 0" in grammar.error
    assert masks.start([Seq(None), Seq(None)]) is None  # nothing to do without grammars


def test_the_cpu_bit_path_equals_the_masked_fill_of_other_devices():
    """block_by_bits (CPU) and block_by_fill (what a GPU runs) block the same tokens, bit for
    bit, on a subset of rows of logits with +-inf and NaN-free extremes."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 1000, generator=g) * 30
    logits[0, :3] = torch.tensor([float("inf"), float("-inf"), -0.0])
    allowed = (torch.rand(3, 1000, generator=g) < 0.3).to(torch.uint8).numpy()
    rows = [0, 2, 5]
    by_bits, by_fill = logits.clone(), logits.clone()
    block_by_bits(by_bits, rows, allowed)
    block_by_fill(by_fill, rows, allowed)
    assert torch.equal(by_bits, by_fill) and not torch.equal(by_bits, logits)
    assert torch.equal(by_bits[[1, 3, 4]], logits[[1, 3, 4]])
