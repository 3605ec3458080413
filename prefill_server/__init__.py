"""prefill_server: the prefill worker: computes a prompt's KV cache and first token, then holds
the KV for a decode worker to read (pull) or writes it into one's blocks as it computes (push).
See docs/design.md."""
