"""Benchmarks of pdserve: the engine, the HTTP layer, KV transfer and serving (`serve.py`).

    serve.py        the load test against any OpenAI-compatible server (`vllm bench serve`'s way);
                    serving/ is its parts: datasets, client, metrics, report, a rate sweep
    studies/        one program a question, each run as `python -m benchmarks.studies.NAME`:
                    P/D vs colocated and vs vLLM, KV-aware routing, the reverse pull, multi-turn,
                    hostile requests, soak, cold start, the proxy's, HTTP layer's, grammar's and
                    KV transfer's costs, the engine against its peers
    kernels/        one process, one kernel or step: attention, GEMM, an engine step's profile
    peers/          the other side of a comparison: interleaved peer processes (protocol.py,
                    engine_peer.py, vllm_peer.py) and vLLM's CPU build (vllm_cpu.py)
    cluster.py      P, D and the proxy for a study, on deploy/cluster.py's starter
    proxy_stubs.py  instant stub workers (studies/bench_proxy.py; the proxy's tests too)

No study imports another (studies/transfer_raw.py is bench_transfer.py's raw-NIXL half). A study
whose decision has landed and whose figure is in docs/benchmarks.md is retired.
"""
