"""Chaos tests: scripted faults (kill -9, SIGSTOP/SIGCONT, restarts, expired leases) on real
worker processes and a real proxy. All of them run with the suite (`make chaos` runs just
these); the `chaos_long` ones take about two minutes."""
