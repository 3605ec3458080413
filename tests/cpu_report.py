"""Where the suite's time goes, module by module: `pytest -p tests.cpu_report` appends one line
per test module to `$PDSERVE_CPU_REPORT` (default `.cpu_report.tsv`): its wall seconds, the CPU
seconds of the test process, and those of the processes it started and reaped (workers, proxies
and what they started in turn). Wall time on a shared machine depends on what else ran; CPU
seconds do not, and they are what 2 cores have to share.

`python -m tests.cpu_report [FILE]` sums the lines by module, the costliest first."""

from __future__ import annotations

import os
import resource
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

from tests.forkserver import reaped_cpu_seconds

REPORT = Path(os.environ.get("PDSERVE_CPU_REPORT", ".cpu_report.tsv"))


def _cpu() -> tuple[float, float]:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    forked = reaped_cpu_seconds()  # the fork server's children: ours in all but parentage
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime + forked


@pytest.fixture(scope="module", autouse=True)
def _module_cost(request):
    """Set up before the module's other fixtures, torn down after them: its processes'
    stops are counted."""
    wall, (own, children) = time.monotonic(), _cpu()
    yield
    own_now, children_now = _cpu()
    line = "\t".join(
        (
            request.node.nodeid,
            f"{time.monotonic() - wall:.1f}",
            f"{own_now - own:.1f}",
            f"{children_now - children:.1f}",
        )
    )
    with REPORT.open("a") as out:
        out.write(line + "\n")


def main(path: str = str(REPORT)) -> None:
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    for line in Path(path).read_text().splitlines():
        module, *figures = line.split("\t")
        for i, figure in enumerate(figures):
            totals[module][i] += float(figure)
    rows = sorted(totals.items(), key=lambda item: -(item[1][1] + item[1][2]))
    print(f"{'module':55} {'wall s':>8} {'own cpu':>8} {'children':>8} {'cpu':>8}")
    for module, (wall, own, children) in rows:
        print(f"{module:55} {wall:8.1f} {own:8.1f} {children:8.1f} {own + children:8.1f}")
    sums = [sum(row[1][i] for row in rows) for i in range(3)]
    print(f"{'total':55} {sums[0]:8.1f} {sums[1]:8.1f} {sums[2]:8.1f} {sums[1] + sums[2]:8.1f}")


if __name__ == "__main__":
    main(*sys.argv[1:])
