"""Tokenizer (byte-level BPE from GGUF metadata or tokenizer.json) and the chat template.

Token ids cross process boundaries; text is made in the API server process: `Tokenizer` encodes
prompts and renders chat templates (stream.py turns sampled ids back into text).
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

if TYPE_CHECKING:
    import gguf

# Special tokens that close a chat turn in the common templates (ChatML, Llama 3, Phi, Gemma).
# A model's own eos id is not always one of them: Llama 3.1 Instruct has eos <|end_of_text|> but
# ends turns with <|eot_id|>, and stopping only on eos would run on into a new turn.
_TURN_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")

_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2 is the llama3 regex with digits split one by one.
_QWEN2_REGEX = _LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}")

_GGUF_CONTROL = 3  # llama.cpp token types: 1 normal, 3 control, 4 user-defined
_GGUF_USER_DEFINED = 4


RELEASE_GIL_CHARS = 1 << 14  # texts this long are encoded with the GIL released (encode)


class Tokenizer:
    """A `tokenizers.Tokenizer` plus what serving needs: end-of-turn ids and the chat template."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        eos_token_ids: Sequence[int],
        bos_token_id: int | None,
        chat_template: str | None,
    ) -> None:
        self._backend = backend
        # Highest id + 1, not the number of entries: GGUF vocabularies with a repeated token string
        # leave a hole (see from_gguf), and ids above the hole are still valid.
        self.vocab_size: int = max(backend.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        self.eos_token_ids: tuple[int, ...] = _turn_end_ids(backend, eos_token_ids, chat_template)
        self.bos_token_id: int | None = bos_token_id
        self.chat_template: str | None = chat_template
        self._template = _compile_template(chat_template) if chat_template else None
        # The most UTF-8 bytes of text one token can stand for, at most (a token's string as the
        # vocabulary spells it: byte-level BPE's stand-in characters take 1-2 bytes for each byte
        # they stand for): a text of B bytes has at least B / max_token_bytes tokens.
        self.max_token_bytes: int = max((len(t.encode("utf-8")) for t in backend.get_vocab(with_added_tokens=True)),
                                        default=1) or 1
        self._byte_level = isinstance(backend.decoder, decoders.ByteLevel)
        self._token_bytes: dict[int, bytes] = {}

    def min_tokens(self, text: str) -> int:
        """A floor on the tokens `text` encodes to, from its length alone (no tokenizing, no
        encoding): its characters are at most its UTF-8 bytes."""
        return -(-len(text) // self.max_token_bytes)

    # ---- constructors ---------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, reader: "gguf.GGUFReader") -> "Tokenizer":
        """Byte-level BPE from `tokenizer.ggml.*` metadata; weights are not touched."""

        def get(key: str) -> Any:
            field = reader.fields.get(key)
            return None if field is None else field.contents()

        model = get("tokenizer.ggml.model")
        if model != "gpt2":
            raise ValueError(
                f"unsupported GGUF tokenizer model {model!r}: only byte-level BPE ('gpt2') is supported"
            )
        tokens: list[str] | None = get("tokenizer.ggml.tokens")
        if not tokens:
            raise ValueError("the GGUF file has no tokenizer.ggml.tokens metadata")
        merges: list[str] = get("tokenizer.ggml.merges") or []
        types: list[int] = get("tokenizer.ggml.token_type") or [1] * len(tokens)
        # NOTE: a few GGUFs repeat a token string (padding entries); BPE needs unique strings,
        # so the first id wins and the duplicate id decodes to nothing.
        vocab: dict[str, int] = {}
        for i, tok in enumerate(tokens):
            vocab.setdefault(tok, i)
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
        backend.pre_tokenizer = _gguf_pre_tokenizer(get("tokenizer.ggml.pre") or "default")
        backend.decoder = decoders.ByteLevel()
        backend.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == _GGUF_CONTROL]
        )
        backend.add_tokens(
            [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == _GGUF_USER_DEFINED]
        )
        bos, eos = get("tokenizer.ggml.bos_token_id"), get("tokenizer.ggml.eos_token_id")
        if bos is not None and get("tokenizer.ggml.add_bos_token"):
            backend.post_processor = processors.TemplateProcessing(
                single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A $B:1", special_tokens=[(tokens[bos], bos)]
            )
        return cls(
            backend,
            eos_token_ids=() if eos is None else (int(eos),),
            bos_token_id=None if bos is None else int(bos),
            chat_template=get("tokenizer.chat_template"),
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "Tokenizer":
        """tokenizer.json + tokenizer_config.json (+ chat_template.jinja, generation_config.json)."""
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"missing tokenizer file: {tok_file}")
        backend = tokenizers.Tokenizer.from_file(str(tok_file))
        cfg = _read_json(path / "tokenizer_config.json")
        for entry in (cfg.get("added_tokens_decoder") or {}).values():
            if backend.token_to_id(entry["content"]) is None:  # already in tokenizer.json as a rule
                backend.add_special_tokens([AddedToken(entry["content"], special=bool(entry.get("special")))])
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        if template is None and (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        if template is None:
            template = _read_json(path / "chat_template.json").get("chat_template")

        def token_id(value: Any) -> int | None:
            text = value.get("content") if isinstance(value, dict) else value
            return None if text is None else backend.token_to_id(text)

        eos_ids = [i for i in [token_id(cfg.get("eos_token"))] if i is not None]
        gen_eos = _read_json(path / "generation_config.json").get("eos_token_id")
        eos_ids += gen_eos if isinstance(gen_eos, list) else ([gen_eos] if gen_eos is not None else [])
        return cls(backend, eos_token_ids=eos_ids, bos_token_id=token_id(cfg.get("bos_token")), chat_template=template)

    # ---- text <-> ids -----------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Special tokens written in `text` (e.g. "<|im_start|>") always map to their single ids;
        `add_special_tokens` only controls the post-processor (a leading bos, where the model has one)."""
        if len(text) >= RELEASE_GIL_CHARS:
            # NOTE: tokenizers holds the GIL while it encodes one text but not a batch: a 3.9 MB
            # prompt encoded in a worker thread held the API server's event loop for 1.5 s
            return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # Random dummy models sample ids past the tokenizer's vocab: they decode to nothing.
        valid = [i for i in ids if 0 <= i < self.vocab_size]
        return self._backend.decode(valid, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (logprobs name tokens by them): byte-level BPE's stand-in
        characters mapped back to their bytes, SentencePiece's byte tokens (<0xE2>) and its ▁
        spaces; a special token's own text; nothing for an id outside the vocabulary."""
        known = self._token_bytes.get(token_id)
        if known is not None:
            return known
        piece = self._backend.id_to_token(token_id) if 0 <= token_id < self.vocab_size else None
        if piece is None:
            out = b""
        elif self._byte_level and all(c in _BYTE_OF_CHAR for c in piece):
            out = bytes(_BYTE_OF_CHAR[c] for c in piece)
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            out = bytes([int(piece[3:5], 16)])
        else:
            out = piece.replace("\u2581", " ").encode("utf-8")
        self._token_bytes[token_id] = out
        return out

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._backend

    # ---- chat --------------------------------------------------------------------------------

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> str:
        if self._template is None:
            raise ValueError("this model has no chat template; send a plain completion prompt instead")
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self._token_text(self.bos_token_id),
            eos_token=self._token_text(self.eos_token_ids[0] if self.eos_token_ids else None),
            **template_kwargs,
        )

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
        """`tools` (OpenAI's definitions) go to a template that renders them (text/tools.py); the
        messages are then as text/tools.py `template_messages` gives them."""
        # The template writes bos itself where the model wants one (as Hugging Face does).
        extra = {"tools": tools} if tools else {}
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **extra), add_special_tokens=False)

    def _token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else (self._backend.id_to_token(token_id) or "")


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's stand-in character of each byte (GPT-2's table: printable bytes stand for
    themselves, the others for 256 + their rank), inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + k): b for k, b in enumerate(others)}}


_BYTE_OF_CHAR = _byte_level_alphabet()


def _gguf_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    if pre == "smollm":
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre in ("gpt2", "default"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    regex = {"llama-bpe": _LLAMA3_REGEX, "llama3": _LLAMA3_REGEX, "qwen2": _QWEN2_REGEX}.get(pre)
    if regex is None:
        raise ValueError(
            f"unsupported GGUF pre-tokenizer {pre!r}; supported: smollm, gpt2, default, llama-bpe, qwen2"
        )
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _turn_end_ids(backend: tokenizers.Tokenizer, eos_ids: Sequence[int], template: str | None) -> tuple[int, ...]:
    """The model's eos ids plus any turn-end marker the chat template writes."""
    ids = list(dict.fromkeys(int(i) for i in eos_ids))
    for text in _TURN_END_TOKENS:
        tid = backend.token_to_id(text)
        if tid is not None and tid not in ids and (template is None or text in template):
            ids.append(tid)
    return tuple(ids)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _raise_exception(message: str) -> NoReturn:
    raise ValueError(f"chat template error: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Hugging Face overrides jinja's tojson: no HTML escaping, unicode kept.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _compile_template(source: str) -> jinja2.Template:
    """Compile the way transformers does, so templates written for it render identically."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
