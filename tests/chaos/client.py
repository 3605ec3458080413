"""Requests with hang guards, and the outcomes a request may have under faults: a success whose
greedy tokens equal the colocated reference, or a clear error (a 5xx in OpenAI's shape, or an
SSE error event then [DONE]). Never a hang, never a 200 with other tokens."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

HANG_GUARD = 30.0  # seconds any one request may take, whatever the fault


@dataclass
class Outcome:
    status: int
    token_ids: list[int] = field(default_factory=list)
    error: str | None = None  # a 5xx's message, or the stream's error event
    is_done: bool = True  # a stream ended with [DONE]
    seconds: float = 0.0

    @property
    def is_ok(self) -> bool:
        return self.status == 200 and self.error is None and self.is_done


def body(prompt: list[int], max_tokens: int = 8, **extra) -> dict:
    """A greedy completion whose token ids come back."""
    return dict(
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        ignore_eos=True,
        return_token_ids=True,
        **extra,
    )


def complete(url: str, payload: dict, timeout: float = HANG_GUARD) -> Outcome:
    started = time.monotonic()
    r = httpx.post(f"{url}/v1/completions", json=payload, timeout=timeout)
    out = Outcome(r.status_code, seconds=time.monotonic() - started)
    if r.status_code == 200:
        out.token_ids = r.json()["choices"][0]["token_ids"]
    else:
        out.error = r.json()["error"]["message"]
    return out


def stream(
    url: str,
    payload: dict,
    on_event: Callable[[int], None] | None = None,
    timeout: float = HANG_GUARD,
) -> Outcome:
    """A streamed completion; `on_event(i)` runs after the i-th data event (to script a fault)."""
    started = time.monotonic()
    payload = {**payload, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=payload, timeout=timeout) as r:
        out = Outcome(r.status_code, is_done=False)
        if r.status_code != 200:
            out.error = json.loads(r.read())["error"]["message"]
            out.is_done = True
            return out
        events = (line.removeprefix("data: ") for line in r.iter_lines() if line)
        for i, data in enumerate(events):
            assert time.monotonic() - started < timeout, "the stream hung"
            if data == "[DONE]":
                out.is_done = True
                break
            event = json.loads(data)
            if "error" in event:
                out.error = event["error"]["message"]
            else:
                out.token_ids += event["choices"][0].get("token_ids") or []
            if on_event is not None:
                on_event(i)
    out.seconds = time.monotonic() - started
    return out


def assert_clear(out: Outcome, reference: list[int]) -> None:
    """Success with exactly the colocated tokens, or a clear error; nothing in between."""
    assert out.is_done, f"the stream ended without [DONE]: {out}"
    assert out.seconds < HANG_GUARD, f"the request took {out.seconds:.1f}s: {out}"
    if out.error is None:
        assert out.status == 200 and out.token_ids == reference, f"{out} != {reference}"
        return
    assert out.status >= 500 or out.status == 200, out  # 200: an error event in the stream
    assert out.error.strip(), out
    prefix = reference[: len(out.token_ids)]
    assert out.token_ids == prefix, f"tokens before the error differ: {out} != {reference}"


class Background:
    """A call on its own thread (a request under a fault scripted meanwhile); `result()` fails
    the test if it has not returned within the hang guard."""

    def __init__(self, fn: Callable, *args, **kwargs):
        self._result: object = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn, args, kwargs), daemon=True)
        self._thread.start()

    def _run(self, fn, args, kwargs) -> None:
        try:
            self._result = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 — re-raised in result()
            self._error = e

    def result(self, timeout: float = HANG_GUARD):
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"the request hung for {timeout}s"
        if self._error is not None:
            raise self._error
        return self._result
