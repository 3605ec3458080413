"""prefill_server: see DESIGN.md."""
