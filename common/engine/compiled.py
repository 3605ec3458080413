"""The model forward under torch.compile: one graph for the whole model, in which the decoder
layer is a nested compile region (`torch.compiler.nested_compile_region`).

The region is traced and compiled once and stamped out for every layer (the layers' weights
and a CPU tensor holding the layer's index are its inputs), so compile time is that of one
layer, not of the whole stack, whatever the model's depth; and a step makes one call into
compiled code with one set of guards, not one per layer. Shapes are dynamic in the token count
T; T = 1 is padded to 2 so that no size-1 graph is compiled. Attention is the custom op
`pdserve::unified_attention`: opaque to the compiler, it runs the KV-transfer decorator per
layer at run time and skips padded rows. On CPU (float32, and bfloat16 where oneDNN has native
bf16) the GEMMs run on oneDNN-packed weights (`common.model.packed_linear`).

NOTE (GPU, untested here: no GPU on this project's machines): nothing above assumes a CPU; on
CUDA the packing is skipped and inductor emits Triton kernels, and decode steps replay this
forward captured as CUDA graphs (common/engine/decode_graphs.py).
"""

from __future__ import annotations

import functools
import logging
import types
from collections.abc import Callable

import torch
from torch import nn

from common.model.packed_linear import PackedLinear, can_pack, pack_linears

logger = logging.getLogger(__name__)


def compile_model(model: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The model's forward as one torch.compile'd graph (lazily: on the first call), in which
    the decoder layer is a nested compile region: traced and compiled once, stamped out for
    every layer."""
    region = torch.compiler.nested_compile_region(_own_copy(type(model.layers[0]).forward))
    for layer in model.layers:
        attn = layer.self_attn.attn
        attn.index_tensor = torch.tensor(attn.layer_index)  # CPU, whatever the model's device
        layer.forward = functools.partial(region, layer)
    # NOTE: skipping dynamo's module guards saves ~0.16 ms a module call; it is safe because
    # dynamo caches graphs per code object and each model gets its own copy of the code, so
    # another model in the process (other biases, other shapes) never runs this model's graph
    return torch.compile(
        _own_copy(type(model).forward).__get__(model),
        dynamic=True,
        fullgraph=True,
        options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe},
    )


def _own_copy(fn: types.FunctionType) -> types.FunctionType:
    """`fn` with a code object of its own (a cache of dynamo's of its own)."""
    return types.FunctionType(
        fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
    )


class CompiledModel:
    """Called like the model, `(input_ids, positions) → hidden`, compiled."""

    def __init__(self, model: nn.Module, device: torch.device, dtype: torch.dtype):
        self.model = model
        if can_pack(device, dtype):
            pack_linears(model.layers)
            model.packed_head = PackedLinear(model.head_weight)
        self.forward = compile_model(model)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions (T,) → hidden (T, hidden)."""
        num_tokens = input_ids.shape[0]
        if num_tokens == 1:
            input_ids = torch.cat([input_ids, input_ids.new_zeros(1)])
            positions = torch.cat([positions, positions.new_zeros(1)])
        # a float attribute (RMSNorm's eps) as a constant, not a graph input: the layer region
        # cannot take a symbolic float
        with torch._dynamo.config.patch(specialize_float=True):
            return self.forward(input_ids, positions)[:num_tokens]
