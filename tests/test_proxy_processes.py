"""`--workers N`: N proxy processes on one port (proxy/processes.py), in front of stub decode
workers (tests/stub_worker.py): connections spread over the processes, `/metrics` answered by any
of them counts every process, `/ready` is 200 only when every process is, an admin change
reaches every process (a retry repairs one that a process missed), SIGTERM drains them all (one
during start-up too), a killed process is started again, none outlives its supervisor, and no
secret is on a command line."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from proxy.processes import ProxyProcesses
from tests.servers import ROOT, ServerProcess, free_port, wait_until
from tests.stub_worker import StubWorkers

ADMIN = {"Authorization": "Bearer admin-k"}


@pytest.fixture(scope="module")
def stubs(tmp_path_factory):
    """Stub D workers on 127.0.0.1 and 127.0.0.2 (one process, one port)."""
    log = tmp_path_factory.mktemp("stubs") / "stubs.log"
    stub = StubWorkers(["127.0.0.1", "127.0.0.2"], free_port(), log, chunk_delay=0.05)
    yield stub.wait_ready()
    stub.stop()


@pytest.fixture(scope="module")
def proxy(tmp_path_factory, stubs):
    """One proxy with the default flags for the tests that leave it as they found it (they
    read it, or stop a process and continue it); it must exit 0 when the module is done."""
    proxy = start_proxy(tmp_path_factory.mktemp("proxy"), stubs)
    yield proxy
    assert proxy.stop() == 0


def start_proxy(tmp_path, stubs, *args: str) -> ServerProcess:
    proxy = ServerProcess(
        "proxy",
        ["--mode", "colocated", "--decode", stubs.url, "--workers", "2", "--admin-key", "admin-k"]
        + ["--health-interval", "0.3", *args],
        tmp_path / "proxy.log",
    )
    return proxy.wait_ready(path="/ready")


def complete(proxy: ServerProcess, **kw) -> httpx.Response:
    """One request on a fresh connection (the kernel picks the process per connection)."""
    body = {"prompt": "hi", "max_tokens": 2, **kw}
    return httpx.post(f"{proxy.url}/v1/completions", json=body, timeout=30)


def processes_seen(proxy: ServerProcess, path: str = "/ready", **kw) -> dict[int, dict]:
    """Answers of `path` by process index, from fresh connections until both answered."""
    seen: dict[int, dict] = {}

    def both() -> bool:
        try:
            body = httpx.get(f"{proxy.url}{path}", timeout=5, **kw).json()
        except httpx.TimeoutException:  # it reached the socket of a process not started again
            return False  # yet (the kernel picks the socket): it is answered once it is
        index = body["process"]["index"] if path == "/ready" else body["process"]
        seen[index] = body
        return len(seen) == 2

    assert wait_until(both, timeout=15, interval=0.02), f"only processes {list(seen)} answered"
    return seen


def admin_everywhere(proxy: ServerProcess, path: str, body: dict, headers=ADMIN) -> None:
    """An admin change through the public port: applied by the process it reached and by the
    other one (`"processes": 2`)."""
    r = httpx.post(f"{proxy.url}/admin/workers{path}", json=body, headers=headers, timeout=10)
    assert r.status_code == 200 and r.json()["processes"] == 2, r.text


def test_connections_spread_and_metrics_count_every_process(proxy):
    pids = {i: body["process"]["pid"] for i, body in processes_seen(proxy).items()}
    assert len(set(pids.values())) == 2 and proxy.proc.pid not in pids.values()
    ok = 'pdserve_proxy_requests_total{endpoint="/v1/completions",status="200"}'
    by_process = 'pdserve_proxy_process_requests_total{process="%d"}'
    before = proxy.metric(ok, 0.0)  # the shared proxy: what other tests sent (none do now)
    before_per_process = [proxy.metric(by_process % i, 0.0) for i in (0, 1)]
    assert sum(before_per_process) == before, before_per_process
    assert all(complete(proxy).status_code == 200 for _ in range(30))
    for _ in range(6):  # whichever process answers /metrics, it counts all 30
        assert proxy.metric(ok) == before + 30
        per_process = [
            proxy.metric(by_process % i, 0.0) - b for i, b in zip((0, 1), before_per_process)
        ]
        assert sum(per_process) == 30 and min(per_process) > 0, per_process


def test_a_sibling_still_starting_is_waited_for_not_refused():
    """The supervisor's private sockets listen before any child runs: an admin change sent on
    to a sibling that has not started serving (or is being started again) queues; refused, it
    would be lost on that process (CI saw `"processes": 1` right after start-up)."""
    sup = ProxyProcesses(["--port", "0"], "127.0.0.1", 0, 2)
    try:
        for url in sup.siblings:
            host, port = url.removeprefix("http://").split(":")
            with socket.create_connection((host, int(port)), timeout=2):
                pass  # accepted into the backlog, with no child to accept it yet
    finally:
        for sock in sup.public + sup.private:
            sock.close()


def test_ready_only_when_every_process_is(proxy):
    """The kernel may hand the next connection to any process, and each runs its own health
    checks: one 200 from `/ready` must mean every process can route. With process 1 stopped
    (it cannot answer; one whose checks have not yet seen a worker come up answers 503),
    process 0 answers 503 and names it; continued, both answer 200 (the shared proxy is left
    as it was found)."""
    pids = {i: body["process"]["pid"] for i, body in processes_seen(proxy).items()}
    assert all(body["ready"] for body in processes_seen(proxy).values())
    os.kill(pids[1], signal.SIGSTOP)
    try:

        def process_0_waits_for_1() -> bool:
            try:  # a connection the kernel gave to process 1 waits in its backlog
                r = httpx.get(f"{proxy.url}/ready", timeout=3)
            except httpx.TimeoutException:
                return False
            body = r.json()
            assert body["process"]["index"] == 0 and r.status_code == 503, r.text
            return len(body["siblings_not_ready"]) == 1 and not body["ready"]

        assert wait_until(process_0_waits_for_1, timeout=60, interval=0.05)
    finally:
        os.kill(pids[1], signal.SIGCONT)
    seen = processes_seen(proxy)
    assert all(body["ready"] and "siblings_not_ready" not in body for body in seen.values())


def test_an_admin_change_reaches_every_process(tmp_path, stubs):
    proxy = start_proxy(tmp_path, stubs)
    other = stubs.url_of("127.0.0.2")
    try:
        add = {"role": "decode", "url": other}
        admin_everywhere(proxy, "", add)

        def states(body: dict) -> dict[str, tuple[bool, bool]]:
            return {w["url"]: (w["healthy"], w["draining"]) for w in body["workers"]}

        def everywhere(expected: dict) -> bool:
            seen = processes_seen(proxy, "/admin/workers", headers=ADMIN)
            return all(states(body) == expected for body in seen.values())

        assert wait_until(lambda: everywhere({stubs.url: (True, False), other: (True, False)}))
        served = stubs.served("127.0.0.2")
        assert all(complete(proxy).status_code == 200 for _ in range(12))
        assert stubs.served("127.0.0.2") > served  # both processes route to it

        drain = {"url": other}
        admin_everywhere(proxy, "/drain", drain)
        assert everywhere({stubs.url: (True, False), other: (True, True)})
        served = stubs.served("127.0.0.2")
        assert all(complete(proxy).status_code == 200 for _ in range(12))
        assert stubs.served("127.0.0.2") == served  # no process sends it anything new

        admin_everywhere(proxy, "/remove", drain)
        assert everywhere({stubs.url: (True, False)})
        forged = {**ADMIN, "X-Pdserve-Peer": "guess"}  # not a sibling: the change goes on
        admin_everywhere(proxy, "", add, forged)
    finally:
        assert proxy.stop() == 0


def test_a_process_started_again_takes_its_siblings_workers(tmp_path, stubs):
    """Admin changes live in the processes that applied them: one killed and started again
    asks a sibling for its workers instead of serving the command line's."""
    proxy = start_proxy(tmp_path, stubs)
    other = stubs.url_of("127.0.0.2")
    try:
        add = {"role": "decode", "url": other}
        admin_everywhere(proxy, "", add)
        gone = {"url": stubs.url}  # a worker from the command line, removed
        admin_everywhere(proxy, "/remove", gone)
        old = {i: body["process"]["pid"] for i, body in processes_seen(proxy).items()}
        os.kill(old[1], signal.SIGKILL)

        def restarted() -> bool:
            pids = {i: body["process"]["pid"] for i, body in processes_seen(proxy).items()}
            return pids[1] != old[1]

        assert wait_until(restarted, timeout=30)
        for body in processes_seen(proxy, "/admin/workers", headers=ADMIN).values():
            assert [(w["url"], w["source"]) for w in body["workers"]] == [(other, "admin")]
        served = stubs.served("127.0.0.1")
        assert all(complete(proxy).status_code == 200 for _ in range(12))
        assert stubs.served("127.0.0.1") == served  # neither process routes to it again
    finally:
        assert proxy.stop() == 0


