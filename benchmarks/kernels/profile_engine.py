"""Where one engine step's time goes: prefill and decode, at batch 1 and 32.

Per step (ms, the median of the profiled steps): the scheduler, input/metadata preparation,
the model forward split into GEMMs, attention (KV write, paged gather, SDPA), the rest of the
math (norms, rope, activation, residuals, embedding) and Python/dispatch overhead (the forward's
wall time not spent in any op), the LM head, the sampler and output processing. "outside
forward" is the step's wall time less the forward and the LM head.

Wall times are medians over steps without the profiler; the forward's split comes from one more
step under torch.profiler (GEMM ops by name; everything inside the attention backend counts as
attention, paged gather included; other ops and compiled kernels by their own time), scaled to
the median forward.

    python benchmarks/kernels/profile_engine.py [--batch 1 32] [--enforce-eager] [--dtype float32]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from contextlib import contextmanager

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from common.engine.llm import LLM
from common.engine.sampling_params import SamplingParams

GEMM_OPS = (
    "aten::linear",
    "aten::addmm",
    "aten::mm",
    "aten::matmul",
    "mkldnn::_linear_pointwise",
    "pdserve::packed_linear",  # oneDNN inside
    "pdserve::skinny_linear",  # the C kernel (skinny_gemm.c), no op of its own inside
)
# containers and dispatch wrappers: their own time is overhead, their children are counted
WRAPPERS = ("Torch-Compiled Region", "TorchDynamo Cache Lookup", "Pregraph bytecode", "AOTDispatch")
FORWARD_PARTS = ("gemm", "attention", "norm/rope/act/other", "python overhead")
ROWS = ("schedule", "prepare", *FORWARD_PARTS, "lm head", "sampler", "update+outputs")


class StepTimer:
    """Wall-clock timers around the engine's phases, patched onto one engine instance."""

    def __init__(self, llm: LLM):
        self.times: dict[str, float] = defaultdict(float)
        engine, runner = llm.engine, llm.engine.runner
        self._wrap(engine.scheduler, "schedule", "schedule")
        self._wrap(engine.scheduler, "update", "update+outputs")
        self._wrap(engine, "_make_outputs", "update+outputs")
        self._wrap(runner, "prepare", "prepare")
        self._wrap(runner, "_execute", "execute")
        self._wrap(runner.model, "compute_logits", "lm head")
        sampler = runner.sampler
        runner.sampler = lambda *a: self._timed("sampler", sampler, *a)

    def _wrap(self, obj, name: str, label: str) -> None:
        fn = getattr(obj, name)
        setattr(obj, name, lambda *a, **k: self._timed(label, fn, *a, **k))

    def _timed(self, label, fn, *args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.times[label] += time.perf_counter() - start

    def take(self) -> dict[str, float]:
        t, self.times = self.times, defaultdict(float)
        t["forward"] = t["execute"] - t["prepare"] - t["lm head"] - t["sampler"]
        return t


def forward_split(prof) -> dict[str, float]:
    """The profiled forward's time by part (ms); what no op accounts for is overhead."""
    parts: dict[str, float] = defaultdict(float)
    forward = 0.0
    for evt in prof.events():
        scopes = _scopes(evt)
        if evt.name == "forward":
            forward += evt.cpu_time_total / 1e3
        elif "forward" not in scopes or "lm_head" in scopes or evt.name == "lm_head":
            continue
        elif evt.name == "attention":
            parts["attention"] += evt.cpu_time_total / 1e3
        elif "attention" in scopes or scopes & set(GEMM_OPS):
            continue
        elif evt.name in GEMM_OPS:
            parts["gemm"] += evt.cpu_time_total / 1e3
        elif not evt.name.startswith(WRAPPERS) and not evt.name.startswith("pdserve::"):
            parts["norm/rope/act/other"] += evt.self_cpu_time_total / 1e3  # incl. fused kernels
    split = {part: parts[part] for part in FORWARD_PARTS[:3]}
    split["python overhead"] = max(0.0, forward - sum(split.values()))
    return split


def _scopes(evt) -> set[str]:
    names, parent = set(), evt.cpu_parent
    while parent is not None:
        names.add(parent.name)
        parent = parent.cpu_parent
    return names


@contextmanager
def labelled_forward(llm: LLM):
    """record_function scopes around the forward, the attention backend and the LM head."""
    runner = llm.engine.runner
    backend = next(iter(runner.layers.values())).backend
    patches = [(runner, "_execute"), (backend, "forward"), (runner.model, "compute_logits")]
    saved = [getattr(obj, name) for obj, name in patches]
    labels = ("forward", "attention", "lm_head")
    for (obj, name), fn, label in zip(patches, saved, labels):
        setattr(obj, name, _scoped(fn, label))
    try:
        yield
    finally:
        for (obj, name), fn in zip(patches, saved):
            setattr(obj, name, fn)


def _scoped(fn, label):
    def call(*args, **kwargs):
        with record_function(label):
            return fn(*args, **kwargs)

    return call


def run_phase(llm: LLM, timer: StepTimer, batch: int, prompt_len: int, phase: str, steps: int):
    """Per-step wall times of `steps` steps of `phase`, and one profiled step's forward split."""
    engine = llm.engine
    g = torch.Generator().manual_seed(batch)
    vocab = engine.arch.vocab_size
    params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
    rows: list[dict[str, float]] = []
    split_rows: list[dict[str, float]] = []
    for rep in range(steps if phase == "prefill" else 1):
        prompts = torch.randint(100, vocab, (batch, prompt_len), generator=g).tolist()
        for i, p in enumerate(prompts):
            engine.add_request(f"{phase}-{batch}-{rep}-{i}", p, params)
        while engine.scheduler.waiting or any(
            r.num_output_tokens == 0 for r in engine.scheduler.running
        ):
            timer.take()
            row = _step(engine, timer)
            if phase == "prefill":
                rows.append(row)
        if phase == "decode":
            for _ in range(steps):
                timer.take()
                rows.append(_step(engine, timer))
            split_rows.append(_profiled_step(llm, timer))
        else:
            _drain(engine)
    if phase == "prefill":
        prompts = torch.randint(100, vocab, (batch, prompt_len), generator=g).tolist()
        for i, p in enumerate(prompts):
            engine.add_request(f"prefill-prof-{batch}-{i}", p, params)
        split_rows.append(_profiled_step(llm, timer))
    _drain(engine)
    engine.pool.reset_prefix_cache()
    return _median(rows), split_rows[-1]


def _step(engine, timer: StepTimer) -> dict[str, float]:
    start = time.perf_counter()
    engine.step()
    t = timer.take()
    t["step"] = time.perf_counter() - start
    return {k: v * 1e3 for k, v in t.items()}


def _profiled_step(llm: LLM, timer: StepTimer) -> dict[str, float]:
    timer.take()
    with labelled_forward(llm), profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.engine.step()
    timer.take()
    return forward_split(prof)


def _drain(engine) -> None:
    for req in list(engine.scheduler.running) + list(engine.scheduler.waiting):
        engine.abort_request(req.request_id)
    engine.step()


def _median(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r.get(k, 0.0) for r in rows) for k in rows[0]}


