"""`python -m deploy.local` run as a user runs it: a real prefill worker, decode worker and proxy
on the tiny model. A request goes through the proxy; SIGTERM or a Ctrl-C stops everything and no
process the launcher started outlives it; a worker that cannot start ends the launcher with status
1 and its log's tail (again leaving nothing behind); `--ask --exit` answers and exits 0; a taken
port is refused before anything starts. A tensor-parallel decode worker serves colocated with its
ranks on the cores the banner shows; TP > 1 in a P/D mode exits 2 before anything starts."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from common.api.cli import kv_events_curve
from common.cpu import parse_cpu_list
from deploy.processes import TLS, metric
from tests.servers import ROOT, wait_until

WORKER_ARGS = ["--num-blocks", "64", "--max-model-len", "256"]
# a one-process proxy (~3 CPU-s less a launch) where its processes are not what the test is
# about: the SIGTERM and Ctrl-C tests keep the default, one per core, which the stop must reach
ONE_PROXY = "--proxy-args=--workers 1"
ROW = re.compile(
    r"^  (\S+)\s+(http://\S+)\s+pid (\d+)\s+(any core|cores? \S+, \d+ threads?)\s+log (\S+)$",
    re.MULTILINE,
)


def proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, start time) of a process, None when there is none."""
    try:  # bytes: every poll reads every process's (~5 ms of CPU a poll, twice that as text)
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = data[data.rindex(b")") + 2 :].split()  # after "pid (comm) "
    return fields[0].decode(), int(fields[1]), int(fields[19])


def descendants(root: int) -> dict[int, int]:
    """Every live process below `root`: pid → start time (to tell a reused pid apart)."""
    stats = {int(p): proc_stat(int(p)) for p in os.listdir("/proc") if p.isdigit()}
    stats = {pid: s for pid, s in stats.items() if s is not None}
    found: dict[int, int] = {}
    frontier = [root]
    while frontier:
        parent = frontier.pop()
        for pid, (_, ppid, start) in stats.items():
            if ppid == parent and pid not in found:
                found[pid] = start
                frontier.append(pid)
    return found


def is_alive(pid: int, start: int) -> bool:
    s = proc_stat(pid)
    return s is not None and s[2] == start and s[0] != "Z"  # a zombie runs nothing


class Launcher:
    """The launcher as a subprocess in its own process group (as a shell runs a command)."""

    def __init__(self, tmp_path: Path, *args: str):
        tmp_path.mkdir()
        self.out_path, self.err_path = tmp_path / "stdout", tmp_path / "stderr"
        cmd = [sys.executable, "-m", "deploy.local", "--port", "0"]
        cmd += ["--log-dir", str(tmp_path / "logs"), *args]
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(
                cmd, cwd=ROOT, stdout=out, stderr=err, start_new_session=True
            )
        self.seen: dict[int, int] = {}  # every process seen below the launcher

    def output(self) -> str:
        return self.out_path.read_text() + "\n--- stderr:\n" + self.err_path.read_text()

    def wait_for(self, pattern: str, timeout: float = 180.0) -> re.Match:
        def found() -> re.Match | None:
            self.seen.update(descendants(self.proc.pid))
            return re.search(pattern, self.out_path.read_text(), re.MULTILINE)

        assert wait_until(lambda: found() or self.proc.poll() is not None, timeout, 0.5)
        match = found()
        assert match, f"no {pattern!r} in the launcher's output:\n{self.output()}"
        return match

    def children(self) -> dict[str, tuple[str, int]]:
        """name → (url, pid), from the banner."""
        rows = ROW.findall(self.out_path.read_text())
        return {name: (url, int(pid)) for name, url, pid, _, _ in rows}

    def cpu_columns(self) -> dict[str, str]:
        """name → the banner's cores and threads."""
        return {name: cpu for name, _, _, cpu, _ in ROW.findall(self.out_path.read_text())}

    def wait(self, timeout: float = 120.0) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the launcher did not exit in {timeout} s:\n{self.output()}")

    def survivors(self) -> list[int]:
        return [pid for pid, start in self.seen.items() if is_alive(pid, start)]

    def kill_all(self) -> None:
        """After a failed test: leave nothing running."""
        if self.proc.poll() is None:
            self.seen.update(descendants(self.proc.pid))
            self.proc.kill()
            self.proc.wait()
        for pid in self.survivors():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def launch(tmp_path):
    started: list[Launcher] = []

    def start(*args: str) -> Launcher:
        started.append(Launcher(tmp_path / f"run{len(started)}", *args))
        return started[-1]

    yield start
    for launcher in started:
        launcher.kill_all()


