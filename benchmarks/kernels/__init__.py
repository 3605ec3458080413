"""Micro-benchmarks in one process: a kernel (decode and prefill attention, a linear layer's GEMM)
or one engine step's profile, against the alternatives the engine chooses between."""
