"""A small real tokenizer for tiny random test models, trained offline in about a second.

`write_tiny_tokenizer(model_dir)` trains a byte-level BPE on a few Python stdlib sources and writes
tokenizer.json + tokenizer_config.json (ChatML template, eos `<|im_end|>`). Ids 0, 1, 2 are
`<|endoftext|>`, `<|im_start|>`, `<|im_end|>`. Same Python, same files: the output is deterministic.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CORPUS_MODULES = ("textwrap", "string", "json.decoder", "json.encoder", "shlex", "fnmatch")
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def write_tiny_tokenizer(model_dir: Path, vocab_size: int = 1024) -> None:
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    tokenizer.save(str(model_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHATML_TEMPLATE,
    }
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def _corpus() -> list[str]:
    texts = []
    for name in CORPUS_MODULES:
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.origin, f"stdlib module {name} has no source"
        texts.extend(Path(spec.origin).read_text(encoding="utf-8").splitlines(keepends=True))
    return texts
