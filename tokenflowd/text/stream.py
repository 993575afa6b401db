"""Streaming text: `IncrementalDetokenizer` turns a stream of sampled ids into UTF-8-safe text
pieces, `StopStringMatcher` cuts the stream at a stop string."""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from tokenizers.decoders import DecodeStream

from tokenflowd.text.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Turns a stream of ids into text pieces, never splitting a UTF-8 character.

    The stepping is the tokenizers library's `DecodeStream` (the prefix/read-offset technique of
    HF text-generation-inference and vLLM, in Rust): one call per push, whose cost is O(window),
    not O(sequence). A step returns nothing while a character is still incomplete; the ids since
    the last piece are kept here, with a few emitted ones before them as context, so `flush` can
    still give what they decode to (U+FFFD where a character never completed), and the pieces
    always concatenate to the full decode. Ids outside the vocabulary decode to nothing, as in
    `Tokenizer.decode`.
    """

    # Ids kept as left context (decoders such as SentencePiece's look back for spaces).
    _CONTEXT = 5

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._backend = tokenizer.backend
        self._vocab_size = tokenizer.vocab_size
        self._skip = skip_special_tokens
        context = self._valid(prompt_ids[-self._CONTEXT:]) if len(prompt_ids) else []
        # A context whose text ends in U+FFFD (a literal one, or a character cut by the slice) would
        # be taken for an incomplete character and come out with the first piece.
        while context and tokenizer.decode(context, skip_special_tokens).endswith("\ufffd"):
            context.pop()
        self._context = deque(context, maxlen=self._CONTEXT)  # the last ids of emitted text
        self._pending: list[int] = []  # stepped since the last piece
        self._stream = DecodeStream(context, skip_special_tokens)

    def _valid(self, ids: Sequence[int]) -> list[int]:
        n = self._vocab_size
        return [i for i in ids if 0 <= i < n]

    def push(self, new_ids: Sequence[int]) -> str:
        """Text completed by `new_ids`; "" while a character is still incomplete."""
        if not new_ids:
            return ""
        ids = new_ids if min(new_ids) >= 0 and max(new_ids) < self._vocab_size else self._valid(new_ids)
        if not ids:
            return ""
        text = self._stream.step(self._backend, ids[0] if len(ids) == 1 else ids)  # an int steps faster
        if text is None:
            self._pending.extend(ids)
            return ""
        if self._pending:
            self._context.extend(self._pending)
            self._pending = []
        self._context.extend(ids)
        return text

    def flush(self) -> str:
        """Whatever is still held back at the end of the stream (possibly containing U+FFFD)."""
        if not self._pending:
            return ""
        decode, context = self._tokenizer.decode, list(self._context)
        prefix_text = decode(context, self._skip)
        new_text = decode(context + self._pending, self._skip)
        self._context.extend(self._pending)
        self._pending = []
        self._stream = DecodeStream(list(self._context), self._skip)
        return new_text[len(prefix_text):]


class StopStringMatcher:
    """Cuts a text stream at the first occurrence of any stop string; the stop is never emitted.

    Holds back the longest suffix of the text seen so far that is a prefix of some stop string,
    so a stop split over several pushes is still caught. Held text is < the longest stop.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._pending = ""
        self.matched = False

    def push(self, text: str) -> tuple[str, bool]:
        """(text safe to emit now, whether a stop string has matched)."""
        if self.matched:
            return "", True
        if not self._stops:
            return text, False
        buf = self._pending + text
        hits = [i for i in (buf.find(s) for s in self._stops) if i >= 0]
        if hits:
            self.matched, self._pending = True, ""
            return buf[: min(hits)], True
        hold = self._held_suffix_len(buf)
        self._pending = buf[len(buf) - hold :]
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return out

    def _held_suffix_len(self, buf: str) -> int:
        longest = max(len(s) for s in self._stops) - 1
        for k in range(min(longest, len(buf)), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self._stops):
                return k
        return 0
