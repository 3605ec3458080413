"""Ignored request fields: one warning per name, a bounded label set, and past it at most one
line per interval naming the rest."""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter

from common.api.ignored_fields import OTHER, IgnoredFields


def make(max_names: int = 3):
    now = [0.0]
    counter = Counter("t_ignored", "test", ["field"], registry=CollectorRegistry())
    return IgnoredFields(counter, max_names=max_names, clock=lambda: now[0]), counter, now


def count(counter: Counter, label: str) -> float:
    return counter.labels(field=label)._value.get()


def test_names_are_labels_until_the_bound_then_other(caplog):
    ignored, counter, now = make(max_names=3)
    with caplog.at_level(logging.WARNING, "common.api.ignored_fields"):
        ignored.note(["a", "b"], "/v1/completions")
        ignored.note(["a"], "/v1/completions")  # known: counted, not logged again
        ignored.note(["c", "d", "e", "bad name!"], "/v1/completions")
        ignored.note(["f"], "/v1/completions")  # within the minute: not logged
        now[0] = 61.0
        ignored.note(["g"], "/v1/completions")
    assert (count(counter, "a"), count(counter, "b"), count(counter, "c")) == (2, 1, 1)
    assert count(counter, OTHER) == 5  # d, e, "bad name!", f, g
    assert ignored.names == {"a", "b", "c"}
    lines = [r.getMessage() for r in caplog.records]
    assert sum("ignored the unknown request field" in line for line in lines) == 3  # a, b, c
    more = [line for line in lines if "more unknown" in line]
    assert len(more) == 2 and "3 more" in more[0] and "2 more" in more[1], more


def test_what_it_keeps_is_bounded_whatever_the_names(caplog):
    """A flood of distinct names (each body is bounded by --max-fields, not the bodies) keeps
    `max_names` labels, a count and a few examples: nothing grows with the flood."""
    ignored, counter, now = make(max_names=3)
    with caplog.at_level(logging.WARNING, "common.api.ignored_fields"):
        for body in range(200):
            ignored.note([f"f{body}_{i}" for i in range(250)], "/v1/completions")
        assert len(ignored.names) == 3 and len(ignored._examples) <= 10
        now[0] = 61.0
        ignored.note(["last"], "/v1/completions")
    assert count(counter, OTHER) == 200 * 250 - 3 + 1
    more = [r.getMessage() for r in caplog.records if "more unknown" in r.getMessage()]
    assert len(more) == 2 and f"{200 * 250 - 3 - 247 + 1} more" in more[1], more
