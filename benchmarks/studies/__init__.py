"""The studies: each module a program answering one question on this machine (its docstring says
which, how to run it and what it prints); the figures are in docs/benchmarks.md."""
