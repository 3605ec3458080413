"""Run a whole cluster on this machine: prefill and decode workers, and the proxy in front.

    python -m deploy.local                           # 1 P + 1 D, the built-in SmolLM2, proxy :8000
    python -m deploy.local --prefill 2 --decode 2 --model DIR -- --device cuda --num-blocks 4096
    python -m deploy.local --ask "What is the capital of France?" --exit
    python -m deploy.local --prefill 0 --decode 1 --decode-tp 2 --mode colocated

Workers listen on free ports (8100, 8101, ... and 8200, ... when those are free) on 127.0.0.1,
share one random internal token (in their environment, not on the command line) and log to a file
each. Each worker publishes its KV events on loopback (two free ports), encrypted with fresh
CURVE keys that only the proxy's key may subscribe with; the proxy routes by them.
The launcher prints a banner (every URL, pid and log), waits for the proxy's /ready and then
stays in the foreground: Ctrl-C or SIGTERM stops every child and exits 0 (common/processes.py). A
child that exits on its own stops the rest and ends the launcher with status 1 and the tail of
that child's log. Arguments after `--` go to every worker; `--proxy-args` to the proxy.

Workers do not share cores: the launcher splits its cores among them (deploy/cores.py) and the
banner shows each worker's cores and torch threads; `--no-cpu-split` lets every worker take
every core (and lets `--cpu-cores`/`--cpu-threads` after `--` apply to all of them).

`--prefill-tp N`/`--decode-tp N` start those workers with `--tensor-parallel-size N`: N ranks,
which get N workers' share of the cores (the banner warns when ranks must share cores). TP > 1
has no P/D KV transfer yet, so it needs `--mode colocated`; other modes exit 2 (deploy/tp.py).

`--prometheus PORT` also starts Debian's `prometheus` on 127.0.0.1:PORT, scraping the proxy and
every worker (deploy/observability/prometheus.py), its data in a temporary folder that goes with
the cluster; load deploy/observability/grafana/pdserve.json into a Grafana pointed at it
(docs/observability.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from common import processes
from common.processes import STOP_SIGNALS, Child, Supervisor
from deploy.cluster import (
    DEFAULT_MODEL,
    Cluster,
    LocalConfig,
    banner,
    cluster_env,
    is_port_free,
    pick_port,
    start_cluster,
)
from deploy.compose import MODES, PROXY_PORT
from deploy.observability import prometheus
from deploy.tp import add_tp_args

EXAMPLE_QUESTION = "Why is the sky blue?"
ASK_MAX_TOKENS = 128
SCRAPE_INTERVAL_S = 5.0  # --prometheus


class Stopped(Exception):
    """The launcher got SIGINT, SIGTERM or SIGHUP."""


class ChildFailed(Exception):
    """A child exited, or a worker reports that its model failed to load."""

    def __init__(self, child: Child, why: str):
        super().__init__(f"{child.name} {why}")
        self.child = child


def _raise_stopped(signum: int, frame: object) -> None:
    raise Stopped(signal.Signals(signum).name)


class Progress:
    """Shows the wait on stderr: a spinner with elapsed seconds on a terminal, else dots."""

    SPINNER = "|/-\\"

    def __init__(self, what: str):
        self.what = what
        self.is_tty = sys.stderr.isatty()
        self.start = time.monotonic()
        self.num_ticks = self.num_dots = 0
        self._write(f"waiting for {what} ")

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.start

    def tick(self) -> None:
        self.num_ticks += 1
        if self.is_tty:
            spin = self.SPINNER[self.num_ticks % len(self.SPINNER)]
            self._write(f"\rwaiting for {self.what} {spin} {self.elapsed_s:.0f} s")
        else:  # one dot per second waited
            self._write("." * (int(self.elapsed_s) - self.num_dots))
            self.num_dots = int(self.elapsed_s)

    def finish(self, outcome: str) -> None:
        prefix = f"\rwaiting for {self.what}: " if self.is_tty else " "
        self._write(f"{prefix}{outcome} after {self.elapsed_s:.1f} s\n")

    def _write(self, text: str) -> None:
        sys.stderr.write(text)
        sys.stderr.flush()


def load_failure(child: Child) -> str | None:
    """A worker's own report that its model failed to load (it stays up, answering 503)."""
    try:  # one TLS context for every poll (processes.tls_context): ~20 ms of CPU a call else
        r = httpx.get(f"{child.url}/health", timeout=2, verify=processes.tls_context())
        message = r.json()["error"]["message"] if r.status_code == 503 else ""
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None
    return message if "failed to load" in message else None


