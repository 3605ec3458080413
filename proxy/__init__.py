"""proxy: see DESIGN.md."""
