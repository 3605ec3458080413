"""Structured outputs in the engine (common/engine/structured.py), colocated and between a
prefill and a decode engine over the FakeConnector: a tiny random model under a grammar still
writes only what the grammar allows, P's first token is constrained too, and D continues the
grammar from it. What a grammar may cost (docs/security.md, "Grammar cost"): refused at
admission, or ended with grammar_too_expensive, its blocks given back, and other requests
unchanged. HTTP, the OpenAI SDK and the proxy: test_structured_api.py.
"""

from __future__ import annotations

import ctypes
import json
import random
import threading
import time
from concurrent.futures import Future

import jsonschema
import pytest
import torch

from common.config import CacheConfig, EngineConfig, GrammarConfig, ModelConfig
from common.engine.engine import LLMEngine
from common.engine.llm import LLM
from common.engine.request import Resume
from common.engine.sampling_params import SamplingParams, StructuredOutputs
from common.engine.structured import (
    LIMIT_EXCEEDED,
    TOO_EXPENSIVE,
    Grammar,
    GrammarError,
    GrammarMasks,
    PendingMasks,
    block_by_bits,
    block_by_fill,
)
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
    filled = Future()
    filled.set_result(None)
    nothing = torch.zeros(1, (vocab_size + 31) // 32, dtype=torch.int32)
    grammar = compiler.grammar(StructuredOutputs(regex="[0-9]+"))
    masks.apply(PendingMasks([1], [grammar], nothing, [filled]), logits)
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


# -- what a grammar may cost ------------------------------------------------------------------

# passed admission in 1 ms, then cost 0.8 s on its first step and ~0.1 s on each one after
PATHOLOGICAL = "((a{70}){70}){70}"
NO_LEXER_LIMIT = 1_000_000  # llguidance's own default lexer fuel: the regex compiles under it


def cost_engine(tiny_model, **grammar) -> LLMEngine:
    config = EngineConfig(
        ModelConfig(str(tiny_model("llama")), dtype="float32", enforce_eager=True),
        CacheConfig(num_blocks=64, enable_prefix_caching=False),
        grammar=GrammarConfig(**grammar),
    )
    return LLMEngine(config)


def run_all(engine: LLMEngine, deadline_s: float = 120.0) -> dict:
    """Step until no request is left, under a deadline: each request's last output; then wait,
    under the deadline too, for every block to be back in the pool."""
    last, deadline = {}, time.monotonic() + deadline_s
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the requests did not finish"
        last.update((out.request_id, out) for out in engine.step())
    while not engine.pool.is_all_free:
        assert time.monotonic() < deadline, f"{engine.pool.num_used_blocks} blocks not freed"
        time.sleep(0.01)
    return last


@pytest.fixture(scope="module")
def defaults(tiny_model):
    """An engine with the default grammar limits."""
    return cost_engine(tiny_model)


def test_pathological_regex_is_refused_or_ends_within_its_first_tokens(defaults):
    """Under llguidance's lexer fuel, the regex that cost ~0.1 s a step is refused at admission
    or ends with grammar_too_expensive within its first tokens, as the request's own error,
    naming the limit; its blocks come back."""
    try:
        defaults.add_request("patho", "x", constrained(max_tokens=64, regex=PATHOLOGICAL))
    except GrammarError as e:
        assert e.code == TOO_EXPENSIVE and "--grammar-" in str(e), str(e)
        assert not defaults.has_unfinished_requests()
        return
    out = run_all(defaults)["patho"]
    assert out.error_is_request_fault and out.grammar_error_code == TOO_EXPENSIVE, out.error
    assert "--grammar-" in out.error and len(out.outputs[0].token_ids) < 8, out.error
    if "--grammar-mask-budget-ms" not in out.error:  # a limit, not a time: refused from now on
        with pytest.raises(GrammarError, match="ended an earlier request") as info:
            defaults.add_request("again", "x", constrained(regex=PATHOLOGICAL))
        assert info.value.code == TOO_EXPENSIVE and not defaults.has_unfinished_requests()


def test_huge_choice_is_refused_at_admission_naming_the_limit(defaults):
    """20,000 strings (a grammar of 20,000 symbols; once stalled a worker's other streams
    0.7 s): over --grammar-max-size (or, on a busy CPU, past the compile budget before
    llguidance gets to count), a GrammarError at admission; nothing is added."""
    rng = random.Random(0)
    choice = tuple("".join(rng.choices("abcdefghij", k=12)) for _ in range(20_000))
    limit = "--grammar-(max-size|compile-budget-ms)"
    with pytest.raises(GrammarError, match=limit) as info:
        defaults.grammars.check(StructuredOutputs(choice=choice))
    assert info.value.code == TOO_EXPENSIVE
    with pytest.raises(GrammarError, match=limit):
        defaults.add_request("choice", "x", constrained(choice=choice))
    assert not defaults.has_unfinished_requests() and defaults.pool.is_all_free


def test_n_over_the_grammar_rows_cap_is_refused(defaults):
    params = constrained(json=json.dumps(SCHEMAS["flat"]))
    params.n = GrammarConfig().max_rows + 1
    with pytest.raises(GrammarError, match="--max-grammar-rows") as info:
        defaults.add_request("rows", "x", params)
    assert info.value.code == LIMIT_EXCEEDED
    assert not defaults.has_unfinished_requests() and defaults.pool.is_all_free
    params.n = GrammarConfig().max_rows  # at the cap: admitted
    defaults.add_request("rows", "x", params)
    assert len(run_all(defaults)["rows"].outputs) == params.n


def test_a_grammar_that_compiles_past_its_budget_is_refused(tiny_model):
    """Compiling (its first mask included, where llguidance builds the lexer) runs on the
    compiler's threads; past --grammar-compile-budget-ms the spec is refused, and once the
    compile has finished, it still is."""
    engine = cost_engine(tiny_model, compile_budget_ms=1, lexer_fuel=NO_LEXER_LIMIT)
    spec = StructuredOutputs(regex=PATHOLOGICAL)
    with pytest.raises(GrammarError, match="--grammar-compile-budget-ms") as info:
        engine.add_request("slow", "x", constrained(regex=PATHOLOGICAL))
    assert info.value.code == TOO_EXPENSIVE and not engine.has_unfinished_requests()
    engine.grammars.submit(spec).result(timeout=60)  # done, off this thread
    with pytest.raises(GrammarError, match="--grammar-compile-budget-ms"):
        engine.grammars.check(spec)


def test_a_mask_over_budget_ends_its_request_and_frees_its_blocks(tiny_model):
    """Admitted (no lexer limit, a long compile budget), the regex's masks take ~0.1 s: past
    --grammar-mask-budget-ms its request ends with grammar_too_expensive, its blocks return
    to the pool, and a plain request beside it gets exactly its tokens alone."""
    engine = cost_engine(
        tiny_model, mask_budget_ms=1, compile_budget_ms=60_000, lexer_fuel=NO_LEXER_LIMIT
    )
    plain = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    engine.add_request("alone", "x", plain)
    alone = run_all(engine)["alone"].outputs[0].token_ids
    engine.add_request("victim", "x", plain)
    engine.add_request("patho", "The answer is", constrained(max_tokens=64, regex=PATHOLOGICAL))
    outs = run_all(engine)
    patho, victim = outs["patho"], outs["victim"]
    assert patho.error_is_request_fault and patho.grammar_error_code == TOO_EXPENSIVE
    assert "--grammar-mask-budget-ms" in patho.error, patho.error
    assert victim.error is None and victim.outputs[0].token_ids == alone
    _, refusals = engine.grammars.stats.snapshot()
    assert refusals.get("mask_budget") == 1


class BlockingMatcher:
    """A matcher whose mask computes (spends CPU) until `release` (if any), then allows every
    token; with `sleep`, it waits for `release` without computing, as a starved thread."""

    def __init__(self, release: threading.Event | None = None, sleep: bool = False):
        self.release = release
        self.sleep = sleep

    def unsafe_compute_mask_ptr(self, ptr: int, size: int) -> None:
        deadline = time.monotonic() + 30
        while self.release is not None and not self.release.is_set():
            if self.sleep:
                self.release.wait(30)
            elif time.monotonic() > deadline:
                break
        ctypes.memset(ptr, 0xFF, size)

    def is_error(self) -> bool:
        return False


def test_rows_past_the_mask_budget_end_and_rows_queued_behind_them_do_not():
    """Five masks that never finish in time and a quick one queued behind them on the mask
    threads: the five end with grammar_too_expensive; the quick one is not charged for their
    time, gets a second budget on a fresh pool, and is applied; the step waits no longer."""
    release = threading.Event()
    slow = [Grammar(BlockingMatcher(release)) for _ in range(5)]
    quick = Grammar(BlockingMatcher())

    class Seq:
        def __init__(self, grammar):
            self.grammar = grammar

    masks = GrammarMasks(64, budget_ms=200)
    logits = torch.randn(6, 64)
    before = logits.clone()
    try:
        pending = masks.start([Seq(g) for g in [*slow, quick]])
        masks.apply(pending, logits)
    finally:
        release.set()
    assert all(g.error_code == TOO_EXPENSIVE and "mask-budget" in g.error for g in slow)
    assert quick.error is None and torch.equal(logits, before)  # every token allowed


def test_a_mask_that_spends_no_cpu_is_waited_for_not_charged():
    """The budget charges a mask's own CPU time: a mask thread that a loaded machine starves
    (here: one that waits without computing, then finishes) does not end its request."""
    release = threading.Event()
    starved = Grammar(BlockingMatcher(release, sleep=True))
    masks = GrammarMasks(64, budget_ms=20)
    logits = torch.randn(1, 64)
    before = logits.clone()
    threading.Timer(0.2, release.set).start()  # ten budgets of wall time, no CPU
    masks.apply(masks.start([type("Seq", (), {"grammar": starved})()]), logits)
    assert starved.error is None and torch.equal(logits, before)
