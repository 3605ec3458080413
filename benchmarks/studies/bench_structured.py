"""Structured outputs' cost: the grammar libraries side by side, and the engine with and without
a grammar.

1. Libraries (`--libraries-only` runs only this part, without the engine, in any virtualenv that
   has `tokenizers` and `numpy` and one or both of llguidance and xgrammar): for SmolLM2's
   tokenizer (tokenizer.json of the prepared default model) and five test schemas (a flat object,
   a nested object, an array of enums, anyOf with null, a tool-call array), each library's
   tokenizer set-up (once), each schema's first-use compile (schema text to a matcher, as a
   request would see it, ms), the first mask (ms: lazy work lands here), and the per-token mask
   time (µs, median and p99) while walking a valid compact instance of the schema token by token:
   on the first walk (a first request) and on `--walks` - 1 later walks with fresh matchers
   (warm). JSON is compact in both (llguidance: whitespace_flexible false, as the engine;
   xgrammar: any_whitespace false, separators "," and ":"). This code is the benchmark's only:
   the engine uses llguidance (common/engine/structured.py).

    python -m benchmarks.studies.bench_structured --libraries-only [--library llguidance xgrammar]
    # xgrammar is not in the project's venv; a scratch one:
    python3 -m venv /tmp/xgv && /tmp/xgv/bin/pip install torch==2.13.0 \
        && /tmp/xgv/bin/pip install xgrammar llguidance tokenizers numpy
    PYTHONPATH=. /tmp/xgv/bin/python -m benchmarks.studies.bench_structured \
        --libraries-only

2. Engine (the project's venv): `LLM(SmolLM2, dtype="float32")`, compiled, 32 prompts of 128
   random token ids, 128 new tokens, greedy, at batch 1 and 32. The constrained side follows a
   schema whose instances are long (an object with an array of at least 200 integers), so every
   request runs to max_tokens (finish_reason length, checked); the unconstrained side ignores EOS.
   The two sides alternate within each round (their order rotating), `--rounds` rounds: output
   tok/s median [min-max], the ratio of the medians. On the constrained side's timed runs
   GrammarMasks is wrapped: per step with grammars, `_fill` (one row's mask, on the mask
   threads during the forward, summed over the rows), `apply` (all of it, the wait included) and
   the wait in `apply` for every row's fill; "hidden" is the share of the fill time not waited
   for. A grammar's cost to the other streams of its worker: bench_grammar_cost.py.

    python -m benchmarks.studies.bench_structured [--rounds 3] [--concurrency 1 32]
        [--skip-libraries]

The issue's goals: constrained >= 0.9x unconstrained tok/s at batch 32, first-use compile under
100 ms for the test schemas.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from concurrent import futures
from pathlib import Path

from benchmarks.peers.protocol import machine_header, spread

LIBRARIES = ("llguidance", "xgrammar")
EOS_TOKEN_ID = 2  # SmolLM2's <|im_end|>
VOCAB_SIZE = 49152

_WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "location": {"type": "string"},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["location", "unit"],
}
_TIME_PARAMS = {
    "type": "object",
    "properties": {"timezone": {"type": "string"}},
    "required": ["timezone"],
}

# name → (schema, a valid instance: walked in its compact form)
SCHEMAS: dict[str, tuple[dict, object]] = {
    "flat object": (
        {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "age": {"type": "integer"},
                "email": {"type": "string"},
                "active": {"type": "boolean"},
                "score": {"type": "number"},
            },
            "required": ["name", "age", "email", "active", "score"],
        },
        {
            "name": "Ada Lovelace",
            "age": 36,
            "email": "ada@example.com",
            "active": True,
            "score": 98.5,
        },
    ),
    "nested object": (
        {
            "type": "object",
            "properties": {
                "id": {"type": "integer"},
                "customer": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string"},
                        "address": {
                            "type": "object",
                            "properties": {
                                "street": {"type": "string"},
                                "city": {"type": "string"},
                                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                            },
                            "required": ["street", "city", "zip"],
                        },
                    },
                    "required": ["name", "address"],
                },
                "lines": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "sku": {"type": "string"},
                            "qty": {"type": "integer", "minimum": 1},
                        },
                        "required": ["sku", "qty"],
                    },
                },
            },
            "required": ["id", "customer", "lines"],
        },
        {
            "id": 1042,
            "customer": {
                "name": "Grace Hopper",
                "address": {"street": "12 Navy Yard Rd", "city": "Arlington", "zip": "22202"},
            },
            "lines": [{"sku": "COBOL-1", "qty": 2}, {"sku": "UNIVAC", "qty": 1}],
        },
    ),
    "array of enums": (
        {
            "type": "array",
            "items": {"enum": ["red", "green", "blue", "yellow", "cyan", "magenta"]},
            "minItems": 1,
            "maxItems": 16,
        },
        ["red", "green", "blue", "blue", "yellow", "magenta", "cyan", "red"],
    ),
    "anyOf / null": (
        {
            "type": "object",
            "properties": {
                "value": {"anyOf": [{"type": "number"}, {"type": "string"}, {"type": "null"}]},
                "unit": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                "error": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            },
            "required": ["value", "unit", "error"],
        },
        {"value": 21.5, "unit": "celsius", "error": None},
    ),
    "tool calls": (
        {
            "type": "array",
            "minItems": 1,
            "items": {
                "anyOf": [
                    {
                        "type": "object",
                        "properties": {
                            "name": {"enum": ["get_weather"]},
                            "parameters": _WEATHER_PARAMS,
                        },
                        "required": ["name", "parameters"],
                    },
                    {
                        "type": "object",
                        "properties": {
                            "name": {"enum": ["get_time"]},
                            "parameters": _TIME_PARAMS,
                        },
                        "required": ["name", "parameters"],
                    },
                ]
            },
        },
        [
            {"name": "get_weather", "parameters": {"location": "Paris, France", "unit": "celsius"}},
            {"name": "get_time", "parameters": {"timezone": "Europe/Paris"}},
        ],
    ),
}

# the engine part's schema: instances of at least 200 integers, longer than 128 tokens
LONG_SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "items": {"type": "integer"}, "minItems": 200}},
    "required": ["items"],
}


def compact(value: object) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def model_dir(arg: str | None) -> Path:
    """The prepared default model's folder, without importing the project (so that a scratch
    virtualenv can run the library part): common/model/default_model.py's cache layout."""
    if arg:
        return Path(arg)
    cache = os.environ.get("PDSERVE_CACHE_DIR") or Path.home() / ".cache" / "pdserve"
    return Path(cache) / "SmolLM2-135M-Instruct"


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


