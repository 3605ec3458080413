"""benchmarks/peers/protocol.py: sides of an interleaved benchmark as real child processes speaking
the
line protocol; rounds rotate the sides' order, and a dead side is a clear error."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from benchmarks.peers.protocol import Peer, interleave, machine_header, peer_env, spread

ROOT = Path(__file__).resolve().parents[1]
CHILD = """
import sys, time
sys.path.insert(0, {root!r})
from benchmarks.peers.protocol import serve
calls = []
def generate(batch, new_tokens):
    calls.append((batch, new_tokens))
    time.sleep({seconds} * batch)
    print("generated", batch, new_tokens)  # chatter: must go to the log, not the protocol
serve(generate, {{"warmed": "yes"}})
print("calls", calls, file=sys.stderr)
"""


def _peer(tmp_path: Path, name: str, seconds: float) -> Peer:
    script = tmp_path / f"{name}.py"
    script.write_text(CHILD.format(root=str(ROOT), seconds=seconds))
    env = peer_env([1, 2], 16)
    return Peer(name, [sys.executable, str(script)], env, tmp_path / f"{name}.log")


def test_rounds_interleave_every_side_and_batch(tmp_path, capsys):
    fast, slow = _peer(tmp_path, "fast", 0.01), _peer(tmp_path, "slow", 0.04)
    for peer in (fast, slow):
        peer.start()
        assert peer.info == {"warmed": "yes"}
    try:
        results = interleave([fast, slow], [1, 2], rounds=3)
    finally:
        fast.stop(), slow.stop()
    for name in ("fast", "slow"):
        assert {c: len(v) for c, v in results[name].items()} == {1: 3, 2: 3}
    # 16 tokens in >= 0.01 s a batch row: at most 1600 tok/s for fast, 400 for slow
    assert max(results["fast"][1]) <= 1600 and max(results["slow"][1]) <= 400
    order = [line.split(", ")[2].split(":")[0] for line in capsys.readouterr().out.splitlines()]
    assert order[:2] == ["fast", "slow"] and order[4:6] == ["slow", "fast"]  # rotated
    log = (tmp_path / "fast.log").read_text()
    # warm-up: every batch size at the warm-up length, then the rounds at --new-tokens
    assert "calls [(1, 8), (2, 8), (1, 16), (2, 16)," in log and "generated 1 16" in log


def test_a_side_that_dies_is_named_with_its_log(tmp_path):
    script = tmp_path / "dies.py"
    script.write_text("raise SystemExit(3)\n")
    peer = Peer("dies", [sys.executable, str(script)], peer_env([1], 4), tmp_path / "dies.log")
    with pytest.raises(RuntimeError, match=r"dies exited \(3\); log: .*dies.log"):
        peer.start()


def test_spread_and_header():
    assert spread([3.0, 1.0, 2.0]) == "2.0 [1.0-3.0]"
    header = machine_header()
    assert header.startswith("cpu: ") and "commit: " in header and "load average" in header
