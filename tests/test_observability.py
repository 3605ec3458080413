"""The Grafana dashboard against a real Prometheus (Debian's binary) scraping a real cluster.

One prefill and one decode worker (the tiny model) behind three proxies, one per mode (pull,
push with two proxy processes, colocated); Prometheus scrapes all five every second with the
config deploy.local writes (deploy/observability/prometheus.py). One short `benchmarks.serve`
run through each proxy, and a bad request to a proxy and to D before and after it (the error
panels need errors). Then every panel's every query, with the dashboard's variables set to
everything and its rate window wide enough for the run, is evaluated through Prometheus's HTTP
API: every metric it names must be among the scraped series, and it must return data (a latency
quantile: a number, not NaN). Also: the committed JSON is what the generator makes now, the doc
names every panel and metric, and `deploy.local --prometheus` starts a Prometheus that scrapes
the launcher's processes and stops with them.
"""

from __future__ import annotations

import json
import math
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from deploy.observability import dashboard, prometheus
from tests.servers import ROOT, free_port, wait_until

MODES = ("pull", "push", "colocated")
# the push proxy runs two processes: its /metrics merges them, and the panels must read it alike
PROCESSES = {"pull": [], "push": ["--workers", "2"], "colocated": []}
SCRAPE_S = 1.0
WINDOW = "2m"  # what $__rate_interval stands for here: the whole module's run
NUM_PROMPTS = 8
WORKER_ARGS = ["--num-blocks", "256", "--max-model-len", "256"]
COMMITTED = dashboard.COPIES[0]
NAME = re.compile(r"\b(?:pdserve_[a-z0-9_]+|up)\b")


def binary() -> str:
    found = prometheus.find_binary()
    if found is None:  # CI's set-up (deploy/setup.sh) installs it: its absence is a failure
        pytest.fail(prometheus.INSTALL_HINT)
    return found


class PrometheusAPI:
    """What the tests ask a Prometheus at `url` over its HTTP API."""

    def __init__(self, url: str):
        self.url = url

    def get(self, path: str, **params) -> dict:
        r = httpx.get(f"{self.url}{path}", params=params, timeout=10)
        assert r.status_code == 200, f"{path} {params}: {r.status_code} {r.text}"
        return r.json()["data"]

    def query(self, expr: str) -> list[dict]:
        return self.get("/api/v1/query", query=expr)["result"]

    def value(self, expr: str) -> float | None:
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else None

    def targets_up(self) -> dict[str, str]:
        """scrape URL → health (up, down, unknown)."""
        try:
            active = self.get("/api/v1/targets")["activeTargets"]
        except (httpx.HTTPError, AssertionError):
            return {}
        return {t["scrapeUrl"]: t["health"] for t in active}


class Prometheus(PrometheusAPI):
    """Debian's prometheus on loopback over `targets` (pool → URLs), its data in `folder`."""

    def __init__(self, folder: Path, targets: dict[str, list[str]]):
        port = free_port()
        super().__init__(f"http://127.0.0.1:{port}")
        config = prometheus.write_config(folder, targets, SCRAPE_S)
        cmd = prometheus.command(binary(), config, folder / "data", "127.0.0.1", port)
        self.log_path = folder / "prometheus.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def bench(url: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "benchmarks.serve", "--disable-progress", "--base-url", url]
    cmd += ["--endpoint-type", "completions", "--num-prompts", str(NUM_PROMPTS)]
    cmd += ["--random-input-len", "40", "--random-output-len", "8", "--max-concurrency", "4"]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)


def bad_request(url: str) -> int:
    body = {"prompt": "hello", "max_tokens": -1}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code


def direct_sum(urls: list[str], name: str) -> float:
    """The sum of a metric's samples over processes' /metrics, read directly."""
    total = 0.0
    for url in urls:
        for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
            if line.startswith((name + " ", name + "{")):
                total += float(line.rpartition(" ")[2])
    return total


