"""decode_server: the decode worker: reads (pull) or receives (push) a prompt's KV cache from a
prefill worker and generates the rest; serves whole requests alone too (colocated). See
docs/design.md."""
