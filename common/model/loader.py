"""Load an HF-format folder (config.json + one or many *.safetensors) into the decoder.

Every error names the file and the problem: a missing file, an unsupported architecture, a
tensor of the wrong shape, a weight the model needs that no file holds.

A tensor-parallel rank (`tp`) reads only its rows or columns of each tensor (safetensors'
slices; `TPShard.slice_of` says which), so no rank ever holds the whole model.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch.overrides import TorchFunctionMode

from common.arch_config import ArchConfig
from common.model.hf_config import ModelLoadError, load_arch_config
from common.model.llama import LlamaForCausalLM
from common.parallel.group import TPGroup
from common.parallel.shard import TPShard

# HF name fragment → (fused parameter fragment, shard index)
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


_VOCAB_PARAMS = {"embed_tokens.weight", "lm_head.weight"}


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device | str,
    max_positions: int,
    tp: TPGroup | None = None,
) -> LlamaForCausalLM:
    """The model, or with `tp` this rank's shard of it."""
    model_dir = Path(model_dir)
    arch = load_arch_config(model_dir)
    with torch.device("meta"), _SkipInit():
        model = LlamaForCausalLM(arch, max_positions, tp)
    # to_empty's empty_like on a meta tensor imports sympy (~1.5 s); plain empty does not
    model = model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device="cpu"))
    _rebuild_buffers(model, arch, max_positions)
    _load_weights(model, arch, model_dir, None if tp is None else tp.shard)
    return model.to(device=device, dtype=dtype).eval()


class _SkipInit(TorchFunctionMode):
    """The layout pass runs no `torch.nn.init` function: the weights are read from the files,
    and torch's meta kernels for the random fills import torch._dynamo (~2.5 s of CPU at every
    start of an eager worker)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


def _rebuild_buffers(model: LlamaForCausalLM, arch: ArchConfig, max_positions: int) -> None:
    from common.model.layers import RotaryEmbedding

    rope = RotaryEmbedding(arch.head_dim, arch.rope_theta, max_positions, arch.rope_scaling)
    for layer in model.layers:
        layer.self_attn.rope = rope


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index}: lists shards that are missing: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir}: no *.safetensors weights found")
    return files


def _iter_tensors(
    files: list[Path], arch: ArchConfig, shard: TPShard | None
) -> Iterator[tuple[Path, str, torch.Tensor]]:
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 — safe_open is not a dict
                part = None if shard is None else shard.slice_of(name.removeprefix("model."), arch)
                if part is None:
                    yield path, name, f.get_tensor(name)
                else:
                    dim, start, stop = part
                    index = (slice(None),) * dim + (slice(start, stop),)
                    yield path, name, f.get_slice(name)[index]


def _load_weights(
    model: LlamaForCausalLM, arch: ArchConfig, model_dir: Path, shard: TPShard | None = None
) -> None:
    local = model.config  # the shard's architecture (the whole model's without tp)
    params = dict(model.named_parameters())
    vocab_rows = _vocab_rows(shard, arch.vocab_size)
    with torch.no_grad():  # a vocab shard's padding rows (the last rank's) stay zero
        for name in _VOCAB_PARAMS & params.keys():
            params[name].data[vocab_rows:].zero_()
    filled: dict[str, int] = {}
    expected_shards = {
        name: (3 if "qkv_proj" in name else 2 if "gate_up" in name else 1) for name in params
    }
    for path, name, tensor in _iter_tensors(_safetensors_files(model_dir), arch, shard):
        target, fused = _map_name(name)
        if target is None or (target == "lm_head.weight" and arch.tie_word_embeddings):
            continue
        if target not in params:
            raise ModelLoadError(
                f"{path}: tensor {name!r} does not belong to a {arch.architecture}"
            )
        dst = _shard_view(params[target], target, fused, local)
        if target in _VOCAB_PARAMS:
            dst = dst[:vocab_rows]
        if tuple(tensor.shape) != tuple(dst.shape):
            raise ModelLoadError(
                f"{path}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                f"expected {tuple(dst.shape)}"
            )
        with torch.no_grad():
            dst.copy_(tensor.to(dst.dtype))
        filled[target] = filled.get(target, 0) + 1
    missing = [n for n, k in expected_shards.items() if filled.get(n, 0) < k]
    if missing:
        raise ModelLoadError(
            f"{model_dir}: weights missing from the safetensors files: {missing[:5]}"
            + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else "")
        )


def _map_name(name: str) -> tuple[str | None, int | None]:
    if "rotary_emb" in name:
        return None, None
    name = name.removeprefix("model.")
    for frag, (fused, shard) in _FUSED.items():
        if f".{frag}." in name:
            return name.replace(frag, fused), shard
    return name, None


def _vocab_rows(shard: TPShard | None, vocab_size: int) -> int:
    """How many rows of a vocab-parallel tensor hold the vocabulary; the rest are padding."""
    if shard is None:
        return vocab_size
    start, stop = shard.vocab_range(vocab_size)
    return stop - start


def _shard_view(param: torch.Tensor, target: str, shard: int | None, arch: ArchConfig):
    if shard is None:
        return param.data
    if "qkv_proj" in target:
        sizes = [arch.q_size, arch.kv_size, arch.kv_size]
    else:
        sizes = [arch.intermediate_size] * 2
    start = sum(sizes[:shard])
    return param.data[start : start + sizes[shard]]
