"""`maybe_transfer_kv_layer`: the one place KV transfer touches the model.

Around a function with a `layer_name` parameter:
- no connector bound to the forward context, or no connector metadata this step: a plain call;
- otherwise: `connector.wait_for_layer_load(layer_name)` → the call →
  `connector.save_kv_layer(layer_name, kv_cache, attn_metadata)`.
The position of `layer_name` is found once, at decoration, so positional and keyword calls
both work.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import TypeVar

from common.attention.context import get_attention_context, get_forward_context

F = TypeVar("F", bound=Callable)


def maybe_transfer_kv_layer(func: F) -> F:
    params = list(inspect.signature(func).parameters)
    if "layer_name" not in params:
        raise TypeError(f"{func.__qualname__} has no 'layer_name' parameter to transfer KV by")
    index = params.index("layer_name")

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        ctx = get_forward_context()
        connector = None if ctx is None else ctx.connector
        if connector is None or not connector.has_connector_metadata():
            return func(*args, **kwargs)
        layer_name = args[index] if index < len(args) else kwargs["layer_name"]
        connector.wait_for_layer_load(layer_name)
        output = func(*args, **kwargs)
        attn_metadata, _, kv_cache = get_attention_context(layer_name)
        connector.save_kv_layer(layer_name, kv_cache, attn_metadata)
        return output

    return wrapper  # type: ignore[return-value]
