"""`python -m decode_server`: the decode worker, an OpenAI-compatible server (see --help).

Until KV transfer joins, both roles serve requests colocated: prefill and decode on one engine.
"""

from common.api.server import main

if __name__ == "__main__":
    main("decode")
