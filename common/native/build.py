"""Build a C kernel once per source and CPU, and load it: `load_library(source)`.

`gcc -O3 -march=native -fopenmp` into `$PDSERVE_CACHE_DIR/kernels` (~1 s a file; the compose
files keep that folder in their cache volume); None where there is no compiler, the build fails
or the library does not load, each logged: the caller keeps its torch path. A library links the
libgomp that torch loaded (same soname), so its threads are torch's OpenMP pool, not a second
one competing for the cores; ctypes drops the GIL for a call. The kernels share the headers
in this folder (`#include "../native/sum16.h"` from common/model/, and so on).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from common.model.default_model import cache_dir

HEADERS = Path(__file__).parent  # sum16.h: included by the kernels
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]

logger = logging.getLogger(__name__)


def load_library(source: Path) -> ctypes.CDLL | None:
    compiler = shutil.which(os.environ.get("CC", "gcc"))
    if compiler is None:
        logger.warning("no C compiler: %s not built, the torch path runs", source.name)
        return None
    headers = b"".join(h.read_bytes() for h in sorted(HEADERS.glob("*.h")))  # what it includes
    key = hashlib.sha256(source.read_bytes() + headers + " ".join(FLAGS).encode() + _cpu_id())
    key = key.hexdigest()
    target = cache_dir() / "kernels" / f"{source.stem}-{key[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            cmd = [compiler, *FLAGS, "-o", str(built), str(source), "-lm"]
            run = subprocess.run(cmd, capture_output=True, text=True)
            if run.returncode != 0:
                logger.warning("%s did not build:\n%s", source.name, run.stderr[-2000:])
                return None
            os.replace(built, target)  # atomic: another process may be building it too
    try:
        return ctypes.CDLL(str(target))
    except OSError as e:
        logger.warning("%s did not load: %s", source.name, e)
        return None


def _cpu_id() -> bytes:
    """What -march=native depends on: the CPU's model and flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor().encode()
    lines = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines))).encode()
