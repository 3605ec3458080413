"""`python -m proxy`: the OpenAI front door over prefill and decode pools (the proxy issue)."""

import sys

sys.exit("proxy: not built yet — the engine runs offline: python -m common.engine PROMPT")
