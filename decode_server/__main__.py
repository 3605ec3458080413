"""`python -m decode_server`: the decode worker. The engine it serves is in common/engine;
the OpenAI-compatible server arrives with the worker-server issue."""

import sys

sys.exit("decode_server: not served yet — the engine runs offline: python -m common.engine PROMPT")