def assert_banner(launcher: Launcher) -> None:
    children = launcher.children()
    assert set(children) == {"proxy", "prefill-0", "decode-0"}, launcher.output()
    pids = {pid for _, pid in children.values()}
    assert pids <= set(launcher.seen), "the banner's pids are the launcher's children"
    if len(os.sched_getaffinity(0)) < 2:
        return  # one core: prefill and decode share it
    cpus = launcher.cpu_columns()
    assert cpus["proxy"] == "any core", cpus
    allowed = {name: cpus_allowed(pid) for name, (_, pid) in children.items()}
    for name in ("prefill-0", "decode-0"):
        assert cpus[name].split()[1].rstrip(",") == allowed[name], (cpus, allowed)
    assert not parse_cpu_list(allowed["prefill-0"]) & parse_cpu_list(allowed["decode-0"])


def cpus_allowed(pid: int) -> str:
    """The process's affinity as /proc prints it, e.g. '0' or '0-3'."""
    status = Path(f"/proc/{pid}/status").read_text()
    return re.search(r"^Cpus_allowed_list:\s*(\S+)$", status, re.MULTILINE).group(1)


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl-c"])
def test_serves_through_the_proxy_and_stops_everything(launch, tiny_model, stop):
    # the workers' default (compiled) under SIGTERM; eager under Ctrl-C, whose path is the same
    eager = ["--enforce-eager"] if stop == signal.SIGINT else []
    launcher = launch("--model", str(tiny_model("llama")), "--", *WORKER_ARGS, *eager)
    url = launcher.wait_for(r"^ready: (http://\S+)").group(1)
    assert_banner(launcher)
    assert url == launcher.children()["proxy"][0]
    body = {"prompt": "Hello, my name is", "max_tokens": 8, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"]
    assert r.json()["usage"]["completion_tokens"] == 8
    # KV events are on by default: the proxy indexes every worker's blocks
    assert wait_until(lambda: metric_lines(url, "pdserve_proxy_kv_index_blocks{") == 2, 30)

    launcher.seen.update(descendants(launcher.proc.pid))
    if stop == signal.SIGINT:
        os.killpg(launcher.proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    else:
        launcher.proc.send_signal(signal.SIGTERM)
    assert launcher.wait() == 0, launcher.output()
    assert launcher.survivors() == [], launcher.output()
    assert f"{signal.Signals(stop).name}: stopping the cluster" in launcher.output()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health", timeout=5)


@pytest.mark.parametrize(
    "bad, why, tail",
    [  # the model-less worker stays up answering 503; the other exits at once
        (["--model", "EMPTY"], "failed to load", "ModelLoadError"),
        (["--", "--no-such-flag"], "exited with status 2", "unrecognized arguments"),
    ],
    ids=["model-fails-to-load", "worker-exits"],
)
def test_a_worker_that_cannot_start_ends_the_launcher(launch, tiny_model, tmp_path, bad, why, tail):
    empty = tmp_path / "empty"
    empty.mkdir()
    args = [str(empty) if a == "EMPTY" else a for a in bad]
    if "--model" not in args:
        args = ["--model", str(tiny_model("llama")), *args]
    # one worker (it fails as each of a P/D pair does, at ~6 CPU-s a start) and a one-process
    # proxy: the launcher still has to notice the failure and stop the proxy (and, when the
    # model fails, the worker, which stays up)
    launcher = launch("--prefill", "0", "--mode", "colocated", ONE_PROXY, *args)
    launcher.wait_for(r"^  decode-0 ")
    assert launcher.wait() == 1, launcher.output()
    err = launcher.err_path.read_text()
    assert re.search(rf"error: (prefill|decode)-0 .*{why}", err), err
    assert re.search(rf"the last lines of \S+/logs/(prefill|decode)-0.log:\n(.*\n)*.*{tail}", err)
    assert launcher.survivors() == [], launcher.output()


def test_ask_answers_and_exit_stops_everything(launch, tiny_model):
    args = ["--model", str(tiny_model("llama")), "--ask", "Hello there", "--exit", ONE_PROXY]
    launcher = launch(*args, "--", *WORKER_ARGS, "--enforce-eager")
    launcher.wait_for(r"^ready: ")
    assert launcher.wait() == 0, launcher.output()
    out = launcher.out_path.read_text()
    assert re.search(r"^Q: Hello there\nA: ", out, re.MULTILINE), out  # a 200 (else status 1)
    assert "curl -s http://127.0.0.1:8000/v1/chat/completions" in out
    assert "-m deploy.local" in out
    assert launcher.survivors() == [], launcher.output()


def test_a_taken_port_is_refused_before_anything_starts(launch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        launcher = launch("--port", str(port))
        assert launcher.wait() == 1
    assert f"port {port} is taken" in launcher.err_path.read_text()
    assert "--port 0" in launcher.err_path.read_text()
    assert launcher.children() == {}


def test_a_tp_decode_worker_serves_colocated_on_its_cores(launch, tiny_model):
    args = ["--model", str(tiny_model("llama")), "--prefill", "0", "--decode-tp", "2"]
    launcher = launch(
        *args, "--mode", "colocated", ONE_PROXY, "--", *WORKER_ARGS, "--enforce-eager"
    )
    url = launcher.wait_for(r"^ready: (http://\S+)").group(1)
    assert "0 prefill + 1 decode (TP 2 each), mode colocated" in launcher.output()
    children = launcher.children()
    assert set(children) == {"proxy", "decode-0"}, launcher.output()
    body = {"prompt": "Hello, my name is", "max_tokens": 4, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    decode_pid = children["decode-0"][1]
    ranks = [p for p in descendants(decode_pid) if "common.engine.rank_main" in cmdline(p)]
    assert len(ranks) == 1, "rank 1 runs beside the worker, which is rank 0"
    cores = sorted(os.sched_getaffinity(0))
    cpu = launcher.cpu_columns()["decode-0"]
    assert cpu.split()[1].rstrip(",") == cpus_allowed(decode_pid)  # the banner is the truth
    assert len(parse_cpu_list(cpus_allowed(decode_pid))) == len(cores), "alone: every core"
    launcher.seen.update(descendants(launcher.proc.pid))
    launcher.proc.send_signal(signal.SIGTERM)
    assert launcher.wait() == 0, launcher.output()
    assert launcher.survivors() == [], launcher.output()


def test_a_tp2_prefill_worker_hands_its_kv_to_a_tp1_decode_worker(launch, tiny_model):
    """P at TP 2, D at TP 1 on CPU (KV moves between TP sizes): the proxy's answer was decoded
    from P's KV, and P's rank 1 runs beside it. The next turn's prompt holds the answer, which
    P reads from D (the reverse pull, from TP 1 to TP 2) and the answer is D's alone."""
    args = ["--model", str(tiny_model("llama")), "--prefill-tp", "2", ONE_PROXY]
    launcher = launch(*args, "--", *WORKER_ARGS, "--enforce-eager", "--dtype", "float32")
    url = launcher.wait_for(r"^ready: (http://\S+)").group(1)
    assert "1 prefill (TP 2 each) + 1 decode, mode pull" in launcher.output()
    first = list(range(7, 67))
    body = {"prompt": first, "max_tokens": 60, "ignore_eos": True, "temperature": 0}
    body["return_token_ids"] = True
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    rows = {m.group(1): m.group(2) for m in ROW.finditer(launcher.output())}
    metrics = httpx.get(f"{rows['decode-0']}/metrics", timeout=10).text
    assert 'pdserve_kv_loaded_requests_total{mode="pull"} 1.0' in metrics, metrics[-2000:]
    # turn 2: D holds 7 blocks of turn 1 (prompt and answer), P the prompt's 3; 80 new tokens
    # (more than --cached-on-decode-tokens: through P)
    history = first + r.json()["choices"][0]["token_ids"]
    index = f'pdserve_proxy_kv_index_blocks{{role="decode",url="{rows["decode-0"]}"}}'
    assert wait_until(lambda: metric(url, index, 0) >= 7, 30)
    body = {**body, "prompt": history + list(range(300, 380)), "max_tokens": 8}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    reverse = 'pdserve_kv_loaded_requests_total{mode="reverse"}'
    assert wait_until(lambda: metric(rows["prefill-0"], reverse, 0) == 1, 10)
    alone = httpx.post(f"{rows['decode-0']}/v1/completions", json=body, timeout=60)
    assert r.json()["choices"][0]["token_ids"] == alone.json()["choices"][0]["token_ids"]
    prefill_pid = launcher.children()["prefill-0"][1]
    ranks = [p for p in descendants(prefill_pid) if "common.engine.rank_main" in cmdline(p)]
    assert len(ranks) == 1, "P's rank 1 runs beside it"
    launcher.seen.update(descendants(launcher.proc.pid))
    launcher.proc.send_signal(signal.SIGTERM)
    assert launcher.wait() == 0, launcher.output()
    assert launcher.survivors() == [], launcher.output()


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except (FileNotFoundError, ProcessLookupError):
        return ""


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--decode-tp", "2", "--", "--device", "cuda"],
            "--decode-tp 2 with --mode pull on GPUs: P/D KV transfer between CUDA workers needs",
        ),
        (
            ["--prefill-tp", "2", "--mode", "push", "--", "--device=cuda:0"],
            "--prefill-tp 2 with --mode push on GPUs: P/D KV ",
        ),
        (["--", "-tp", "2"], "the launcher sets the workers' --port, --internal-token and "),
    ],
    ids=["decode-tp-pull-gpu", "prefill-tp-push-gpu", "tp-after-dashes"],
)
def test_gpu_tp_outside_colocated_mode_exits_2_before_anything_starts(launch, args, message):
    launcher = launch(*args)
    assert launcher.wait() == 2, launcher.output()
    err = launcher.err_path.read_text()
    assert message in err, err
    assert "--mode colocated" in err or "--decode-tp N" in err, err
    assert launcher.children() == {} and launcher.out_path.read_text() == ""


def test_a_tp_worker_gets_a_command_its_parser_accepts():
    """The plan-level view: --decode-tp 2 reaches the worker as --tensor-parallel-size 2 with
    its cores, and the worker's own parser takes the whole command (nixl on CPU at TP 2 too)."""
    from common.api.cli import parse_args as parse_worker_args
    from deploy.cluster import banner, worker_command
    from deploy.local import parse_args

    cfg = parse_args(["--prefill", "0", "--decode-tp", "2", "--mode", "colocated"])
    assert (cfg.prefill_tp, cfg.decode_tp, cfg.num_prefill) == (1, 2, 0)
    cpu = cfg.cpu_plan.workers["decode-0"]
    cmd = worker_command(cfg, "decode", 8200, cpu)
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "2"
    engine, server = parse_worker_args("decode", cmd[3:])
    assert engine.parallel.tensor_parallel_size == 2 and engine.transfer.connector == "nixl"
    assert engine.parallel.pin_ranks and server.cpu.num_threads == len(cpu.cores)
    assert banner(cfg, []).startswith("pdserve local cluster: 0 prefill + 1 decode (TP 2 each)")
    assert "--tensor-parallel-size" not in worker_command(parse_args([]), "decode", 8200, cpu)


@pytest.mark.parametrize(
    "arg",
    [
        ("--internal-token-file", "/run/token"),
        ("--internal-token-file=/run/token",),
        ("--internal-token-f", "/run/token"),  # the worker's parser expands abbreviations
        ("--po", "9000"),
        ("--tensor-p=2",),
    ],
    ids=["token-file", "token-file=", "token-file-abbrev", "port-abbrev", "tp-abbrev="],
)
def test_worker_args_cannot_override_what_the_launcher_sets(arg):
    """A worker's own --internal-token-file would win over the launcher's token in its
    environment, which the proxy holds: P/D transfers would fail with 401."""
    from deploy.cluster import LocalConfig

    with pytest.raises(ValueError, match="the launcher sets the workers' --port"):
        LocalConfig(worker_args=("--max-model-len", "256", *arg))
    LocalConfig(worker_args=("--max-model-len", "256", "--num-blocks=64"))


STUBBORN = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(grandchild.pid, flush=True)
time.sleep(600)
"""


def test_stop_kills_a_child_that_ignores_sigterm_and_what_it_started(tmp_path):
    from common.processes import Supervisor

    sup = Supervisor(dict(os.environ), stop_grace_s=1.0)
    log = tmp_path / "stubborn.log"
    child = sup.start("stubborn", [sys.executable, "-c", STUBBORN], log_path=log)
    assert wait_until(lambda: log.read_text().strip().isdigit(), timeout=60)
    pids = [child.pid, int(log.read_text())]
    seen = {pid: proc_stat(pid)[2] for pid in pids}
    handler = signal.getsignal(signal.SIGINT)
    sup.stop()
    assert child.exit_code == -signal.SIGKILL
    assert wait_until(lambda: not any(is_alive(p, s) for p, s in seen.items()), timeout=10)
    assert signal.getsignal(signal.SIGINT) is handler, "stop() restores the signal handlers"
    sup.stop()  # idempotent


def metric_lines(url: str, prefix: str) -> int:
    text = httpx.get(f"{url}/metrics", verify=TLS).text
    return sum(line.startswith(prefix) for line in text.splitlines())


def test_workers_get_kv_events_on_loopback_with_curve_keys():
    from deploy.cluster import LocalConfig, kv_events_keys, worker_command

    cmd = worker_command(LocalConfig(), "decode", 8200, None, (5001, 5002))
    assert cmd[cmd.index("--kv-events-endpoint") + 1] == "tcp://*:5001"
    assert "--host" not in cmd  # the worker's default: 127.0.0.1, where the wildcard binds
    own = LocalConfig(worker_args=("--kv-events-endpoint=tcp://*:9",))
    assert "--kv-events-replay-endpoint" not in worker_command(own, "decode", 8200, None, (1, 2))
    assert kv_events_curve(kv_events_keys()) is not None
