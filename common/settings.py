"""Every environment variable pdserve reads, typed and documented in one place.

`Settings.from_env()` reads them all into one frozen `Settings` (a few dict lookups), checking
each; a module calls it where it needs a value, so what it sees is the environment of that
moment (a test's monkeypatched one included). The variables:

- `PDSERVE_CACHE_DIR` (`cache_dir`): downloaded models and built kernels; `~/.cache/pdserve`.
- `PDSERVE_KERNEL_CACHE_DIR` (`kernel_cache_dir`): the built native kernels; `cache_dir/kernels`.
- `PDSERVE_KERNEL_MARCH` (`kernel_march`): `-march` of the kernels built for "native" (this CPU).
- `CC` (`cc`): the C compiler of the native kernels; `gcc`.
- `OMP_NUM_THREADS` (`omp_num_threads`): torch threads where no flag says; one per core.
- `PDSERVE_INTERNAL_TOKEN` (`internal_token`): the workers' internal token where no flag gives it.
- `PDSERVE_NIXL_PROGRESS_DELAY_US` (`nixl_progress_delay_us`): µs between the NIXL agent's
  progress polls; 1000 (an idle agent then takes ~1.5% of a core, 0 would spin a whole one).
- `PDSERVE_KV_TRANSPORT_INFO` (`is_kv_transport_info`): `0` turns off reading UCX's log for the
  transport each peer uses; on.
- `PDSERVE_PROXY_PROCESS` (`proxy_process`): what the proxy's parent tells each of its child
  processes (JSON, proxy/processes.py); unset in the parent.

Not here: what the tree sets for a child (`NIXL_LOG_LEVEL`, `UCX_*`, a child's environment), and
secrets (API keys, KV events keys), which proxy/config.py and common/kv_cache/curve_keys.py read
with their `_FILE` variants from an environment mapping they are given.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

CACHE_ENV = "PDSERVE_CACHE_DIR"
KERNEL_CACHE_ENV = "PDSERVE_KERNEL_CACHE_DIR"
MARCH_ENV = "PDSERVE_KERNEL_MARCH"
INTERNAL_TOKEN_ENV = "PDSERVE_INTERNAL_TOKEN"
NIXL_PROGRESS_DELAY_ENV = "PDSERVE_NIXL_PROGRESS_DELAY_US"
KV_TRANSPORT_INFO_ENV = "PDSERVE_KV_TRANSPORT_INFO"
PROXY_PROCESS_ENV = "PDSERVE_PROXY_PROCESS"
DEFAULT_NIXL_PROGRESS_DELAY_US = 1000


@dataclass(frozen=True)
class Settings:
    cache_dir: Path
    kernel_cache_dir: Path
    kernel_march: str | None
    cc: str
    omp_num_threads: int | None  # None: unset, or not a whole number >= 1
    internal_token: str | None
    nixl_progress_delay_us: int
    is_kv_transport_info: bool
    proxy_process: str | None

    def __post_init__(self) -> None:
        if self.nixl_progress_delay_us < 1:
            raise ValueError(
                f"{NIXL_PROGRESS_DELAY_ENV} must be >= 1 µs, got {self.nixl_progress_delay_us}"
            )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Settings:
        """The settings `environ` gives; ValueError naming the variable for a bad value."""
        cache_dir = Path(environ.get(CACHE_ENV) or Path.home() / ".cache" / "pdserve")
        omp = environ.get("OMP_NUM_THREADS", "").strip()
        return cls(
            cache_dir=cache_dir,
            kernel_cache_dir=Path(environ.get(KERNEL_CACHE_ENV) or cache_dir / "kernels"),
            kernel_march=environ.get(MARCH_ENV) or None,
            cc=environ.get("CC", "gcc"),
            omp_num_threads=int(omp) if omp.isdigit() and int(omp) >= 1 else None,
            internal_token=environ.get(INTERNAL_TOKEN_ENV) or None,
            nixl_progress_delay_us=_progress_delay(environ.get(NIXL_PROGRESS_DELAY_ENV, "")),
            is_kv_transport_info=environ.get(KV_TRANSPORT_INFO_ENV, "1") != "0",
            proxy_process=environ.get(PROXY_PROCESS_ENV) or None,
        )


def _progress_delay(raw: str) -> int:
    try:
        return int(raw) if raw else DEFAULT_NIXL_PROGRESS_DELAY_US
    except ValueError:
        why = f"{NIXL_PROGRESS_DELAY_ENV} must be a whole number of µs, got {raw!r}"
        raise ValueError(why) from None
