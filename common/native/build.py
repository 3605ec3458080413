"""Build a C kernel once per source, compiler and CPU, and load it: `load_library(source)`.

`gcc -O3 -march=native -fopenmp` into the kernel cache (`$PDSERVE_KERNEL_CACHE_DIR`, else
`$PDSERVE_CACHE_DIR/kernels`; ~1 s a file); None where there is no compiler, the build fails or
times out, or the library does not load, each logged: the caller keeps its torch path. A library
links the libgomp that torch loaded (same soname), so its threads are torch's OpenMP pool, not a
second one competing for the cores; ctypes drops the GIL for a call. The kernels share the
headers in this folder (`#include "../native/sum16.h"` from common/model/, bf16.h, and so on).

`march` builds for another instruction set than the host's (`x86-64-v3`: AVX2 and FMA, no
AVX-512), so that every path a kernel has can be checked on one machine. `$PDSERVE_KERNEL_MARCH`
replaces "native" for every kernel the engine builds: with `ATEN_CPU_CAPABILITY=avx2
ONEDNN_MAX_CPU_ISA=AVX2` (torch's and oneDNN's own limits, which `--dtype auto` also reads), an
AVX-512 machine runs the code an AVX2-only one runs (`x86-64-v3`); give it its own
`TORCHINDUCTOR_CACHE_DIR`, as inductor's cache key leaves torch's limit out.

The cache is code this process will run, so it trusts only what it could have written itself:
- the folder belongs to the process's user, mode 0700 (made so, or set so where it is ours);
  a folder that is not ours, or a link, is passed over for a private temporary one;
- a library that is a link, belongs to another user or is writable by group or others is refused
  and rebuilt in its place;
- the key holds the source, the headers, the flags, the compiler and its version, and the CPU.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
from functools import cache
from pathlib import Path

from common.settings import Settings

HEADERS = Path(__file__).parent  # sum16.h, bf16.h, exp512.h: included by the kernels
FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
BUILD_TIMEOUT_S = 120.0  # a build takes ~1 s; a hung compiler must not hang the start-up

logger = logging.getLogger(__name__)


def load_library(source: Path, march: str = "native") -> ctypes.CDLL | None:
    target = library_path(source, march)
    if target is None:
        logger.warning("no C compiler: %s not built, the torch path runs", source.name)
        return None
    if os.path.lexists(target) and not _is_trusted(target):
        logger.warning("%s is not this user's own file, or others may write it: rebuilt", target)
    if not _is_trusted(target) and not _build(_compiler(), _flags(march), source, target):
        return None
    try:
        return ctypes.CDLL(str(target))
    except OSError as e:
        logger.warning("%s did not load: %s", source.name, e)
        return None


def library_path(source: Path, march: str = "native") -> Path | None:
    """Where `source`'s library is cached; None without a compiler."""
    compiler = _compiler()
    if compiler is None:
        return None
    headers = b"".join(h.read_bytes() for h in sorted(HEADERS.glob("*.h")))  # what it includes
    key = hashlib.sha256(source.read_bytes() + headers + " ".join(_flags(march)).encode())
    key.update(_compiler_id(compiler) + _cpu_id())
    return kernel_dir() / f"{source.stem}-{key.hexdigest()[:16]}.so"


def _compiler() -> str | None:
    return shutil.which(Settings.from_env().cc)


def _flags(march: str) -> list[str]:
    if march == "native":
        march = Settings.from_env().kernel_march or march
    return [*FLAGS, f"-march={march}"]


def kernel_dir() -> Path:
    """The kernel cache: this user's own folder, mode 0700."""
    folder = Settings.from_env().kernel_cache_dir
    folder.parent.mkdir(parents=True, exist_ok=True)
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        info = folder.lstat()
        if stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid():
            if stat.S_IMODE(info.st_mode) != 0o700:
                folder.chmod(0o700)
            return folder
    except OSError as e:
        logger.warning("kernel cache %s unusable: %s", folder, e)
    logger.warning("kernel cache %s is not this user's own folder: using a private one", folder)
    return _private_dir()


@cache
def _private_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="pdserve-kernels-"))  # 0700, this process's user


def _is_trusted(path: Path) -> bool:
    """A regular file of this user's that no one else may write."""
    try:
        info = path.lstat()
    except OSError:
        return False
    return (
        stat.S_ISREG(info.st_mode)
        and info.st_uid == os.geteuid()
        and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    )


def _build(compiler: str, flags: list[str], source: Path, target: Path) -> bool:
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        cmd = [compiler, *flags, "-o", str(built), str(source), "-lm"]
        try:
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            logger.warning("%s did not build in %.0f s", source.name, BUILD_TIMEOUT_S)
            return False
        if run.returncode != 0:
            logger.warning("%s did not build:\n%s", source.name, run.stderr[-2000:])
            return False
        built.chmod(0o700)
        os.replace(built, target)  # atomic: another process may be building it too
    return True


@cache
def _compiler_id(compiler: str) -> bytes:
    """The compiler's path and version: another gcc may build other code from the same flags."""
    try:
        run = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, timeout=BUILD_TIMEOUT_S
        )
        version = run.stdout
    except (OSError, subprocess.TimeoutExpired):
        version = ""
    return f"{os.path.realpath(compiler)}\n{version}".encode()


def _cpu_id() -> bytes:
    """What -march=native depends on: the CPU's model and flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor().encode()
    lines = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines))).encode()
