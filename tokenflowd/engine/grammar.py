"""Structured output in the engine: each constrained request's grammar matcher (llguidance), the
token masks of a step's constrained rows, computed on a worker thread while the forward runs, and
applied to the logits on their device.

    add_request ── Grammars.matcher(grammar) ──► request.grammar (a GrammarState)
    step:  masks = MaskWorker.start(rows)   (its thread: advance each matcher by the tokens it has not
           logits = forward(...)             seen, then fill its row of an int32 bitmask, 32 tokens a word)
           Sampler: logits[row, t] = -inf where bit t of the row's mask is 0, on the logits' device

A matcher sees its request's output tokens once each, in order, when the next mask is computed: a
token still on the device (overlap scheduling) is read from the step that sampled it (the worker
waits for it, not the thread that launches the forward). The front compiles and validates the
grammar (daemon/api/front.py), so a schema the library cannot enforce is a 400 before it gets here;
a matcher that still fails here refuses the request (InvalidRequestError). The library's tokenizer
index is built on first use (its cost: bench/results/grammar_libraries.json).
"""
from __future__ import annotations

import concurrent.futures
import logging
from typing import TYPE_CHECKING

import torch

from tokenflowd.engine.request import PLACEHOLDER, InvalidRequestError
from tokenflowd.engine.staging import to_device

if TYPE_CHECKING:
    import llguidance

    from tokenflowd.engine.request import SamplingRow
    from tokenflowd.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class GrammarState:
    """One request's matcher and how many of its output tokens it has consumed."""

    __slots__ = ("matcher", "num_consumed", "eos", "words")

    def __init__(self, matcher: "llguidance.LLMatcher", eos: int, words: int) -> None:
        self.matcher = matcher
        self.num_consumed = 0
        self.eos = eos  # the end-of-turn token a matcher in error lets through
        self.words = words  # of its mask: 32 tokens a word

    def advance(self, output: list[int]) -> None:
        """Consume the output tokens after those already consumed (a stopped matcher takes no more:
        what follows is its end-of-turn token, or tokens of a request that ignores it)."""
        m = self.matcher
        for k in range(self.num_consumed, len(output)):
            t = output[k]
            if t < 0:  # not known yet (a step in flight): from here on the next time
                self.num_consumed = k
                return
            if not m.is_stopped() and not m.consume_token(t):
                log.warning("grammar refused token %d: %s", t, m.get_error())
        self.num_consumed = len(output)

    def fill(self, v: torch.Tensor) -> None:
        """The next token's mask into `v` (int32 [words], contiguous, on the CPU)."""
        m = self.matcher
        m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * 4)
        if m.is_error():  # it can take nothing: let its end-of-turn token end the request
            v.zero_()
            bit = self.eos % 32
            v[self.eos // 32] = (1 << bit) if bit < 31 else -(1 << 31)


class Grammars:
    """llguidance over the engine's tokenizer: a matcher for each constrained request."""

    def __init__(self, tokenizer: "Tokenizer") -> None:
        self._tokenizer = tokenizer
        self._ll: "llguidance.LLTokenizer | None" = None

    def _index(self) -> "llguidance.LLTokenizer":
        if self._ll is None:
            import llguidance

            tok = self._tokenizer
            self._ll = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=tok.vocab_size,
                                              eos_token=list(tok.eos_token_ids) or None)
        return self._ll

    def matcher(self, grammar: str) -> GrammarState:
        """A fresh matcher for `grammar` (llguidance's JSON grammar, as the front compiled it)."""
        import llguidance

        index = self._index()
        try:
            m = llguidance.LLMatcher(index, grammar, log_level=0)
        except (ValueError, RuntimeError, TypeError) as e:
            raise InvalidRequestError(f"the grammar cannot be used: {e}") from None
        if m.is_error():
            raise InvalidRequestError(f"the grammar cannot be used: {m.get_error()}")
        return GrammarState(m, index.eos_token, (index.vocab_size + 31) // 32)


class MaskWorker:
    """Computes a step's masks on its own thread while the forward runs (llguidance lets go of
    the GIL while it computes a mask)."""

    def __init__(self, pin: bool = False) -> None:
        self._worker: concurrent.futures.ThreadPoolExecutor | None = None
        self.pin = pin  # masks in page-locked memory (for a GPU's non-blocking copy, engine/staging.py)

    def start(self, rows: "list[SamplingRow]", ends: list[int], prev: torch.Tensor | None,
              pending: list[int] | None) -> concurrent.futures.Future:
        """A Future of the int32 [len(rows), words] CPU bitmask of `rows` (each with a grammar), row
        j's token to be sampled at index ends[j] of its tokens. `prev`/`pending[j]`: the token before
        it is prev[pending[j]], still on the device (the step launched before, overlap scheduling;
        -1: none), copied to the host here, behind an event, without waiting for it."""
        late = [k for k in (pending or ()) if k >= 0]
        values, event = None, None
        if late and prev is not None:
            values = prev[to_device(late, torch.int64, prev.device)]
            if values.is_cuda:
                host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
                host.copy_(values, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
                values = host
        if self._worker is None:
            self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar")
        return self._worker.submit(self._fill, rows, ends, values, event, pending, self.pin)

    @staticmethod
    def _fill(rows: "list[SamplingRow]", ends: list[int], values: torch.Tensor | None, event,
              pending: list[int] | None, pin: bool) -> torch.Tensor:
        if event is not None:
            event.synchronize()  # the step that sampled them, not the forward launched after it
        late = iter(values.tolist() if values is not None else ())
        masks = torch.empty(len(rows), max(r.grammar.words for r in rows), dtype=torch.int32, pin_memory=pin)
        for j, (r, end) in enumerate(zip(rows, ends)):
            output = r.tokens[r.num_prompt_tokens:end]  # the update of the step before may fill its last meanwhile
            if pending is not None and pending[j] >= 0:
                token = next(late)
                if output and output[-1] == PLACEHOLDER:
                    output[-1] = token
            r.grammar.advance(output)
            r.grammar.fill(masks[j])
        return masks

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None


def apply_masks(logits: torch.Tensor, rows: list[int], masks: torch.Tensor) -> None:
    """logits[rows[j], t] = -inf where bit t of masks[j] is 0 (and for t past the masks' tokens),
    on the logits' device: the bitmask crosses as 4 bytes per 32 tokens and is unpacked there."""
    dev, width = logits.device, logits.shape[1]
    words = masks.to(dev, non_blocking=True)
    bits = (words[:, :, None] >> torch.arange(32, device=dev, dtype=torch.int32)) & 1
    allowed = bits.reshape(len(rows), -1)[:, :width].bool()
    if allowed.shape[1] < width:  # the model's padded ids past the tokenizer's vocabulary
        allowed = torch.nn.functional.pad(allowed, (0, width - allowed.shape[1]), value=False)
    index = to_device(rows, torch.int64, dev)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
