#!/usr/bin/env bash
# The local cluster (1 P + 1 D + proxy) against one colocated decode worker alone, on this
# machine's cores, with and without the launcher's CPU split (docs/benchmarks.md, "CPU budget
# per worker"). Four systems stay up the whole time (idle ones sleep):
#
#   split     python -m deploy.local                  (each worker its own cores: the default)
#   dfirst    the same, with the proxy's --no-first-token-from-prefill (P's token comes with D's
#             stream: the hand-off counts in TTFT, not in the first inter-token gap)
#   nosplit   python -m deploy.local --no-cpu-split   (every worker on every core: the old default)
#   alone     python -m decode_server                 (one worker, every core)
#
# and the runs interleave, split, alone, dfirst, nosplit, alone, for ROUNDS rounds, so a noisy
# moment on a shared box hits every system; each run has its own seed (no prefix-cache hits)
# and records the load average before it. The workload is 16 chats at concurrency 4 (closed
# loop: requests start and end in lockstep); RATE=2.5 sends 40 as Poisson arrivals at that
# rate instead. Usage: benchmarks/studies/cpu_budget.sh [OUT_DIR] (default /tmp/cpu_budget)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
OUT=${1:-/tmp/cpu_budget}
ROUNDS=${ROUNDS:-2}
RATE=${RATE:-}
if [ -n "$RATE" ]; then
    NUM_PROMPTS=${NUM_PROMPTS:-40}
    LOAD=(--request-rate "$RATE" --max-concurrency 16)
else
    NUM_PROMPTS=${NUM_PROMPTS:-16}
    LOAD=(--max-concurrency 4)
fi
mkdir -p "$OUT"
declare -A URL=([split]=http://127.0.0.1:8300 [nosplit]=http://127.0.0.1:8400
                [alone]=http://127.0.0.1:8500 [dfirst]=http://127.0.0.1:8600)

pids=()
stop() { for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done; wait; }
trap stop EXIT
wait_up() {  # name path: a cluster's proxy /ready (P and D healthy), a worker's /health
    for _ in $(seq 900); do curl -sf "${URL[$1]}$2" > /dev/null && return; sleep 1; done
    echo "$1 is not up: see $OUT"; exit 1
}
# NOTE: one at a time: two launchers starting together can pick the same free worker port
$PY -m deploy.local --port 8300 --log-dir "$OUT/split-logs" > "$OUT/split.out" 2>&1 &
pids+=($!)
wait_up split /ready
$PY -m deploy.local --port 8600 --proxy-args=--no-first-token-from-prefill \
    --log-dir "$OUT/dfirst-logs" > "$OUT/dfirst.out" 2>&1 &
pids+=($!)
wait_up dfirst /ready
$PY -m deploy.local --port 8400 --no-cpu-split --log-dir "$OUT/nosplit-logs" \
    > "$OUT/nosplit.out" 2>&1 &
pids+=($!)
wait_up nosplit /ready
$PY -m decode_server --port 8500 > "$OUT/alone.log" 2>&1 &
pids+=($!)
wait_up alone /health
grep -h -A4 "^pdserve local cluster" "$OUT/split.out" "$OUT/dfirst.out" "$OUT/nosplit.out"

bench() {  # name seed result-file
    $PY -m benchmarks.serve --base-url "${URL[$1]}" --endpoint-type chat --seed "$2" \
        --num-prompts "$NUM_PROMPTS" --random-input-len 150 --random-output-len 32 \
        "${LOAD[@]}" --goodput ttft:3000 tpot:200 --disable-progress --save-detailed \
        --result-file "$3" > /dev/null
}
for name in split dfirst nosplit alone; do bench "$name" 1 "$OUT/warmup-$name.json"; done
for round in $(seq 1 "$ROUNDS"); do
    for slot in 1 2 3 4 5; do
        name=$(case $slot in 1) echo split;; 3) echo dfirst;; 4) echo nosplit;; *) echo alone;; esac)
        seed=$((round * 10 + slot))
        load=$(cut -d' ' -f1 /proc/loadavg)
        bench "$name" "$seed" "$OUT/r$round-$slot-$name.json"
        echo "$round $slot $name $load" >> "$OUT/runs.txt"
        echo "round $round: $name done (load before: $load)"
    done
done

$PY - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
import numpy as np
out = Path(sys.argv[1])
keys = [("request_throughput", "req/s"), ("request_goodput", "goodput"),
        ("median_ttft_ms", "TTFT p50"), ("p99_ttft_ms", "TTFT p99"),
        ("median_tpot_ms", "TPOT p50"), ("p99_itl_ms", "ITL p99")]
print("| round | system | load | " + " | ".join(h for _, h in keys)
      + " | ITL p99 without gap 1 | req/s ÷ alone |")
print("|---" * (len(keys) + 5) + "|")
rows = [line.split() for line in (out / "runs.txt").read_text().splitlines()]
for rnd, slot, name, load in rows:
    r = json.loads((out / f"r{rnd}-{slot}-{name}.json").read_text())
    alone = [json.loads((out / f"r{rnd}-{s}-alone.json").read_text()) for s in ("2", "5")]
    ratio = "" if name == "alone" else "%.2f" % (
        r["request_throughput"] / (sum(a["request_throughput"] for a in alone) / 2))
    cells = ["%.2f" % r[k] if k in ("request_throughput", "request_goodput") else "%.0f" % r[k]
             for k, _ in keys]
    rest = [g * 1e3 for seq in r.get("itls") or [] for g in seq[1:]]  # gap 1: the hand-off
    cells.append("%.0f" % np.percentile(rest, 99) if rest else "")
    print(f"| {rnd} | {name} | {load} | " + " | ".join(cells) + f" | {ratio} |")
EOF
