"""Benchmarks of pdserve: the engine, the HTTP layer, KV transfer and serving (`serve.py`)."""