def check_children(sup: Supervisor) -> None:
    if (child := sup.first_exited()) is not None:
        raise ChildFailed(child, f"exited with status {child.exit_code}")
    for child in sup.children:
        if (why := load_failure(child)) is not None:
            raise ChildFailed(child, f"is up, but {why}")


def wait_ready(sup: Supervisor, proxy: Child, timeout_s: float) -> None:
    progress = Progress(f"{proxy.url}/ready")

    def check() -> None:
        check_children(sup)
        progress.tick()

    try:
        processes.wait_ready(f"{proxy.url}/ready", timeout_s, check, interval_s=0.5)
    except TimeoutError:
        progress.finish("failed")
        raise TimeoutError(f"not ready in {timeout_s:.0f} s (--ready-timeout)") from None
    except ChildFailed:
        progress.finish("failed")
        raise
    progress.finish("ready")


def ask(url: str, question: str) -> str:
    """One chat request through the proxy (greedy); returns the answer."""
    body = {
        "messages": [{"role": "user", "content": question}],
        "max_tokens": ASK_MAX_TOKENS,
        "temperature": 0,
    }
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    if r.status_code != 200:
        raise RuntimeError(f"the proxy answered {r.status_code}: {r.text}")
    return r.json()["choices"][0]["message"]["content"]


def curl_line(url: str, question: str = EXAMPLE_QUESTION) -> str:
    # NOTE: max_tokens bounds the wait: the proxy gives a non-streamed answer --decode-timeout
    # (60 s) in all, and SmolLM2 on a busy CPU can ramble for longer than that
    message = {"role": "user", "content": question}
    body = json.dumps({"messages": [message], "max_tokens": ASK_MAX_TOKENS})
    return (
        f"  curl -s {url}/v1/chat/completions -H 'content-type: application/json' \\\n"
        f"    -d '{body}'"
    )


def launcher_command() -> str:
    """How to start the launcher again, as the user would type it here."""
    python = Path(sys.executable)
    if python.is_relative_to(Path.cwd()):
        python = python.relative_to(Path.cwd())
    return f"{python} -m deploy.local"


def serve(cfg: LocalConfig, sup: Supervisor, proxy: Child) -> None:
    """Wait for /ready, answer --ask, then stay until a signal (Stopped) or a child exits."""
    if cfg.is_waiting:
        wait_ready(sup, proxy, cfg.ready_timeout_s)
        print(f"ready: {proxy.url} (OpenAI API under /v1)")
    if cfg.question is not None:
        print(f"\nQ: {cfg.question}\nA: {ask(proxy.url, cfg.question)}\n")
    if cfg.is_exit_after_ask:
        later = curl_line(f"http://127.0.0.1:{PROXY_PORT}")  # the default port of the command
        print(f"Stopping (--exit). To keep a cluster running: {launcher_command()}")
        print(f"and ask it more from another terminal:\n{later}")
        return
    print(f"Ask more:\n{curl_line(proxy.url)}\nCtrl-C stops the cluster.")
    while (child := sup.first_exited()) is None:
        time.sleep(0.5)
    raise ChildFailed(child, f"exited with status {child.exit_code}")


def start_prometheus(cfg: LocalConfig, sup: Supervisor, cluster: Cluster, log_dir: Path) -> Path:
    """--prometheus: Prometheus scraping the proxy and every worker (deploy/observability/);
    its config and data in a new temporary folder, which it returns (removed after the stop)."""
    folder = Path(tempfile.mkdtemp(prefix="pdserve-prometheus-"))
    targets = {"proxy": [cluster.proxy.url], **{r: cluster.urls(r) for r in cluster.workers}}
    config = prometheus.write_config(folder, targets, SCRAPE_INTERVAL_S)
    taken = {urlsplit(c.url).port for c in cluster.children}
    port = cfg.prometheus_port or pick_port("127.0.0.1", None, taken)
    cmd = prometheus.command(prometheus.find_binary(), config, folder / "data", "127.0.0.1", port)
    url = f"http://127.0.0.1:{port}"
    sup.start("prometheus", cmd, url=url, log_path=log_dir / "prometheus.log", env=dict(os.environ))
    return folder


def refusal(cfg: LocalConfig) -> str | None:
    """Why the cluster cannot start here, before anything starts."""
    if cfg.port and not is_port_free(cfg.host, cfg.port):
        return (
            f"port {cfg.port} is taken (another pdserve?). Stop what uses it, or choose "
            "another with --port N (--port 0 picks a free one)."
        )
    if cfg.prometheus_port is not None:
        if prometheus.find_binary() is None:
            return f"--prometheus: {prometheus.INSTALL_HINT}"
        if cfg.prometheus_port and not is_port_free("127.0.0.1", cfg.prometheus_port):
            return f"--prometheus {cfg.prometheus_port}: the port is taken (0 picks a free one)"
    return None


