"""Token sampling: penalties, greedy, temperature, top-k, top-p, per-request seeds, min_tokens.

Rows are filtered together (one sort of the vocabulary for the rows that need top-k/top-p); the draw
is per row only where a request brings its own seeded generator, so a seeded request samples the
same tokens whatever else shares its batch. On a GPU with flashinfer, the unseeded rows go through
its top-k/top-p sampling kernel instead (no sort), from the sampler's device generator.

Penalties (presence, frequency, repetition) are applied to the logits first, on their device, to
the rows that ask for them only: one [rows, vocab] count of each such row's output tokens (a token
an earlier launched step samples, not yet seen by the host, is counted from that step's ids where
they are), then Hugging Face's repetition penalty and OpenAI's presence and frequency penalties.

Logprobs, for the rows that ask: the log-softmax of the raw logits (before penalties, the
min_tokens mask and temperature, as vLLM's default), the sampled token's and the top k's, taken
where the logits are, in three tensors for all such rows (one copy each to the host).
"""
from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from tokenflowd.engine.grammar import apply_masks
from tokenflowd.engine.request import PLACEHOLDER, SamplingRow
from tokenflowd.engine.staging import to_device
from tokenflowd.engine.startup import describe_error

log = logging.getLogger(__name__)


class Logprobs(NamedTuple):
    """The logprobs of one step's rows that ask for them, on the logits' device."""

    rows: list[int]  # indices among the step's sampling rows
    ks: list[int]  # each row's top count
    chosen: torch.Tensor  # [L] the sampled token's logprob
    top_ids: torch.Tensor  # [L, K] K = max(ks), most likely first
    top_logprobs: torch.Tensor  # [L, K]


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self.generator = torch.Generator().manual_seed(seed)  # the rows without a seed of their own
        # flashinfer's sampling kernel for unseeded rows on a GPU: None until tried, then whether it runs
        self.fused: bool | None = None
        self.num_fused_draws = 0  # rows it drew (tests read it)

    def _shared(self, device: torch.device) -> torch.Generator:
        """The unseeded rows' generator, on the device of the logits: their [rows, vocab] draw
        happens where the logits are (on the CPU it was ~1 s a step at batch 256, vocab 128k)."""
        if self.generator.device != device:
            self.generator = torch.Generator(device=device).manual_seed(self.seed)
        return self.generator

    def __call__(self, logits: torch.Tensor, reqs: list[SamplingRow]) -> list[int]:
        return self.sample(logits, reqs).tolist()

    def sample(self, logits: torch.Tensor, reqs: list[SamplingRow], prev: torch.Tensor | None = None,
               pending: list[int] | None = None) -> torch.Tensor:
        """The token ids [N] drawn, where the logits are (a step that overlaps the next reads them there).
        `prev`: the ids the step launched before this one sampled; `pending[i]`: the index in it of
        row i's last output token, which its request's tokens hold as a PLACEHOLDER (-1: none)."""
        return self.sample_with_logprobs(logits, reqs, prev, pending)[0]

    def sample_with_logprobs(self, logits: torch.Tensor, reqs: list[SamplingRow], prev: torch.Tensor | None = None,
                             pending: list[int] | None = None,
                             masks: tuple[list[int], torch.Tensor] | None = None) -> tuple[torch.Tensor, Logprobs | None]:
        """`sample`, and the logprobs of the rows that ask for them (None: no row does). `masks`:
        (rows, int32 bitmask) of the rows a grammar constrains (engine/grammar.py), applied after
        the penalties."""
        lp_rows = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        lp_index = _index(lp_rows, logits.device) if lp_rows else None
        raw = logits[lp_index].log_softmax(dim=-1) if lp_rows else None  # a copy: penalties change logits
        tokens = self._draw(logits, reqs, prev, pending, masks)
        if raw is None:
            return tokens, None
        ks = [reqs[i].params.logprobs for i in lp_rows]
        chosen = raw.gather(1, tokens[lp_index][:, None])[:, 0]
        top_logprobs, top_ids = raw.topk(max(ks), dim=-1) if max(ks) else (raw[:, :0], raw[:, :0].long())
        return tokens, Logprobs(lp_rows, ks, chosen, top_ids, top_logprobs)

    def _draw(self, logits: torch.Tensor, reqs: list[SamplingRow], prev: torch.Tensor | None,
              pending: list[int] | None, masks: tuple[list[int], torch.Tensor] | None = None) -> torch.Tensor:
        # logits: [N, vocab] fp32, row i belongs to reqs[i]
        self.penalize(logits, reqs, prev, pending)
        if masks is not None:
            apply_masks(logits, *masks)
        banned_rows, banned_ids = [], []  # min_tokens: the stop tokens of rows below it
        for i, r in enumerate(reqs):
            if r.num_output_tokens < r.params.min_tokens and r.stop_token_ids:
                ids = [t for t in r.stop_token_ids if 0 <= t < logits.shape[1]]
                banned_rows += [i] * len(ids)
                banned_ids += ids
        if banned_rows:
            logits[_index(banned_rows, logits.device), _index(banned_ids, logits.device)] = float("-inf")
        greedy = [r.params.greedy for r in reqs]
        if all(greedy):
            return logits.argmax(dim=-1)
        out = logits.argmax(dim=-1)
        rows = [i for i, g in enumerate(greedy) if not g]
        if logits.is_cuda and self.fused is not False:
            # unseeded rows: temperature, top-k and top-p in flashinfer's sampling kernel (no sort
            # of the vocabulary); seeded rows draw below, from their own generators
            fused = [i for i in rows if reqs[i].generator is None]
            if fused and self._draw_fused(logits, [reqs[i] for i in fused], fused, out):
                rows = [i for i in rows if reqs[i].generator is not None]
                if not rows:
                    return out
        index = _index(rows, logits.device)
        sub = [reqs[i] for i in rows]
        probs = self._probs(logits[index], sub)
        # Exponential race (Gumbel-max in probability space): argmax p / E, E ~ Exp(1).
        dev = probs.device
        race = torch.empty(probs.shape, device=dev)
        shared = [j for j, r in enumerate(sub) if r.generator is None]
        if shared:
            race[_index(shared, dev)] = torch.empty(len(shared), probs.shape[1], device=dev).exponential_(
                generator=self._shared(dev))
        for j, r in enumerate(sub):
            if r.generator is not None:
                # drawn where the logits are, from a seed the request's own generator gives (its
                # sequence of draws, whatever shares the batch), on every device alike: no
                # vocabulary-wide draw on the CPU copied to a GPU every step
                race[j].exponential_(generator=torch.Generator(device=dev).manual_seed(self.draw_seed(r.generator)))
        out[index] = (probs / race).argmax(dim=-1)
        return out

    @staticmethod
    def draw_seed(generator: torch.Generator) -> int:
        """The seed of a seeded row's next draw, taken from its request's generator: one call per
        sampled token (a token drawn elsewhere, such as a prefill node's first, is skipped by one call)."""
        return int(torch.randint(1 << 62, (1,), generator=generator))

    def _draw_fused(self, logits: torch.Tensor, reqs: list[SamplingRow], rows: list[int], out: torch.Tensor) -> bool:
        """out[rows] drawn by flashinfer's top-k/top-p sampling from the rows' logits at their
        temperatures; False (nothing drawn, and never tried again) where flashinfer is missing or
        its kernel refuses, so the torch draw below takes them."""
        dev, vocab = logits.device, logits.shape[1]
        try:
            if self.fused is None:
                import flashinfer.sampling

                self._fi_sampling = flashinfer.sampling
            index = _index(rows, dev)
            per_row = to_device([v for r in reqs for v in (r.params.temperature, r.params.top_p)], torch.float32,
                                dev).view(len(rows), 2)
            top_k = to_device([r.params.top_k or vocab for r in reqs], torch.int32, dev)
            drawn = self._fi_sampling.top_k_top_p_sampling_from_logits(
                logits[index] / per_row[:, 0:1], top_k, per_row[:, 1].contiguous(), filter_apply_order="top_k_first",
                generator=self._shared(dev))
        except Exception as e:  # noqa: BLE001 - an import, an API or a build that is not there: the torch draw
            log.warning("flashinfer's sampling is not used (%s); rows are drawn by torch", describe_error(e))
            self.fused = False
            return False
        self.fused = True
        out[index] = drawn.to(out.dtype)
        self.num_fused_draws += len(rows)
        return True

    @staticmethod
    def penalize(logits: torch.Tensor, reqs: list[SamplingRow], prev: torch.Tensor | None = None,
                 pending: list[int] | None = None) -> None:
        """Apply the rows' penalties to `logits` in place (rows without any cost a look at their row)."""
        rows = [i for i, r in enumerate(reqs) if r.tokens is not None and r.params.penalized]
        if not rows:
            return
        dev, vocab = logits.device, logits.shape[1]
        at, ids, seen_at, seen_ids = [], [], [], []  # output tokens; and prompt tokens (repetition only)
        for j, i in enumerate(rows):
            r = reqs[i]
            out = [t for t in r.tokens[r.num_prompt_tokens:] if t != PLACEHOLDER and 0 <= t < vocab]
            at += [j] * len(out)
            ids += out
            if r.params.repetition_penalty != 1.0:
                prompt = [t for t in (*r.foreign, *r.tokens[: r.num_prompt_tokens]) if 0 <= t < vocab]
                seen_at += [j] * len(prompt)
                seen_ids += prompt
        counts = torch.zeros(len(rows), vocab, device=dev)
        if ids:
            counts.index_put_((_index(at, dev), _index(ids, dev)), torch.ones(len(ids), device=dev), accumulate=True)
        late = [(j, pending[i]) for j, i in enumerate(rows) if pending is not None and pending[i] >= 0]
        if late and prev is not None:  # sampled by the step in flight: on the device only
            where = _index([k for _, k in late], prev.device)
            counts.index_put_((_index([j for j, _ in late], dev), prev[where].to(dev)),
                              torch.ones(len(late), device=dev), accumulate=True)
        index = _index(rows, dev)
        sub = logits[index]
        params = [reqs[i].params for i in rows]
        # the three penalties of each row, in one staged copy
        per_row = to_device([v for p in params for v in (p.repetition_penalty, p.frequency_penalty, p.presence_penalty)],
                            torch.float32, dev).view(len(rows), 3)
        rep, freq, pres = per_row[:, 0:1], per_row[:, 1:2], per_row[:, 2:3]
        if any(p.repetition_penalty != 1.0 for p in params):
            seen = counts > 0
            if seen_ids:
                seen[_index(seen_at, dev), _index(seen_ids, dev)] = True
            sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
        logits[index] = sub - freq * counts - pres * (counts > 0)

    @staticmethod
    def _probs(logits: torch.Tensor, reqs: list[SamplingRow]) -> torch.Tensor:
        # logits: [M, vocab] -> probabilities after temperature, top-k and top-p
        dev, vocab = logits.device, logits.shape[1]
        top_k = [r.params.top_k for r in reqs]
        top_p = [r.params.top_p for r in reqs]
        # each row's temperature, top-k and top-p, in one staged copy
        per_row = to_device([v for r, kk, pp in zip(reqs, top_k, top_p) for v in (r.params.temperature, kk or vocab, pp)],
                            torch.float32, dev).view(len(reqs), 3)
        logits = logits / per_row[:, 0:1]
        if any(top_k) or any(p < 1.0 for p in top_p):
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            k = per_row[:, 1]
            rank = torch.arange(vocab, device=dev)[None, :]
            sorted_logits = sorted_logits.masked_fill(rank >= k[:, None], float("-inf"))
            sorted_probs = sorted_logits.softmax(dim=-1)
            # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
            before = sorted_probs.cumsum(dim=-1) - sorted_probs
            p = per_row[:, 2]
            # Rows with top_p = 1 keep everything: fp32 cumsum saturates below 1 over a large vocab.
            drop = (before >= p[:, None]) & (p[:, None] < 1.0)
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            logits = torch.full_like(logits, float("-inf")).scatter_(1, order, sorted_logits)
        return logits.softmax(dim=-1)


def _index(values: list[int], device: torch.device) -> torch.Tensor:
    """Row or token indices as an int64 tensor on `device`, staged (engine/staging.py): indexing a
    CUDA tensor with a Python list copies the list from pageable memory."""
    return to_device(values, torch.int64, device)
