"""The serving benchmark's parts (`benchmarks/serve.py` is its command line).

datasets   prompts and their intended output lengths (random, ShareGPT, a prompts file)
conversations  multi-turn conversations (synthetic, ShareGPT) and the history each turn sends
multiturn  conversations in parallel, turns in sequence; the multi-turn run end to end
turn_metrics  latencies by turn index, the share of prompt tokens served from cache
client     one streamed request against an OpenAI-compatible server → a `RequestRecord`
runner     arrivals (gamma inter-arrival times), concurrency cap, warm-ups, duration bound
metrics    the aggregate metrics of `vllm bench serve`, pure functions over the records
prometheus the server's /metrics before and after, and the counters' deltas
report     the printed table, the result JSON, `compare`
plots      latency CDFs and output tokens/s over time (matplotlib, optional)
"""