@pytest.fixture(scope="module")
def scraped(start_server, tiny_model, tmp_path_factory):
    """(Prometheus, its scraped metric names) once the load run is in it."""
    binary()  # before anything starts
    model = ["--model", str(tiny_model("llama")), *WORKER_ARGS]
    # the workers side by side, then the light proxies, and Prometheus while they start
    p = start_server("prefill", *model, wait=False)
    d = start_server("decode", *model, wait=False)
    p, d = p.wait_ready(), d.wait_ready()  # started side by side
    pools = ["--prefill", p.url, "--decode", d.url, "--max-concurrency", "2"]
    proxies = {
        mode: start_server(
            "proxy",
            *pools,
            "--mode",
            mode,
            "--health-interval",
            "0.5",
            *PROCESSES[mode],
            wait=False,
        )
        for mode in MODES
    }
    targets = {"prefill": [p.url], "decode": [d.url], "proxy": [x.url for x in proxies.values()]}
    prom = Prometheus(tmp_path_factory.mktemp("prometheus"), targets)
    try:
        for proxy in proxies.values():
            proxy.wait_ready(path="/ready")
        every = 2 + len(MODES)
        up = lambda: list(prom.targets_up().values()) == ["up"] * every  # noqa: E731
        assert wait_until(up, 30, 0.2), f"{prom.targets_up()}\n{prom.log()}"
        # a 400 before the run and one after: the error series exist, then grow (a rate
        # over a series that is born at 1 and never grows is 0)
        fail = lambda: {bad_request(x.url) for x in (proxies["pull"], d)} == {400}  # noqa: E731
        assert fail()
        time.sleep(2 * SCRAPE_S)
        with ThreadPoolExecutor(len(MODES)) as pool:
            runs = list(pool.map(bench, [x.url for x in proxies.values()]))
        for mode, run in zip(MODES, runs, strict=True):
            assert run.returncode == 0, f"{mode}: {run.stdout[-2000:]}\n{run.stderr[-2000:]}"
        assert fail()
        # Prometheus has scraped the run's end: its totals are the processes' own
        workers, fronts = [p.url, d.url], [x.url for x in proxies.values()]
        for urls, name in (
            (fronts, "pdserve_proxy_requests_total"),
            (workers, "pdserve_requests_total"),
            (workers, "pdserve_kv_loaded_requests_total"),
        ):
            expected = direct_sum(urls, name)
            caught_up = lambda n=name, e=expected: prom.value(f"sum({n})") == e  # noqa: E731
            assert wait_until(caught_up, 15, 0.2), (name, expected, prom.value(f"sum({name})"))
        names = set(prom.get("/api/v1/label/__name__/values"))
        yield prom, names
    finally:
        prom.stop()


def instant(expr: str) -> str:
    return dashboard.everything(expr, WINDOW)


def queries() -> list[tuple[str, dashboard.Query]]:
    return [(p.title, q) for row in dashboard.ROWS for p in row.panels for q in p.queries]


def test_the_committed_dashboard_is_the_generated_one():
    for path in dashboard.COPIES:
        message = f"{path}: regenerate: python -m deploy.observability.dashboard --write-all"
        assert path.read_text() == dashboard.render(), message
    panels = json.loads(COMMITTED.read_text())["panels"]
    exprs = [t["expr"] for panel in panels for t in panel.get("targets", [])]
    assert exprs == [q.expr for _, q in queries()]
    variables = {v["name"] for v in json.loads(COMMITTED.read_text())["templating"]["list"]}
    assert variables == {"datasource", "job", "instance"}
    assert all('job=~"$job"' in expr and 'instance=~"$instance"' in expr for expr in exprs)


def test_the_doc_names_every_panel_and_metric():
    doc = (ROOT / "docs" / "observability.md").read_text()
    for title, q in queries():
        assert title in doc, f"docs/observability.md lacks the panel {title!r}"
        for name in NAME.findall(q.expr):
            family = re.sub(r"_(bucket|total)$", "", name)
            assert family in doc, f"docs/observability.md does not name {name} ({title})"


def test_every_query_names_scraped_metrics_and_returns_data(scraped):
    prom, names = scraped
    missing, empty = [], []
    for title, q in queries():
        unknown = sorted(set(NAME.findall(q.expr)) - names)
        if unknown:
            missing.append((title, q.legend, unknown))
            continue
        samples = [float(s["value"][1]) for s in prom.query(instant(q.expr))]
        if "histogram_quantile" in q.expr or " / " in q.expr:
            samples = [v for v in samples if math.isfinite(v)]  # NaN: nothing was observed
        if not samples:
            empty.append((title, q.legend, instant(q.expr)))
    assert not missing, f"metrics no process exports: {missing}"
    assert not empty, f"queries without data: {empty}"


