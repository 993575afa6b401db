"""Streaming text: `IncrementalDetokenizer` turns a stream of sampled ids into UTF-8-safe text
pieces, `StopStringMatcher` cuts the stream at a stop string."""
from __future__ import annotations

from collections.abc import Sequence

from tokenflowd.text.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Turns a stream of ids into text pieces, never splitting a UTF-8 character.

    Two offsets into the ids (the technique of HF text-generation-inference / vLLM):

        ids: ... | prefix_offset ........ read_offset ........ end |
                   \\___ already emitted ___/ \\__ pending __/

    Each push decodes ids[prefix_offset:] and ids[prefix_offset:read_offset] and emits the
    difference, unless the longer decode ends in U+FFFD (a character still incomplete). The
    window restarts at read_offset only at such clean character boundaries, so the per-token cost
    is O(window), not O(sequence), and the emitted pieces concatenate to the full decode.
    Only the window is kept: `_window` is ids[prefix_offset:], `_read` is read_offset - prefix_offset.
    """

    # Prompt tokens kept as left context (decoders such as SentencePiece's look back for spaces).
    _PROMPT_CONTEXT = 5

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._window: list[int] = list(prompt_ids[-self._PROMPT_CONTEXT:]) if len(prompt_ids) else []
        self._read = len(self._window)

    def push(self, new_ids: Sequence[int]) -> str:
        """Text completed by `new_ids`; "" while a character is still incomplete."""
        self._window.extend(new_ids)
        prefix_text = self._tokenizer.decode(self._window[: self._read], self._skip)
        new_text = self._tokenizer.decode(self._window, self._skip)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        self._window = self._window[self._read :]
        self._read = len(self._window)
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        """Whatever is still held back at the end of the stream (possibly containing U+FFFD)."""
        prefix_text = self._tokenizer.decode(self._window[: self._read], self._skip)
        new_text = self._tokenizer.decode(self._window, self._skip)
        self._window = self._window[self._read :]
        self._read = len(self._window)
        return new_text[len(prefix_text) :]


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
