"""P/D over NIXL equals colocated, pull and push, with a P and a D engine driven directly.

`compare(p, d, prompts, max_tokens)`: prompt by prompt (batch 1, so that every run computes the
same shapes and bf16 results compare bit for bit): colocated on D; pull (P prefills with
`do_remote_decode` and max_tokens=1, D reads the blocks named in P's answer); push (D reserves,
P writes each layer into the reservation as it computes, D decodes once all layers landed).
Passes when the token ids are equal, no request errored (policy "fail": a lost transfer is
never silently recomputed), KV really moved (D's loads, P's pushed bytes) and every block
came back on both sides.

`burst_push(...)`: several pushes in flight together (one P step holds chunks of all of them);
passes on no errors (with checksums on, D verifies every pushed block) and every block back.
Its token agreement with colocated is reported, not asserted: batch shapes differ on D.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from tests.gpu.engines import ChildEngine, EngineSide, EngineSpec, Job


@contextmanager
def engine_pair(spec: EngineSpec, processes: int = 1) -> Iterator[tuple]:
    """(P, D), connected both ways; D in a child process when `processes` is 2."""
    sides: list = []
    try:
        sides.append(EngineSide(spec, "prefill"))
        sides.append(EngineSide(spec, "decode") if processes == 1 else ChildEngine(spec, "decode"))
        p, d = sides
        p.add_peer(*d.peer_info())
        d.add_peer(*p.peer_info())
        yield p, d
    finally:
        for side in reversed(sides):
            side.close()


def pull(p, d, rid: str, prompt: list[int], max_tokens: int) -> dict:
    first = p.run([Job(rid, prompt, 1, {"do_remote_decode": True})])[rid]
    if first["error"]:
        return first
    return d.run([Job(rid, prompt, max_tokens, first["kv_transfer_params"])])[rid]


def push(p, d, rid: str, prompt: list[int], max_tokens: int) -> dict:
    target = d.reserve(len(prompt))
    params = {"do_remote_decode": True, "push_to": target}
    first = p.run([Job(rid, prompt, 1, params)])[rid]
    if first["error"]:
        return first
    return d.run([Job(rid, prompt, max_tokens, first["kv_transfer_params"])])[rid]


FLOWS = {"pull": pull, "push": push}


def compare(p, d, prompts: list[list[int]], max_tokens: int) -> dict:
    before = p.stats(), d.stats()
    problems: list[dict] = []
    for i, prompt in enumerate(prompts):
        ref = colocated(d, f"colocated-{i}", prompt, max_tokens)
        for mode, flow in FLOWS.items():
            got = flow(p, d, f"{mode}-{i}", prompt, max_tokens)
            if (why := difference(got, ref)) is not None:
                problems.append({"mode": mode, "prompt_tokens": len(prompt), **why})
        if any("error" in problem for problem in problems):
            break  # transfers fail (each after a timeout): more prompts tell nothing new
    moved = transferred(before, (p.stats(), d.stats()))
    blocks_back = {"prefill": p.settle(), "decode": d.settle()}
    passed = (
        not problems
        and moved["pull"]["num_loads"] == len(prompts)
        and moved["pull"]["bytes_loaded"] > 0
        and moved["push"]["bytes_pushed"] > 0
        and not any(moved[m]["num_failed"] for m in FLOWS)
        and all(blocks_back.values())
    )
    return {
        "status": "passed" if passed else "failed",
        "num_prompts": len(prompts),
        "prompt_tokens": [len(x) for x in prompts],
        "max_tokens": max_tokens,
        "kv_moved": moved,
        "blocks_back": blocks_back,
        "problems": problems,
    }


def burst_push(p, d, prompts: list[list[int]], max_tokens: int) -> dict:
    refs = {f"burst-{i}": colocated(d, f"ref-{i}", x, max_tokens) for i, x in enumerate(prompts)}
    pushed_before = p.stats()["bytes_pushed"]
    jobs = []
    for i, prompt in enumerate(prompts):
        target = d.reserve(len(prompt))
        jobs.append(Job(f"burst-{i}", prompt, 1, {"do_remote_decode": True, "push_to": target}))
    firsts = p.run(jobs)
    errors = {rid: out["error"] for rid, out in firsts.items() if out["error"]}
    decode = [
        Job(j.request_id, j.prompt, max_tokens, firsts[j.request_id]["kv_transfer_params"])
        for j in jobs
        if j.request_id not in errors
    ]
    outs = d.run(decode)
    errors |= {rid: out["error"] for rid, out in outs.items() if out["error"]}
    equal = sum(out["token_ids"] == refs[rid]["token_ids"] for rid, out in outs.items())
    bytes_pushed = p.stats()["bytes_pushed"] - pushed_before
    blocks_back = {"prefill": p.settle(), "decode": d.settle()}
    passed = not errors and bytes_pushed > 0 and all(blocks_back.values())
    return {
        "status": "passed" if passed else "failed",
        "num_prompts": len(prompts),
        "bytes_pushed": bytes_pushed,
        "errors": errors,
        "tokens_equal_to_colocated": f"{equal}/{len(outs)} (reported, not asserted)",
        "blocks_back": blocks_back,
    }


def colocated(d, rid: str, prompt: list[int], max_tokens: int) -> dict:
    out = d.run([Job(rid, prompt, max_tokens)])[rid]
    assert out["error"] is None, f"colocated run failed: {out['error']}"
    return out


def difference(got: dict, ref: dict) -> dict | None:
    if got["error"]:
        return {"error": got["error"]}
    a, b = got["token_ids"], ref["token_ids"]
    if a == b:
        return None
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return {"first_different_token": first, "got": a, "colocated": b}


def transferred(before: tuple[dict, dict], after: tuple[dict, dict]) -> dict:
    """What moved between two snapshots of (P's stats, D's stats)."""
    (p0, d0), (p1, d1) = before, after

    def delta(stats0: dict, stats1: dict, key: str):
        return stats1[key] - stats0[key]

    return {
        "pull": {
            "num_loads": delta(d0, d1, "num_loads"),
            "bytes_loaded": delta(d0, d1, "bytes_loaded"),
            "num_failed": delta(d0, d1, "num_failed"),
        },
        "push": {
            "bytes_pushed": delta(p0, p1, "bytes_pushed"),
            "num_failed": delta(p0, p1, "num_push_failures"),
        },
        "checksum_failures": delta(d0, d1, "num_checksum_failures"),
    }