def by_label(prom: Prometheus, expr: str, label: str) -> dict[str, float]:
    return {s["metric"].get(label, ""): float(s["value"][1]) for s in prom.query(instant(expr))}


def test_each_mode_shows_its_own_path_and_transfer(scraped):
    """The breakdown tells the modes apart: pulls on D, pushes from P, colocated requests."""
    prom, _ = scraped
    ttft = {p.title: p for p in dashboard.TTFT.panels}
    transfer = ttft["3. KV transfer per request"].queries[0].expr  # p50 by op
    p50 = {op: v for op, v in by_label(prom, transfer, "op").items() if math.isfinite(v)}
    assert set(p50) == {"read", "write"} and all(v > 0 for v in p50.values()), p50
    routed = instant(dashboard.ROUTING.panels[0].queries[0].expr)

    def paths() -> set[tuple[str, str]]:
        return {(s["metric"]["path"], s["metric"]["reason"]) for s in prom.query(routed)}

    expected = {("disaggregated", "pull"), ("disaggregated", "push"), ("colocated", "mode")}
    # a rate needs two samples of a series: one first scraped at the run's end (a proxy whose
    # requests all fell between two scrapes) has them one scrape later
    assert wait_until(lambda: expected <= paths(), 10, 0.5), paths()
    # every P/D request's KV was loaded, not computed again on D: the pull run's NUM_PROMPTS
    # each read by D. NOTE: on a loaded machine a push that does not land in time is recomputed
    # on D (fail closed, `push_incomplete`), which the recomputes panel then shows: the push
    # run's requests are each loaded or recomputed for that reason alone, most of them loaded
    loaded = by_label(prom, "sum by (mode) (pdserve_kv_loaded_requests_total)", "mode")
    recomputed = by_label(prom, "sum by (reason) (pdserve_kv_recomputed_total) > 0", "reason")
    counts = (loaded, recomputed, paths())
    assert loaded["pull"] == NUM_PROMPTS, counts
    assert set(recomputed) <= {"push_incomplete"}, counts
    late = recomputed.get("push_incomplete", 0)
    assert loaded["push"] + late == NUM_PROMPTS and loaded["push"] > late, counts


def test_deploy_local_runs_prometheus_over_its_processes(tmp_path, tiny_model):
    from tests.test_deploy_local import Launcher

    binary()
    port = free_port()
    launcher = Launcher(
        tmp_path / "launch", "--prefill", "0", "--decode", "1", "--mode", "colocated",
        "--model", str(tiny_model("llama")), "--prometheus", str(port),
        "--", *WORKER_ARGS, "--dtype", "float32", "--enforce-eager",
    )  # fmt: skip
    try:
        launcher.wait_for(r"^ready: ", timeout=180)
        children = launcher.children()
        assert children["prometheus"][0] == f"http://127.0.0.1:{port}", launcher.output()
        prom = PrometheusAPI(children["prometheus"][0])
        scraped_urls = {f"{children[name][0]}/metrics" for name in ("proxy", "decode-0")}
        up = lambda: prom.targets_up() == dict.fromkeys(scraped_urls, "up")  # noqa: E731
        assert wait_until(up, 30, 0.5), (prom.targets_up(), launcher.output())
        jobs = {s["metric"]["job"] for s in prom.query("up")}
        assert jobs == {"pdserve-proxy", "pdserve-decode"}, jobs
        cmdline = Path(f"/proc/{children['prometheus'][1]}/cmdline").read_bytes().split(b"\0")
        (data,) = [a.split(b"=", 1)[1] for a in cmdline if a.startswith(b"--storage.tsdb.path=")]
        assert Path(data.decode()).is_dir(), cmdline
        launcher.proc.send_signal(signal.SIGTERM)
        assert launcher.wait() == 0, launcher.output()
        assert not launcher.survivors(), launcher.output()  # Prometheus went with the cluster
        folder = Path(data.decode()).parent
        assert not folder.exists(), f"{folder} stayed: {list(folder.rglob('*'))[:20]}"
    finally:
        launcher.kill_all()
