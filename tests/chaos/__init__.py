"""Chaos tests: scripted faults (kill -9, SIGSTOP/SIGCONT, restarts, expired leases) on real
worker processes and a real proxy. Fast cases run with the suite; `chaos_long` ones only with
`PDSERVE_CHAOS_LONG=1` (`make chaos`)."""
