"""The model forward under torch.compile, compiled by region: one graph per decoder layer.

Every decoder layer runs the same compiled code (the layers' weights are graph inputs), so
compile time is that of one layer, not of the whole stack, whatever the model's depth. Shapes
are dynamic in the token count T; T = 1 is padded to 2 so that no size-1 graph is compiled.
Attention is the custom op `pdserve::unified_attention`: opaque to the compiler, it runs the
KV-transfer decorator per layer at run time and skips padded rows. On CPU (float32, and
bfloat16 where oneDNN has native bf16) the GEMMs run on oneDNN-packed weights
(`common.model.packed_linear`).

NOTE (GPU, untested here: no GPU on this project's machines): nothing above assumes a CPU; on
CUDA the packing is skipped and inductor emits Triton kernels. CUDA graphs are not used yet:
the attention op reads per-step metadata built in Python (`AttentionMetadata`), so a captured
decode would need that metadata in static, preallocated tensors per batch bucket, and the
decorator's connector calls kept outside the captured region (vLLM's piecewise graphs).
"""

from __future__ import annotations

import functools
import logging
import types

import torch
from torch import nn

from common.model.packed_linear import PackedLinear, can_pack, pack_linears

logger = logging.getLogger(__name__)


def compile_layers(model: nn.Module) -> None:
    """Compile the decoder layers' forward in place (lazily: on the first call), one graph
    shared by every layer of this model."""
    # NOTE: dynamo caches graphs per code object; a copy of the layer's code per model keeps
    # another model in the process (other biases, other shapes) off this model's graph, which
    # is what makes skipping the module guards safe: they cost ~0.16 ms a layer call (4.8 ms a
    # decode step of SmolLM2, a quarter of it at batch 1)
    forward = type(model.layers[0]).forward
    own = types.FunctionType(
        forward.__code__.replace(), forward.__globals__, forward.__name__, forward.__defaults__
    )
    compiled = torch.compile(
        own,
        dynamic=True,
        fullgraph=True,
        options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe},
    )
    for layer in model.layers:
        layer.forward = functools.partial(compiled, layer)


class CompiledModel:
    """Called like the model, `(input_ids, positions) → hidden`, with its layers compiled."""

    def __init__(self, model: nn.Module, device: torch.device, dtype: torch.dtype):
        self.model = model
        if can_pack(device, dtype):
            pack_linears(model.layers)
            model.packed_head = PackedLinear(model.head_weight)
        compile_layers(model)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions (T,) → hidden (T, hidden)."""
        num_tokens = input_ids.shape[0]
        if num_tokens == 1:
            input_ids = torch.cat([input_ids, input_ids.new_zeros(1)])
            positions = torch.cat([positions, positions.new_zeros(1)])
        # each layer's index is a graph input, so all layers share one compiled graph
        with torch._dynamo.config.patch(allow_unspec_int_on_nn_module=True):
            return self.model(input_ids, positions)[:num_tokens]
