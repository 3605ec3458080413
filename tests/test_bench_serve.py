"""benchmarks/serve.py end to end: a real decode worker (tiny model), the CLI as a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.servers import ROOT, free_port

NUM_PROMPTS = 6
INPUT_LEN = 24
OUTPUT_LEN = 8
SCALARS = (
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "duration",
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "total_token_throughput",
    "max_output_tokens_per_s",
    "max_concurrent_requests",
)


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "benchmarks.serve", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def bench(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return cli("--disable-progress", *args, timeout=timeout)


@pytest.fixture(scope="module")
def server(start_server, tiny_model):
    model = str(tiny_model("llama"))
    return start_server("decode", "--model", model, "--num-blocks", "128", "--max-model-len", "256")


@pytest.fixture(scope="module")
def results(server, tmp_path_factory):
    """{endpoint type: (result JSON, stdout, path)}, one short run each."""
    out = tmp_path_factory.mktemp("bench")
    runs = {}
    for endpoint_type, extra in (("completions", []), ("chat", ["--num-warmups", "2"])):
        path = out / f"{endpoint_type}.json"
        proc = bench(
            "--base-url", server.url,
            "--endpoint-type", endpoint_type,
            "--num-prompts", str(NUM_PROMPTS),
            "--random-input-len", str(INPUT_LEN),
            "--random-output-len", str(OUTPUT_LEN),
            "--max-concurrency", "3",
            "--goodput", "ttft:60000", "e2el:60000",
            "--result-file", str(path),
            *extra,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        runs[endpoint_type] = (json.loads(path.read_text()), proc.stdout, path)
    return runs


@pytest.mark.parametrize("endpoint_type", ["completions", "chat"])
def test_every_metric_present(results, endpoint_type):
    result, stdout, _ = results[endpoint_type]
    assert "Serving Benchmark Result" in stdout and "Mean TPOT (ms):" in stdout
    for key in SCALARS:
        assert result[key] is not None, key
    for name in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p90", "p99"):
            assert result[f"{stat}_{name}_ms"] is not None, f"{stat}_{name}_ms"
    assert result["args"]["endpoint_type"] == endpoint_type and result["model"]


@pytest.mark.parametrize("endpoint_type", ["completions", "chat"])
def test_requests_add_up(results, endpoint_type):
    result, _, _ = results[endpoint_type]
    requests = result["requests"]
    assert result["completed"] + result["failed"] == len(requests) == NUM_PROMPTS
    assert result["completed"] == NUM_PROMPTS and result["failures"] == {}
    for r in requests:
        assert r["success"] and 0 < r["ttft"] <= r["e2el"]
        assert r["output_len"] == r["expected_output_len"] == OUTPUT_LEN  # ignore_eos
        assert 1 <= len(r["itl"]) + 1 <= OUTPUT_LEN  # one chunk per token, or fewer
        if endpoint_type == "completions":
            assert r["prompt_len"] == INPUT_LEN  # token ids, counted exactly
    assert result["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])


@pytest.mark.parametrize("endpoint_type", ["completions", "chat"])
def test_server_metric_deltas_show_the_requests(results, endpoint_type):
    result, _, _ = results[endpoint_type]
    delta = result["server_metrics"]["delta"]
    route = "/v1/completions" if endpoint_type == "completions" else "/v1/chat/completions"
    key = f'pdserve_requests_total{{endpoint="{route}",role="decode",status="200"}}'
    assert delta[key] == NUM_PROMPTS  # warm-ups happen before the first scrape
    assert delta["pdserve_generation_tokens_total"] == result["total_output_tokens"]
    assert delta["pdserve_prompt_tokens_total"] == result["total_input_tokens"]
    assert "pdserve_kv_blocks_free" not in delta  # a gauge: in before/after only
    assert "pdserve_kv_blocks_free" in result["server_metrics"]["after"]


def test_compare(results):
    (_, _, a), (_, _, b) = results["completions"], results["chat"]
    proc = cli("compare", str(a), str(b))
    assert proc.returncode == 0, proc.stderr
    rows = {line.split()[0]: line.split()[1:] for line in proc.stdout.splitlines()}
    assert rows["completed"] == [str(NUM_PROMPTS), str(NUM_PROMPTS), "1.000"]
    assert "mean_ttft_ms" in rows and "b/a" in rows["metric"]


def test_unreachable_server_is_counted_not_hung(tmp_path):
    path = tmp_path / "bad.json"
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    proc = bench(
        "--base-url", url, "--model", "m", "--num-prompts", "5",
        "--random-input-len", "8", "--random-output-len", "4", "--result-file", str(path),
        timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    result = json.loads(path.read_text())
    assert (result["completed"], result["failed"]) == (0, 5)
    assert result["failures"] == {"connection_error": 5}
    assert len(result["requests"]) == 5 and result["server_metrics"] is None
    assert result["mean_ttft_ms"] is None  # failed requests carry no latencies


def test_bad_arguments_are_argparse_errors(tmp_path):
    for args, message in (
        (["--goodput", "ttfx:100"], "unknown SLO 'ttfx'"),
        (["--dataset-name", "sharegpt", "--dataset-path", str(tmp_path / "no.json")], "not found"),
        (["--dataset-name", "prompts"], "needs --dataset-path"),
        (["--random-range-ratio", "1.5"], "--random-range-ratio"),
    ):
        proc = bench(*args, timeout=30)
        assert proc.returncode == 2 and message in proc.stderr, (args, proc.stderr)


def test_vllm_spellings_save_result_with_its_name_metadata_and_details(server, tmp_path):
    """`vllm bench serve`'s output flags carry over: --save-result names the file as vLLM
    does, --metadata lands on top of the JSON, --save-detailed adds vLLM's per-request lists."""
    proc = bench(
        "--base-url", server.url, "--num-prompts", "3", "--random-input-len", "8",
        "--random-output-len", "4", "--max-concurrency", "2", "--request-rate", "50",
        "--save-result", "--result-dir", str(tmp_path), "--label", "pd",
        "--metadata", "cluster=local", "version=1", "--save-detailed",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    (path,) = tmp_path.glob("*.json")
    assert path.name.startswith("pd-50.0qps-concurrency2-") and path.suffix == ".json"
    result = json.loads(path.read_text())
    assert (result["cluster"], result["version"], result["label"]) == ("local", "1", "pd")
    assert result["model_id"] == result["tokenizer_id"] == result["model"]
    assert (result["num_prompts"], result["request_rate"], result["max_concurrency"]) == (3, 50, 2)
    assert result["input_lens"] == [r["prompt_len"] for r in result["requests"]]
    assert result["output_lens"] == [4, 4, 4] and len(result["itls"]) == 3
    assert all(t > 0 for t in result["ttfts"]) and result["errors"] == ["", "", ""]
    named = tmp_path / "named"
    proc = bench(
        "--base-url", server.url, "--num-prompts", "1", "--random-input-len", "8",
        "--random-output-len", "2", "--save-result", "--result-dir", str(named),
        "--result-filename", "x.json", "--metadata", "bad",
    )  # fmt: skip
    assert proc.returncode == 2 and "KEY=VALUE" in proc.stderr
