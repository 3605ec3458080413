"""GPU checks: run as scripts or `python -m tests.gpu.check`; not collected by pytest."""
