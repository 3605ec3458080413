"""C kernels for the CPU, built with the system's compiler at start-up (common/native/build.py)."""
