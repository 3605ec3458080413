"""Decode CUDA graphs against the plain forward (common/engine/decode_graphs.py), at the engine
level: one schedule of decode batches of 5 (over the largest size), 4, 3 (padded), 2, 1 (padded)
and a step of decodes with a prefill, run by an engine with graphs and one without.

Checked per engine pair: the same steps; every decode-only step that fits replayed its size's
graph and no other step did; each replay wrote the KV of its step's slots and, beyond them,
only the pad block's; greedy tokens and logits against the plain forward. The CPU tests use
`drive` and `watch_padding` through the same buffers uncaptured (tests/test_decode_graphs.py).
"""

from __future__ import annotations

import torch

from common.engine.llm import LLM
from common.engine.sampling_params import SamplingParams

SIZES = (2, 4)
LENS, OUTS = (5, 20, 37, 50, 30), (12, 9, 6, 6, 8)  # the fifth joins at the third step


def drive(engine, vocab: int, seed: int = 7):
    """(tokens by request, every step's logits, each step's (decodes, tokens))."""
    logits, shapes = [], []
    compute, prepare = engine.model.compute_logits, engine.runner.prepare
    engine.model.compute_logits = lambda h: logits.append(compute(h).float()) or logits[-1]

    def recorded(scheduled):
        batch = prepare(scheduled)
        shapes.append((batch.attn_metadata.num_decodes, batch.attn_metadata.num_tokens))
        return batch

    engine.runner.prepare = recorded
    g = torch.Generator().manual_seed(seed)
    tokens: dict[str, list[int]] = {}
    try:
        for i, (n, m) in enumerate(zip(LENS, OUTS)):
            if i == 4:  # joins a running batch
                engine.step(), engine.step()
            prompt = torch.randint(3, vocab - 3, (n,), generator=g).tolist()
            params = SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
            engine.add_request(str(i), prompt, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens[out.request_id] = list(out.outputs[0].token_ids)
    finally:
        del engine.model.compute_logits, engine.runner.prepare
    return tokens, torch.cat(logits).cpu(), shapes


def watch_padding(engine) -> list[str]:
    """Wrap the engine's graph runs: each must write its step's KV slots and, beyond them, only
    the pad block's; a request must never hold the pad block. Returns the problems found (the
    list fills as steps run)."""
    graphs, problems = engine.runner.graphs, []
    caches, run = list(engine.runner.kv_caches.values()), graphs.run
    block = graphs.block_size
    pad = set(range(graphs.pad_block * block, (graphs.pad_block + 1) * block))

    def checked(input_ids, positions, meta):
        if (meta.block_table == graphs.pad_block).any():  # 0-padded tables never reach it
            problems.append(f"a request holds the pad block {graphs.pad_block}")
        before = [c.clone() for c in caches]
        hidden = run(input_ids, positions, meta)
        changed = set()
        for old, new in zip(before, caches):  # (2, blocks, block_size, H, D) → slots
            slot_changed = (old != new).flatten(3).any(-1).any(0).flatten()
            changed |= set(slot_changed.nonzero()[:, 0].tolist())
        slots = set(meta.slot_mapping.tolist())
        if not slots <= changed:
            problems.append(f"batch of {meta.num_seqs}: slots {sorted(slots - changed)} unwritten")
        if changed - slots - pad:
            problems.append(f"batch of {meta.num_seqs}: wrote {sorted(changed - slots - pad)}")
        return hidden

    graphs.run = checked
    return problems


def expected_replays(shapes: list[tuple[int, int]], sizes) -> dict[int, int]:
    """By size, the steps of `shapes` ((decodes, tokens) each) that should replay its graph:
    the decode-only ones that fit, each in the smallest size that holds it."""
    fitting = [d for d, t in shapes if d == t and d <= max(sizes)]
    return {s: sum(1 for d in fitting if min(x for x in sizes if x >= d) == s) for s in sizes}


def agreeing_prefix(got: list[int], ref: list[int]) -> int:
    """How many tokens agree before the first difference."""
    return next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), len(got))


def check(
    model: str | None, device: str, dtype: str, sizes=SIZES, tolerance=None, num_blocks=None
) -> dict:
    """Graphs of `sizes` (None: the engine's default) against none, on `model` (None: SmolLM2).
    With `tolerance` (on the logits' largest difference) the tokens must also be equal;
    without (bf16: a padded batch may round otherwise), they and the difference are reported.
    `num_blocks`: the KV pool's size (None: what memory allows); `watch_padding` copies and
    compares the whole KV at every replay, so a CPU run (which sizes its pool by host memory:
    ~87k blocks) names a small one."""
    options = dict(device=device, dtype=dtype, enable_prefix_caching=False, max_model_len=512)
    if num_blocks is not None:
        options["num_blocks"] = num_blocks
    with_graphs = LLM(model, cuda_graph_sizes=sizes, **options).engine
    plain = LLM(model, cuda_graph_sizes=(), **options).engine
    graphs = with_graphs.runner.graphs
    if graphs is None:
        return {"status": "failed", "error": "no graphs (capture failed: see the log)"}
    vocab = with_graphs.arch.vocab_size
    problems = watch_padding(with_graphs)
    tokens, logits, shapes = drive(with_graphs, vocab)
    ref_tokens, ref_logits, ref_shapes = drive(plain, vocab)
    if shapes != ref_shapes:
        problems.append(f"other steps: {shapes} vs {ref_shapes}")
    sizes = graphs.sizes
    expected = expected_replays(shapes, sizes)
    replays = {s: graphs.num_replays[s] for s in sizes}
    if replays != expected:
        problems.append(f"replays by size {replays}, expected {expected}")
    agree = {rid: agreeing_prefix(t, ref_tokens[rid]) for rid, t in tokens.items()}
    same = tokens == ref_tokens
    diff = (logits - ref_logits).abs().max().item() if logits.shape == ref_logits.shape else None
    if tolerance is not None and not (same and diff is not None and diff < tolerance):
        problems.append(f"tokens equal: {same}, largest logit difference {diff}")
    blocks_back = with_graphs.pool.num_used_blocks == 0 == plain.pool.num_used_blocks
    if not blocks_back:
        problems.append("blocks still held after every request finished")
    backend = next(iter(with_graphs.model.attention_layers().values())).backend.name
    return {
        "status": "failed" if problems else "passed",
        "problems": problems,
        "dtype": dtype,
        "backend": backend,
        "sizes": list(sizes),
        "captured": graphs.captured,
        "capture_s": round(with_graphs.runner.capture_seconds, 2),
        "replays": replays,
        "tokens_equal": same,
        "agreeing_prefix": agree,
        "max_logit_diff": diff,
        "blocks_back": blocks_back,
    }