def report(label: str, wall: dict[str, float], split: dict[str, float]) -> dict[str, float]:
    fwd_total = sum(split.values())
    row = {k: wall.get(k, 0.0) for k in ROWS}
    for part in FORWARD_PARTS:  # the profiled split, scaled to the median forward
        row[part] = split[part] * wall["forward"] / fwd_total if fwd_total else 0.0
    row["step"] = wall["step"]
    row["outside forward"] = wall["step"] - wall["forward"] - wall["lm head"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--enforce-eager", action="store_true")
    args = parser.parse_args()

    start = time.perf_counter()
    llm = LLM(
        max_num_seqs=max(args.batch),
        max_num_batched_tokens=2048,
        dtype=args.dtype,
        enforce_eager=args.enforce_eager,
    )
    seconds, threads = time.perf_counter() - start, torch.get_num_threads()
    print(f"engine start-up: {seconds:.1f} s (compile {llm.engine.runner.compile_seconds:.1f} s)")
    print(f"{threads} threads, dtype {args.dtype}, enforce_eager {args.enforce_eager}")
    timer = StepTimer(llm)
    columns: dict[str, dict[str, float]] = {}
    for phase in ("prefill", "decode"):
        for b in args.batch:
            steps = 2 if phase == "prefill" else args.steps
            wall, split = run_phase(llm, timer, b, args.prompt_len, phase, steps)
            columns[f"{phase} b{b}"] = report(phase, wall, split)
    names = list(columns)
    print("| ms per step | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    for row in (*ROWS, "step", "outside forward"):
        cells = " | ".join(f"{columns[n][row]:.1f}" for n in names)
        print(f"| {row} | {cells} |")


if __name__ == "__main__":
    main()
