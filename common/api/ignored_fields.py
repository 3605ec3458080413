"""Unknown request fields, ignored as vLLM's server ignores them.

vLLM's request models accept extra fields and log them; routers and proxies built for vLLM add
their own (vllm-router sends `no_stop_trim`, for one), and a worker that answered those with a
400 could not sit behind them. The request models (protocol.py) keep unknown top-level fields
aside, except the ones vLLM implements and this server does not, which would change the answer
(`NOT_IMPLEMENTED`: a 400 naming the field). This module reports the rest:

- one warning line per new field name, for the first `max_names` names; past those, at most
  one line a minute naming what was ignored since;
- `pdserve_ignored_fields_total{field}`: the label is the field's name for the first
  `max_names` distinct well-formed names and "other" after, so that clients, who choose the
  names, cannot grow the label set without bound.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterable

from prometheus_client import Counter

logger = logging.getLogger(__name__)

OTHER = "other"
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


class IgnoredFields:
    def __init__(
        self,
        counter: Counter,
        max_names: int = 32,
        log_every_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.counter = counter
        self.max_names = max_names
        self.log_every_s = log_every_s
        self.clock = clock
        self.names: set[str] = set()  # labelled by their own name
        self._unlogged: set[str] = set()  # ignored past max_names, since the last line
        self._logged_at = -float("inf")

    def note(self, fields: Iterable[str], endpoint: str) -> None:
        for field in fields:
            if field in self.names:
                label = field
            elif len(self.names) < self.max_names and _NAME.match(field):
                self.names.add(field)
                label = field
                logger.warning("%s: ignored the unknown request field %r", endpoint, field)
            else:
                label = OTHER
                self._unlogged.add(field[:64])
            self.counter.labels(field=label).inc()
        now = self.clock()
        if self._unlogged and now - self._logged_at >= self.log_every_s:
            self._logged_at = now
            shown = sorted(self._unlogged)[:10]
            logger.warning(
                "ignored %d more unknown request field name(s), e.g. %s", len(self._unlogged), shown
            )
            self._unlogged.clear()
