"""decode_server: see DESIGN.md."""