def test_sigterm_drains_every_process_and_a_killed_one_comes_back(tmp_path, stubs):
    proxy = start_proxy(tmp_path, stubs, "--drain-timeout", "10")  # the streams last ~2 s
    pids = {i: body["process"]["pid"] for i, body in processes_seen(proxy).items()}

    os.kill(pids[1], signal.SIGKILL)  # started again on the same sockets
    assert all(complete(proxy).status_code == 200 for _ in range(10))
    assert wait_until(lambda: processes_seen(proxy)[1]["process"]["pid"] != pids[1])
    pids = {i: body["process"]["pid"] for i, body in processes_seen(proxy).items()}

    def stream() -> list[str]:
        body = {"prompt": "hi", "max_tokens": 40, "stream": True}  # 2 s at 0.05 s a chunk
        url = f"{proxy.url}/v1/completions"
        with httpx.stream("POST", url, json=body, timeout=30) as r:
            return [line for line in r.iter_lines() if line]

    running = stubs.running("127.0.0.1")
    with ThreadPoolExecutor(6) as pool:
        streams = [pool.submit(stream) for _ in range(6)]
        assert wait_until(lambda: stubs.running("127.0.0.1") == running + 6)
        proxy.proc.send_signal(signal.SIGTERM)
        for s in streams:
            lines = s.result(timeout=30)
            assert lines[-1] == "data: [DONE]" and len(lines) == 41
            assert all("error" not in json.loads(x[6:]) for x in lines[:-1])
    assert proxy.proc.wait(timeout=20) == 0
    for pid in pids.values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    proxy.stop()


