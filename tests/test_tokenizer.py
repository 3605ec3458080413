"""Tokenizer loading, chat templates and the incremental detokenizer.

The tiny trained tokenizer covers loading and templates; the SmolLM2 tokenizer (a real 49k
byte-level BPE, with many tokens that are pieces of a UTF-8 character) drives the streams.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from common.tokenizer import IncrementalDetokenizer, Tokenizer
from tests.test_default_model import prepared_model_dir
from tests.tiny_tokenizer import write_tiny_tokenizer

MULTILINGUAL = [
    "日本語のテキストと中文文本，한국어 텍스트",
    "emoji 😀👍🏽👨‍👩‍👧‍👦 🇫🇷 ✓",
    "ñandú façade naïve Ω≈ç√∫ — “quotes”",
]
VALID_TEXTS = MULTILINGUAL + [
    "Hello, world! 12345\n\n   spaced out",
    "def f(x):\n    return x ** 2  # ok\n",
    "<|im_start|>user\nhi 😀<|im_end|>",
]


@pytest.fixture
def tiny_dir(tmp_path: Path) -> Path:
    write_tiny_tokenizer(tmp_path)
    return tmp_path


@pytest.fixture(scope="module")
def smollm(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(prepared_model_dir(tmp_path_factory))


def _edit_config(folder: Path, **changes) -> None:
    path = folder / "tokenizer_config.json"
    config = {**json.loads(path.read_text()), **changes}
    path.write_text(json.dumps({k: v for k, v in config.items() if v is not None}))


def test_tiny_tokenizer_loads(tiny_dir: Path):
    tok = Tokenizer.from_dir(tiny_dir)
    assert tok.vocab_size == 1024
    assert tok.eos_token_ids == (2,)
    assert tok.bos_token_id is None
    assert tok.special_token_ids == {0, 1, 2}
    text = "<|im_start|>user\nprint('héllo 世界 😀')<|im_end|>"
    ids = tok.encode(text)
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == "user\nprint('héllo 世界 😀')"


def test_tiny_tokenizer_is_deterministic(tmp_path: Path):
    write_tiny_tokenizer(tmp_path / "a")
    write_tiny_tokenizer(tmp_path / "b")
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (
        tmp_path / "b" / "tokenizer.json"
    ).read_bytes()


def test_chat_template_renders_chatml(tiny_dir: Path):
    tok = Tokenizer.from_dir(tiny_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == expected
    assert tok.apply_chat_template(messages) == expected + "<|im_start|>assistant\n"


def test_chat_template_joins_text_parts(tiny_dir: Path):
    tok = Tokenizer.from_dir(tiny_dir)
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    as_parts = tok.apply_chat_template([{"role": "user", "content": parts}])
    as_string = tok.apply_chat_template([{"role": "user", "content": "first\nsecond"}])
    assert as_parts == as_string
    image = [{"type": "image_url", "image_url": {"url": "x"}}]
    with pytest.raises(ValueError, match="image_url"):
        tok.apply_chat_template([{"role": "user", "content": image}])


def test_chat_template_helpers(tiny_dir: Path):
    template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
        "{{ bos_token }}|{{ eos_token }}|{{ tools | tojson }}|{{ strftime_now('%Y') | length }}|"
        "{% generation %}{{ messages[0]['content'] }}{% endgeneration %}|{{ flavor }}"
    )
    (tiny_dir / "chat_template.jinja").write_text(template)
    _edit_config(tiny_dir, bos_token="<|endoftext|>")
    tok = Tokenizer.from_dir(tiny_dir)
    tools = [{"name": "f", "description": "<é>"}]
    rendered = tok.apply_chat_template([{"role": "user", "content": "x"}], tools=tools, flavor="y")
    assert rendered == '<|endoftext|>|<|im_end|>|[{"name": "f", "description": "<é>"}]|4|x|y'
    with pytest.raises(ValueError, match="user first"):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_generation_config_and_bos(tiny_dir: Path):
    (tiny_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    _edit_config(tiny_dir, bos_token="<|im_start|>", add_bos_token=True)
    tok = Tokenizer.from_dir(tiny_dir)
    assert tok.eos_token_ids == (0, 2)
    assert tok.bos_token_id == 1
    assert tok.encode("hi")[0] == 1
    assert tok.encode("<|im_start|>hi").count(1) == 1
    assert tok.encode("hi", add_special_tokens=False)[0] != 1


def test_missing_files_raise_naming_the_path(tmp_path: Path):
    with pytest.raises(ValueError, match=str(tmp_path / "tokenizer.json")):
        Tokenizer.from_dir(tmp_path)
    write_tiny_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match=str(tmp_path / "tokenizer_config.json")):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").unlink()
    tok = Tokenizer.from_dir(tmp_path)  # tokenizer.json alone is enough to encode
    assert tok.decode(tok.encode("ok")) == "ok"
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_detokenizer_tiny_valid_text(tiny_dir: Path):
    tok = Tokenizer.from_dir(tiny_dir)
    for text in VALID_TEXTS:
        ids = tok.encode(text)
        _assert_valid_stream(tok, ids, prompt=tok.encode("<|im_start|>assistant\n"))


@pytest.mark.slow
def test_detokenizer_smollm_valid_text(smollm: Tokenizer):
    prompt = smollm.encode(smollm.apply_chat_template([{"role": "user", "content": "hi"}]))
    for text in VALID_TEXTS:
        _assert_valid_stream(smollm, smollm.encode(text), prompt)
        _assert_valid_stream(smollm, smollm.encode(text), prompt=[])


@pytest.mark.slow
def test_detokenizer_random_streams_match_full_decode(smollm: Tokenizer):
    rng = random.Random(0)
    pieces = sorted({i for text in MULTILINGUAL for i in smollm.encode(text)})  # many partial chars
    for n in range(300):
        pool = pieces if n % 2 else range(smollm.vocab_size)
        ids = [rng.choice(pool) for _ in range(rng.randrange(1, 150))]
        ids += [rng.randrange(smollm.vocab_size) for _ in range(rng.randrange(0, 5))]
        prompt = [rng.randrange(smollm.vocab_size) for _ in range(rng.randrange(0, 8))]
        for skip in (True, False):
            detok = IncrementalDetokenizer(smollm, prompt, skip_special_tokens=skip)
            streamed = "".join(detok.add(i) for i in ids) + detok.flush()
            expected = smollm.decode(ids, skip_special_tokens=skip)
            assert streamed == detok.text == expected, (ids, prompt)


@pytest.mark.slow
def test_detokenizer_window_stays_small(smollm: Tokenizer):
    ids = smollm.encode(" ".join(MULTILINGUAL * 200))
    detok = IncrementalDetokenizer(smollm, [])
    for i in ids:
        detok.add(i)
        assert len(detok._ids) <= 2 * IncrementalDetokenizer.MAX_PENDING_TOKENS
    assert detok.text == smollm.decode(ids)


def _assert_valid_stream(tok: Tokenizer, ids: list[int], prompt: list[int]) -> None:
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.add(i) for i in ids]
    assert not any("\ufffd" in d for d in deltas), deltas
    assert detok.flush() == ""
    assert "".join(deltas) == detok.text == tok.decode(ids)
