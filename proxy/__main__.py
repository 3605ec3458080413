"""`python -m proxy --prefill URL [...] --decode URL [...] --port N` (see `--help`)."""

from proxy.server import main

main()