def test_a_stream_longer_than_the_drain_is_closed_when_it_ends(tmp_path, stubs):
    """`--drain-timeout 0.5`: a stream of ~10 s in flight at SIGTERM is cut, and every process
    exits 0, long before the stream would have ended."""
    proxy = start_proxy(tmp_path, stubs, "--drain-timeout", "0.5")
    body = {"prompt": "hi", "max_tokens": 200, "stream": True}  # 10 s at 0.05 s a chunk
    lines = []
    try:
        with httpx.stream("POST", f"{proxy.url}/v1/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                lines += [line] if line else []
                if len(lines) == 5:
                    proxy.proc.send_signal(signal.SIGTERM)
    except httpx.HTTPError:
        pass  # the connection closed mid-stream: what a cut stream looks like
    assert proxy.proc.wait(timeout=8) == 0
    assert 5 <= len(lines) < 150 and "data: [DONE]" not in lines


def test_no_process_outlives_a_killed_supervisor(tmp_path, stubs):
    proxy = start_proxy(tmp_path, stubs)
    pids = [body["process"]["pid"] for body in processes_seen(proxy).values()]
    proxy.proc.kill()

    def gone(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False

    assert wait_until(lambda: all(gone(pid) for pid in pids), timeout=20)
    proxy.stop()


def proc_file(pid: int, name: str) -> list[str]:
    """`/proc/PID/cmdline` or `/proc/PID/environ`: its NUL-separated strings."""
    return Path(f"/proc/{pid}/{name}").read_bytes().decode(errors="replace").split("\0")


def siblings_of(proxy: ServerProcess) -> tuple[list[str], dict[str, str]]:
    """The children's private URLs (by index) and the header that makes a call a sibling's,
    from a child's environment."""
    pid = processes_seen(proxy)[0]["process"]["pid"]
    env = dict(item.split("=", 1) for item in proc_file(pid, "environ") if "=" in item)
    info = json.loads(env["PDSERVE_PROXY_PROCESS"])
    return info["siblings"], {"X-Pdserve-Peer": info["token"]}


def test_no_secret_on_a_command_line(tmp_path, stubs, monkeypatch):
    """Secrets come from a file or the environment; the children get theirs in their
    environment, never on their command line (which every user of the host can read), and
    each enforces them."""
    admin_file = tmp_path / "admin.key"
    admin_file.write_text("admin-from-file\n")
    monkeypatch.setenv("PDSERVE_API_KEY", "client-from-env")
    args = ["--mode", "colocated", "--decode", stubs.url, "--workers", "2"]
    args += ["--admin-key-file", str(admin_file), "--internal-token", "token-from-flag"]
    proxy = ServerProcess("proxy", args, tmp_path / "proxy.log", fork=False)  # its cmdline
    proxy.wait_ready(path="/ready")
    try:
        urls, _ = siblings_of(proxy)
        children = [body["process"]["pid"] for body in processes_seen(proxy).values()]
        secrets = ("client-from-env", "admin-from-file", "token-from-flag")
        for pid in children:
            assert not any(s in arg for s in secrets for arg in proc_file(pid, "cmdline"))
            assert "PDSERVE_INTERNAL_TOKEN=token-from-flag" in proc_file(pid, "environ")
        given = proc_file(proxy.proc.pid, "cmdline")  # the flag is the user's choice
        assert "token-from-flag" in given and not any(s in " ".join(given) for s in secrets[:2])
        body = {"prompt": "hi", "max_tokens": 2}
        for url in urls:  # each process, whatever the kernel would pick
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=10)
            assert r.status_code == 401, r.text
            auth = {"Authorization": "Bearer client-from-env"}
            r = httpx.post(f"{url}/v1/completions", json=body, headers=auth, timeout=10)
            assert r.status_code == 200, r.text
            admin = {"Authorization": "Bearer admin-from-file"}
            assert httpx.get(f"{url}/admin/workers", headers=admin).status_code == 200
    finally:
        assert proxy.stop() == 0


def test_a_non_ascii_peer_header_is_no_peer(proxy):
    """A client's `X-Pdserve-Peer` that is not ASCII is a wrong token (the metrics of every
    process), not a 500 from comparing it."""
    urls, _ = siblings_of(proxy)
    for url in urls:
        r = httpx.get(f"{url}/metrics", headers={"X-Pdserve-Peer": b"\xff\xfe"})
        assert r.status_code == 200, r.text
        assert 'pdserve_proxy_process_requests_total{process="1"}' in r.text


def test_a_retry_repairs_an_admin_change_a_process_missed(tmp_path, stubs):
    """A change one process applied and the other missed (here: sent to one process as if by a
    sibling, so it goes no further) is repaired by sending it again: add and remove change
    nothing where they are done already and still go to every process. `?all=1` lists every
    process's view."""
    proxy = start_proxy(tmp_path, stubs)
    urls, peer = siblings_of(proxy)
    other = stubs.url_of("127.0.0.2")
    add, ref = {"role": "decode", "url": other}, {"url": other}

    def post(url: str, body: dict, headers: dict) -> dict:
        r = httpx.post(url, json=body, headers=headers, timeout=10)
        assert r.status_code == 200, r.text
        return r.json()

    def views() -> dict[int, set[str]]:
        r = httpx.get(f"{proxy.url}/admin/workers", params={"all": 1}, headers=ADMIN)
        assert r.status_code == 200, r.text
        return {v["process"]: {w["url"] for w in v["workers"]} for v in r.json()["processes"]}

    try:
        post(f"{urls[0]}/admin/workers", add, {**ADMIN, **peer})
        assert views() == {0: {stubs.url, other}, 1: {stubs.url}}
        assert post(f"{urls[0]}/admin/workers", add, ADMIN)["processes"] == 2
        assert views() == {0: {stubs.url, other}, 1: {stubs.url, other}}

        post(f"{urls[1]}/admin/workers/remove", ref, {**ADMIN, **peer})
        assert views() == {0: {stubs.url, other}, 1: {stubs.url}}
        assert post(f"{urls[1]}/admin/workers/remove", ref, ADMIN)["processes"] == 2
        assert views() == {0: {stubs.url}, 1: {stubs.url}}
        r = httpx.post(f"{proxy.url}/admin/workers/remove", json=ref, headers=ADMIN)
        assert r.status_code == 404, r.text  # no process knows it
    finally:
        assert proxy.stop() == 0


STOPPED_WHILE_STARTING = """
import json, os, signal, sys
from proxy.processes import ProxyProcesses

class StoppedAfterTheFirst(ProxyProcesses):
    def start(self, index, restarted=False):
        super().start(index, restarted)
        if index == 0:  # the others are not started yet
            os.kill(os.getpid(), signal.SIGTERM)

sup = StoppedAfterTheFirst(sys.argv[1:], "127.0.0.1", 0, 3)
code = sup.run()
print(json.dumps({"code": code, "pids": [c.pid for c in sup.children if c is not None]}))
"""


def test_sigterm_during_start_up_stops_every_child_started(stubs):
    """A stop signal between two children's starts: the supervisor starts no more, signals
    those it started, and exits (it waited forever on children it never signalled)."""
    args = ["--mode", "colocated", "--decode", stubs.url, "--workers", "3"]
    cmd = [sys.executable, "-c", STOPPED_WHILE_STARTING, *args]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert result["code"] == 0 and len(result["pids"]) == 1, result
    with pytest.raises(ProcessLookupError):
        os.kill(result["pids"][0], 0)


def test_a_child_killed_by_a_signal_is_no_clean_exit(tmp_path, stubs):
    """Killed by SIGKILL (as by the OOM killer) while the proxy stops: the exit status says
    so. The supervisor is held stopped meanwhile, so it cannot start the child again first."""
    proxy = start_proxy(tmp_path, stubs)
    pids = {i: body["process"]["pid"] for i, body in processes_seen(proxy).items()}
    os.kill(proxy.proc.pid, signal.SIGSTOP)
    try:
        os.kill(pids[1], signal.SIGKILL)
        assert wait_until(lambda: Path(f"/proc/{pids[1]}/stat").read_text().split()[2] == "Z")
        proxy.proc.send_signal(signal.SIGTERM)
    finally:
        os.kill(proxy.proc.pid, signal.SIGCONT)
    assert proxy.proc.wait(timeout=30) == 1
    proxy.stop()


ONE_CHILD_HANGS = """
import json, os, signal, sys
from proxy.processes import ProxyProcesses

class OneChildHangs(ProxyProcesses):
    def stop(self, signum, frame=None):
        os.kill(self.children[0].pid, signal.SIGSTOP)  # the stop signal will not act on it
        super().stop(signum, frame)

sup = OneChildHangs(sys.argv[1:], "127.0.0.1", 0, 2)
sup.stop_grace_s = 1.0
print(sup.port, flush=True)
code = sup.run()
print(json.dumps({"code": code, "pids": [c.pid for c in sup.children]}))
"""


def is_ok(url: str) -> bool:
    try:
        return httpx.get(url).status_code == 200
    except httpx.TransportError:
        return False


def test_shutdown_is_bounded_when_a_child_does_not_stop(stubs):
    """A child that does not stop within the grace period is killed, and the status says so."""
    args = ["--mode", "colocated", "--decode", stubs.url, "--workers", "2"]
    cmd = [sys.executable, "-c", ONE_CHILD_HANGS, *args]
    with subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True) as sup:
        try:
            url = f"http://127.0.0.1:{int(sup.stdout.readline())}/ready"
            assert wait_until(lambda: is_ok(url), timeout=30)
            sup.send_signal(signal.SIGTERM)
            assert sup.wait(timeout=30) == 0
        finally:
            sup.kill()
        result = json.loads(sup.stdout.read())
    assert result["code"] == 1, result
    for pid in result["pids"]:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