def run(cfg: LocalConfig) -> int:
    if (why := refusal(cfg)) is not None:
        print(f"error: {why}", file=sys.stderr)
        return 1
    proxy_port = cfg.port or pick_port(cfg.host, None, set())
    log_dir = Path(cfg.log_dir or tempfile.mkdtemp(prefix="pdserve-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    for sig in STOP_SIGNALS:
        signal.signal(sig, _raise_stopped)
    sup = Supervisor(cluster_env())
    prometheus_dir = None
    try:
        cluster = start_cluster(cfg, sup, proxy_port, log_dir)
        children = cluster.children
        if cfg.prometheus_port is not None:
            prometheus_dir = start_prometheus(cfg, sup, cluster, log_dir)
            children = sup.children
        print(banner(cfg, children))
        serve(cfg, sup, cluster.proxy)
        return 0
    except Stopped as e:
        print(f"\n{e}: stopping the cluster", file=sys.stderr)
        return 0
    except ChildFailed as e:
        print(f"error: {e}; the last lines of {e.child.log_path}:", file=sys.stderr)
        print(e.child.log_tail(), file=sys.stderr)
        return 1
    except (TimeoutError, RuntimeError, httpx.HTTPError) as e:
        print(f"error: {e} (logs in {log_dir})", file=sys.stderr)
        return 1
    finally:
        sup.stop()
        if prometheus_dir is not None:
            shutil.rmtree(prometheus_dir, ignore_errors=True)


def parse_args(argv: list[str] | None = None) -> LocalConfig:
    argv = sys.argv[1:] if argv is None else list(argv)
    worker_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, worker_args = argv[:i], argv[i + 1 :]
    p = argparse.ArgumentParser(
        prog="python -m deploy.local",
        usage="%(prog)s [options] [-- WORKER_ARG ...]",
        description=__doc__.split("\n")[0],
        epilog="Arguments after -- go to every worker, e.g. -- --device cuda --num-blocks 4096.",
    )
    add = p.add_argument
    add("--prefill", type=int, default=1, help="prefill workers (default 1)")
    add("--decode", type=int, default=1, help="decode workers (default 1)")
    add_tp_args(add)
    add("--model", default=None, help=f"HF-format model folder (default: {DEFAULT_MODEL})")
    add("--host", default="127.0.0.1", help="the proxy's bind address (default 127.0.0.1)")
    add("--port", type=int, default=PROXY_PORT, help="the proxy's port (8000; 0: any free one)")
    add("--mode", default="pull", choices=MODES, help="the proxy's mode (default pull)")
    add("--log-dir", default=None, help="folder of the logs (default: a new /tmp/pdserve-*)")
    add("--no-wait", action="store_true", help="do not wait for /ready")
    add("--ready-timeout", type=float, default=600.0, help="seconds to wait for /ready (600)")
    add("--ask", default=None, metavar="QUESTION", help="once ready, ask this and print the answer")
    add("--exit", action="store_true", help="with --ask: stop everything after the answer")
    add(
        "--no-cpu-split",
        action="store_true",
        help="do not give each worker its own cores (default: split this machine's cores, "
        "prefill and decode never on the same core)",
    )
    add(
        "--proxy-args", default="", help="extra proxy flags as one string, e.g. '--log-level debug'"
    )
    add(
        "--prometheus",
        type=int,
        default=None,
        metavar="PORT",
        help="also run Prometheus on 127.0.0.1:PORT (0: any free port), scraping the proxy and "
        "every worker every 5 s (docs/observability.md)",
    )
    a = p.parse_args(argv)
    try:
        return LocalConfig(
            num_prefill=a.prefill,
            num_decode=a.decode,
            prefill_tp=a.prefill_tp,
            decode_tp=a.decode_tp,
            model=a.model,
            host=a.host,
            port=a.port,
            mode=a.mode,
            log_dir=a.log_dir,
            is_waiting=not a.no_wait,
            question=a.ask,
            is_exit_after_ask=a.exit,
            ready_timeout_s=a.ready_timeout,
            worker_args=tuple(worker_args),
            proxy_args=tuple(shlex.split(a.proxy_args)),
            is_cpu_split=not a.no_cpu_split,
            prometheus_port=a.prometheus,
        )
    except ValueError as e:
        p.error(str(e))  # exit 2


def main(argv: list[str] | None = None) -> int:
    sys.stdout.reconfigure(line_buffering=True)  # the banner reaches a pipe at once
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