# --- the libraries, behind one interface: setup(tokenizer.json) → compile(schema) → walk ---


class LlguidanceLib:
    name = "llguidance"

    def __init__(self):
        import llguidance
        import numpy as np

        self._llg, self._np = llguidance, np
        self.version = _version("llguidance")

    def setup(self, tokenizer_json: str) -> None:
        self.tok = self._llg.LLTokenizer(
            tokenizer_json, n_vocab=VOCAB_SIZE, eos_token=[EOS_TOKEN_ID]
        )
        self._words = (VOCAB_SIZE + 31) // 32

    def compile(self, schema_text: str):
        """As GrammarCompiler does: schema → grammar, validated against the tokenizer."""
        matcher_cls = self._llg.LLMatcher
        grammar = matcher_cls.grammar_from_json_schema(
            schema_text, defaults={"whitespace_flexible": False}
        )
        error = matcher_cls.validate_grammar(grammar, self.tok)
        assert not error, error
        return grammar

    def matcher(self, compiled):
        return self._llg.LLMatcher(self.tok, compiled)

    def new_mask(self):
        return self._np.zeros(self._words, dtype=self._np.int32)

    def fill(self, matcher, mask) -> None:
        matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)

    @staticmethod
    def allowed(mask, token_id: int) -> bool:
        return bool((int(mask[token_id // 32]) >> (token_id % 32)) & 1)

    def accept(self, matcher, token_id: int) -> bool:
        return matcher.consume_token(token_id)

    def finished_ok(self, matcher, mask) -> bool:
        return self.allowed(mask, EOS_TOKEN_ID) or matcher.is_stopped()


class XgrammarLib:
    name = "xgrammar"

    def __init__(self):
        import xgrammar

        self._xgr = xgrammar
        self.version = _version("xgrammar")

    def setup(self, tokenizer_json: str) -> None:
        vocab = json.loads(tokenizer_json)
        encoded = [""] * VOCAB_SIZE  # token strings as stored (byte-level), by id
        for token, token_id in vocab["model"]["vocab"].items():
            encoded[token_id] = token
        for added in vocab.get("added_tokens", []):
            encoded[added["id"]] = added["content"]
        info = self._xgr.TokenizerInfo(
            encoded,
            vocab_type=self._xgr.VocabType.BYTE_LEVEL,
            vocab_size=VOCAB_SIZE,
            stop_token_ids=[EOS_TOKEN_ID],
            add_prefix_space=False,
        )
        self.compiler = self._xgr.GrammarCompiler(info, max_threads=os.cpu_count() or 1)

    def compile(self, schema_text: str):
        return self.compiler.compile_json_schema(
            schema_text, any_whitespace=False, separators=(",", ":")
        )

    def matcher(self, compiled):
        return self._xgr.GrammarMatcher(compiled)

    def new_mask(self):
        return self._xgr.allocate_token_bitmask(1, VOCAB_SIZE)

    def fill(self, matcher, mask) -> None:
        matcher.fill_next_token_bitmask(mask)

    @staticmethod
    def allowed(mask, token_id: int) -> bool:
        return bool((int(mask[0, token_id // 32]) >> (token_id % 32)) & 1)

    def accept(self, matcher, token_id: int) -> bool:
        return matcher.accept_token(token_id)

    def finished_ok(self, matcher, mask) -> bool:
        return self.allowed(mask, EOS_TOKEN_ID) or matcher.is_terminated()


LIBRARY_CLASSES = {"llguidance": LlguidanceLib, "xgrammar": XgrammarLib}


def walk(lib, compiled, token_ids: list[int]) -> tuple[float, list[float]]:
    """(matcher construction s, per-token mask seconds) over one valid token sequence: a mask
    before each token (the token must be in it), and one after the last (EOS must be)."""
    start = time.perf_counter()
    matcher = lib.matcher(compiled)
    made = time.perf_counter() - start
    mask, times = lib.new_mask(), []
    for i, token_id in enumerate([*token_ids, None]):
        start = time.perf_counter()
        lib.fill(matcher, mask)
        times.append(time.perf_counter() - start)
        if token_id is None:
            assert lib.finished_ok(matcher, mask), f"{lib.name}: EOS not allowed at the end"
            break
        assert lib.allowed(mask, token_id), f"{lib.name}: token {i} ({token_id}) masked out"
        assert lib.accept(matcher, token_id), f"{lib.name}: token {i} ({token_id}) refused"
    return made, times


def bench_library(name: str, tokenizer_json: str, walks: int) -> list[dict]:
    from tokenizers import Tokenizer

    hf = Tokenizer.from_str(tokenizer_json)
    lib = LIBRARY_CLASSES[name]()  # the import, untimed
    start = time.perf_counter()
    lib.setup(tokenizer_json)
    setup_ms = (time.perf_counter() - start) * 1e3
    print(f"  {name} {lib.version}: tokenizer set-up {setup_ms:.0f} ms", flush=True)
    rows = []
    for schema_name, (schema, instance) in SCHEMAS.items():
        token_ids = hf.encode(compact(instance), add_special_tokens=False).ids
        start = time.perf_counter()
        compiled = lib.compile(json.dumps(schema))
        compile_s = time.perf_counter() - start
        made, first = walk(lib, compiled, token_ids)
        warm = []
        for _ in range(walks - 1):
            warm += walk(lib, compiled, token_ids)[1]
        rows.append(
            dict(
                library=name,
                version=lib.version,
                setup_ms=setup_ms,
                schema=schema_name,
                tokens=len(token_ids),
                compile_ms=(compile_s + made) * 1e3,
                first_mask_ms=first[0] * 1e3,
                first_median_us=statistics.median(first[1:]) * 1e6,
                first_p99_us=_percentile(first[1:], 0.99) * 1e6,
                warm_median_us=statistics.median(warm) * 1e6 if warm else float("nan"),
                warm_p99_us=_percentile(warm, 0.99) * 1e6 if warm else float("nan"),
            )
        )
    return rows


def print_library_table(rows: list[dict]) -> None:
    print(
        "\nGrammar libraries, SmolLM2 tokenizer (49152 tokens), compact JSON; masks over a valid "
        "instance, token by token\n"
        "(compile: schema text to a ready matcher; 1st mask: the first mask of the first walk; "
        "walk 1: the rest of the first walk; warm: later walks, fresh matchers)"
    )
    header = (
        f"{'library':<19}{'set-up ms':>10}  {'schema':<15}{'tokens':>7}{'compile ms':>11}"
        f"{'1st mask ms':>12}{'walk 1 µs med/p99':>20}{'warm µs med/p99':>18}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        lib = f"{r['library']} {r['version']}"
        print(
            f"{lib:<19}{r['setup_ms']:>10.0f}  {r['schema']:<15}{r['tokens']:>7}"
            f"{r['compile_ms']:>11.2f}{r['first_mask_ms']:>12.3f}"
            f"{r['first_median_us']:>12.1f}/{r['first_p99_us']:<7.1f}"
            f"{r['warm_median_us']:>10.1f}/{r['warm_p99_us']:<7.1f}"
        )


def run_libraries(args) -> None:
    tokenizer_json = (model_dir(args.model) / "tokenizer.json").read_text()
    rows = []
    for name in args.library:
        try:
            rows += bench_library(name, tokenizer_json, args.walks)
        except ImportError as e:
            print(f"  {name}: not importable here ({e}); skipped", flush=True)
    if rows:
        print_library_table(rows)


# --- the engine with and without a grammar ---


class MaskTimer:
    """Wraps one GrammarMasks' `_fill` (one row's mask, on a mask thread) and `apply`: seconds
    per step with grammars, the fill summed over the step's rows."""

    def __init__(self, masks):
        self.masks = masks
        self._fill, self._apply = masks._fill, masks.apply
        self.on = False
        self.steps: list[dict] = []  # {rows, fill, apply, wait}
        self._fills: dict[int, float] = {}

        def fill(grammar, row):
            start = time.perf_counter()
            self._fill(grammar, row)
            self._fills[id(grammar)] = time.perf_counter() - start

        def apply(pending, logits):
            start = time.perf_counter()
            futures.wait(pending.futures)
            waited = time.perf_counter() - start
            self._apply(pending, logits)
            total = time.perf_counter() - start
            fill_s = sum(self._fills.pop(id(g), float("nan")) for g in pending.grammars)
            if self.on:
                self.steps.append(
                    dict(rows=len(pending.rows), fill=fill_s, apply=total, wait=waited)
                )

        masks._fill, masks.apply = fill, apply


def run_engine(args) -> None:
    import torch

    from common.engine.llm import LLM
    from common.engine.sampling_params import SamplingParams, StructuredOutputs

    start = time.perf_counter()
    llm = LLM(
        str(model_dir(args.model)),
        dtype="float32",
        max_num_seqs=max(args.concurrency),
        max_num_batched_tokens=2048,
    )
    print(f"  engine (compiled) start-up {time.perf_counter() - start:.1f} s", flush=True)
    timer = MaskTimer(llm.engine.runner.masks)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(
        100, VOCAB_SIZE, (max(args.concurrency), args.prompt_len), generator=g
    ).tolist()
    spec = StructuredOutputs(json=json.dumps(LONG_SCHEMA))
    start = time.perf_counter()
    llm.engine.grammars.check(spec)
    print(f"  long schema's first compile {1e3 * (time.perf_counter() - start):.1f} ms")

    def params(side: str, new_tokens: int) -> SamplingParams:
        if side == "constrained":
            return SamplingParams(temperature=0, max_tokens=new_tokens, structured=spec)
        return SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)

    def run(side: str, batch: int, new_tokens: int) -> float:
        llm.engine.pool.reset_prefix_cache()
        start = time.perf_counter()
        outs = llm.generate(prompts[:batch], params(side, new_tokens))
        elapsed = time.perf_counter() - start
        for o in outs:
            c = o.outputs[0]
            assert len(c.token_ids) == new_tokens and c.finish_reason == "length", (
                side,
                len(c.token_ids),
                c.finish_reason,
                c.text[:200],
            )
        return batch * new_tokens / elapsed, outs[0].outputs[0].text

    sides = ["constrained", "unconstrained"]
    for batch in args.concurrency:  # warm-up: every shape on both sides
        for side in sides:
            run(side, batch, 8)
    results = {s: {c: [] for c in args.concurrency} for s in sides}
    steps = {c: [] for c in args.concurrency}
    sample = ""
    for r in range(args.rounds):
        order = sides[r % 2 :] + sides[: r % 2]
        for batch in args.concurrency:
            for side in order:
                timer.on = side == "constrained"
                timer.steps = []
                tok_s, text = run(side, batch, args.new_tokens)
                timer.on = False
                if side == "constrained":
                    steps[batch] += timer.steps
                    sample = sample or text
                results[side][batch].append(tok_s)
                print(f"  round {r + 1}, batch {batch}, {side}: {tok_s:.1f} tok/s", flush=True)
    print(f"  a constrained output (batch 1's first, cut): {sample[:100]}...")
    print_engine_table(args, results, steps)
    llm.shutdown()


def print_engine_table(args, results: dict, steps: dict) -> None:
    print(
        f"\nEngine, SmolLM2-135M float32 compiled, {args.prompt_len}-token prompts, "
        f"{args.new_tokens} new tokens, greedy; {args.rounds} interleaved rounds, "
        "median [min-max]"
    )
    header = (
        f"{'batch':>5}  {'unconstrained tok/s':<24}{'constrained tok/s':<24}{'ratio':>6}"
        f"{'fill µs/step':>14}{'fill µs/row':>13}{'apply µs/step':>15}{'wait µs':>9}"
        f"{'hidden':>8}{'steps':>7}"
    )
    print(header)
    print("-" * len(header))
    for batch in args.concurrency:
        un, con = results["unconstrained"][batch], results["constrained"][batch]
        ratio = statistics.median(con) / statistics.median(un)
        st = [s for s in steps[batch] if s["rows"] == batch] or steps[batch]
        fill = [s["fill"] for s in st]
        apply = [s["apply"] for s in st]
        wait = [s["wait"] for s in st]
        hidden = 1 - sum(wait) / sum(fill)
        print(
            f"{batch:>5}  {spread(un):<24}{spread(con):<24}{ratio:>6.3f}"
            f"{statistics.median(fill) * 1e6:>14.0f}{statistics.median(fill) / batch * 1e6:>13.1f}"
            f"{statistics.median(apply) * 1e6:>15.0f}{statistics.median(wait) * 1e6:>9.0f}"
            f"{hidden:>8.0%}{len(st):>7}"
        )
    print(
        "(fill: GrammarMasks._fill on the mask threads, summed over rows; apply: "
        "GrammarMasks.apply, its wait for the fill included;\n wait: for every row's fill; "
        "hidden: 1 - sum(wait) "
        "/ sum(fill); medians over the constrained timed runs' steps with every row sampled)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--libraries-only", action="store_true", help="no engine part")
    parser.add_argument("--skip-libraries", action="store_true", help="the engine part only")
    parser.add_argument("--library", nargs="+", default=list(LIBRARIES), choices=LIBRARIES)
    parser.add_argument("--walks", type=int, default=5, help="walks per schema (1 + warm)")
    parser.add_argument("--model", help="model folder (default: the prepared SmolLM2)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    print(machine_header())
    if not args.skip_libraries:
        run_libraries(args)
    if not args.libraries_only:
        run_engine(args)
        print(machine_header())  # the load average after the run, too


if __name__ == "__main__":
    main()
