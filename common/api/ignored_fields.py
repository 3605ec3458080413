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

What it keeps is bounded too, whatever clients send: `max_names` names, and until the next line
a count and the first `_EXAMPLES` others. A body's number of fields is bounded at the edge
(`--max-fields`, common/api/limits.py).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterable

from prometheus_client import Counter

logger = logging.getLogger(__name__)

OTHER = "other"
_EXAMPLES = 10  # names of the others shown in the next line
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
        self._num_unlogged = 0  # fields ignored past max_names, since the last line
        self._examples: list[str] = []  # the first _EXAMPLES distinct ones among them
        self._logged_at = -float("inf")

    def note(self, fields: Iterable[str], endpoint: str) -> None:
        num_other = 0
        for field in fields:
            if field in self.names:
                self.counter.labels(field=field).inc()
            elif len(self.names) < self.max_names and _NAME.match(field):
                self.names.add(field)
                self.counter.labels(field=field).inc()
                logger.warning("%s: ignored the unknown request field %r", endpoint, field)
            else:
                num_other += 1
                if len(self._examples) < _EXAMPLES and field[:64] not in self._examples:
                    self._examples.append(field[:64])
        if num_other:
            self.counter.labels(field=OTHER).inc(num_other)
            self._num_unlogged += num_other
        now = self.clock()
        if self._num_unlogged and now - self._logged_at >= self.log_every_s:
            self._logged_at = now
            logger.warning(
                "ignored %d more unknown request field(s), e.g. %s",
                self._num_unlogged,
                self._examples,
            )
            self._num_unlogged = 0
            self._examples = []
