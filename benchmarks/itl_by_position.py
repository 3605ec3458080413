"""Inter-token latency by position in the stream, from `serve.py --save-detailed` results.

In a P/D cluster the first gap (the prefill worker's first token → the decode worker's first)
is the hand-off: the decode worker admits the request at its next step boundary and computes
it in the step after. With 32 output tokens that gap is 1 of 31 samples per request, which is
enough to set the pooled ITL p99 on its own. This prints each early position's median and
max, and the pooled p99 with and without the first gap.

    python -m benchmarks.serve ... --save-detailed --result-file run.json
    python benchmarks/itl_by_position.py run.json [more.json ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np


def summarize(itls: list[list[float]], positions: int = 4) -> list[str]:
    lines = ["| gap | n | median ms | max ms |", "|---|---:|---:|---:|"]
    for pos in range(positions):
        gaps = [seq[pos] * 1e3 for seq in itls if len(seq) > pos]
        if gaps:
            lines.append(f"| {pos + 1} | {len(gaps)} | {np.median(gaps):.1f} | {max(gaps):.1f} |")
    pooled = [g * 1e3 for seq in itls for g in seq]
    rest = [g * 1e3 for seq in itls for g in seq[1:]]
    if pooled:
        lines.append(f"ITL p99, every gap: {np.percentile(pooled, 99):.1f} ms")
    if rest:
        lines.append(f"ITL p99, without the first gap: {np.percentile(rest, 99):.1f} ms")
    return lines


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for path in sys.argv[1:]:
        result = json.loads(Path(path).read_text(encoding="utf-8"))
        if "itls" not in result:
            sys.exit(f"{path}: no per-request 'itls' (run serve.py with --save-detailed)")
        print(f"{path} ({result.get('label') or result.get('base_url', '')})")
        print("\n".join(summarize(result["itls"])))


if __name__ == "__main__":
    main()
