"""`python -m decode_server`: the decode worker, an OpenAI-compatible server (see --help).

Both roles are the same server (common/api/server.py) and engine; the role decides what a
request with `kv_transfer_params` does (docs/design.md).
"""

from common.api.server import main

if __name__ == "__main__":
    main("decode")
