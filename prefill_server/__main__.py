"""`python -m prefill_server`: the prefill worker. The engine it serves is in common/engine;
the OpenAI-compatible server arrives with the worker-server issue."""

import sys

sys.exit("prefill_server: not served yet — the engine runs offline: python -m common.engine PROMPT")
