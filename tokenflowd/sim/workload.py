"""Workloads as plain data: who arrives when, with how long a prompt and response, reading how fast.

Shared by the simulator and the load generator, so it knows nothing of either. Everything is drawn
from numpy Generators seeded by `WorkloadSpec.seed` (one independent stream each for arrivals,
lengths and reading rates, so changing one leaves the others as they were): the same spec gives
the same requests, bit for bit.

Arrival processes (`WorkloadSpec.arrival`):
    burst              every request at t = 0 (TokenFlow Table 1, "burst b"), or spread uniformly
                       over [0, burst_spread] s; requests at one instant reach the engine in
                       workload order, and the engine keeps that order (its arrival sequence)
    poisson            exponential gaps of mean 1/rate; the first request at t = 0
    gamma              gamma gaps of mean 1/rate and shape k = burstiness (the meaning of
                       `vllm bench serve --burstiness`: k = 1 is Poisson, k < 1 burstier, k > 1 steadier)
    trace              replay of the Mooncake conversation trace (timestamps in ms, `time_scale` × them)

Prompts are sequences of blocks of BLOCK_TOKENS tokens named by integer ids (`hash_ids`, the
trace's prefix-block hashes); a block's tokens are a function of its id alone. So two requests with
equal `hash_ids[:k]` share their first k·512 tokens exactly, and the engine's prefix cache hits on
them. Synthetic workloads give every request fresh ids (no sharing) unless they have a context
shape (`CONTEXT_SHAPES`, TokenLake's kind of workload): then requests share long contexts.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

BLOCK_TOKENS = 512  # tokens per prefix block of the Mooncake trace (its README)
DEFAULT_TRACE = Path("/work/shared/data/mooncake/conversation_trace.jsonl")
ARRIVALS = ("burst", "poisson", "gamma", "trace")


@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    request_id: str
    arrival_time: float  # s since the workload's start
    prompt_len: int  # tokens
    output_len: int  # tokens the response has (the simulator ends the request there)
    reading_rate: float  # tokens/s its client reads
    hash_ids: tuple[int, ...]  # the prompt's blocks, ceil(prompt_len / block_tokens) of them
    # the max_tokens its client sets (None: none, as most chat clients): a loose bound, never the
    # answer's length; the engine learns lengths from finished requests, as a real one must
    max_tokens: int | None = None
    priority: int = 0  # higher is sooner (an operator-allowed client's request priority)
    block_tokens: int = BLOCK_TOKENS  # tokens per block of hash_ids (a trace scaled down: fewer)


@dataclass(frozen=True)
class LengthDist:
    """Prompt and output lengths (tokens), each drawn independently and clamped to >= 1.

    normal:    center = mean, spread = standard deviation
    lognormal: center = median, spread = σ of the log (mean = median · e^(σ²/2))
    fixed:     center = the length, spread = 0
    """

    kind: str
    input_center: float
    input_spread: float
    output_center: float
    output_spread: float

    def __post_init__(self) -> None:
        if self.kind not in ("normal", "lognormal", "fixed"):
            raise ValueError(f"length distribution must be normal, lognormal or fixed, got {self.kind!r}")
        if not (self.input_center >= 1 and self.output_center >= 1):
            raise ValueError("mean (or median) prompt and output lengths must be >= 1 token")
        if self.input_spread < 0 or self.output_spread < 0:
            raise ValueError("length spreads must be >= 0")

    def sample(self, rng: np.random.Generator, n: int, output_scale: float = 1.0) -> tuple[list[int], list[int]]:
        """n (prompt_len, output_len) pairs; outputs scaled by `output_scale` (H200 runs: 2)."""
        inputs = self._draw(rng, n, self.input_center, self.input_spread)
        outputs = self._draw(rng, n, self.output_center * output_scale,
                             self.output_spread * (output_scale if self.kind == "normal" else 1.0))
        return inputs, outputs

    def _draw(self, rng: np.random.Generator, n: int, center: float, spread: float) -> list[int]:
        if self.kind == "normal":
            x = rng.normal(center, spread, n)
        elif self.kind == "lognormal":
            x = rng.lognormal(math.log(center), spread, n)
        else:
            x = np.full(n, center)
        return [max(1, int(v)) for v in np.rint(x)]


# TokenFlow §7.3 / Table 1: inputs ~512 (S) / ~1024 (L), outputs ~1024 / ~2048, "normally
# distributed" with no spread given. We take σ = mean / 4: 95% of lengths within ±50% of the mean,
# and the clamp at 1 token (4σ away) never shifts the mean.
# ShareGPT-like: log-normal with median prompt 128 (σ 1.0, mean ≈ 211) and median output 256
# (σ 0.8, mean ≈ 353); long right tails like ShareGPT's, chosen by eye, not fitted.
LENGTH_PRESETS = {
    "SL": LengthDist("normal", 512, 128, 1024, 256),
    "LL": LengthDist("normal", 1024, 256, 2048, 512),
    "sharegpt": LengthDist("lognormal", 128, 1.0, 256, 0.8),
}


@dataclass(frozen=True)
class ContextShape:
    """Requests that share long contexts: TokenLake's evaluation (§7) samples LooGLE, SCBench and
    ShareGPT behind o3's system prompt at Poisson arrivals. The datasets are not fetched, so these
    are synthetic, with the shapes the paper publishes (a 24K-token mean sequence for LooGLE; 227K
    and 5 turns for SCBench; ShareGPT under 2.4K tokens) and the rest assumed, as marked.

    documents       a request is a question over one document: the document, then its question
    sessions        a request is a turn of a session: its first context, then every earlier turn
                    (question and answer), then its question; the next turn shares all of it
    system-prompt   a request is a short chat behind the one system prompt every request carries

    Contexts are whole blocks. `active` contexts are in play at once, each request picks one of
    them at random, and a context leaves when its `uses` are spent (a fresh one takes its place):
    the working set is about `active` contexts, which is what decides whether one engine's cache
    holds it (TokenLake's gains need a working set larger than one engine's cache that fits in
    the node's). `scale` multiplies the context lengths (a small model's context, a CPU's cache).
    """

    kind: str
    context_tokens: float  # mean tokens of a context (lognormal of σ context_sigma; 0: fixed)
    context_sigma: float
    uses: float  # mean requests per context (Poisson around it, at least 1); system-prompt: unused
    # the request's own part (question, turn, user prompt) and its answer
    query: LengthDist
    active: int = 16
    scale: float = 1.0
    # popularity: the k-th of the active contexts is picked with weight 1 / (k + 1)^skew (Zipf; 0:
    # uniform). A context that leaves hands its rank to the one that takes its place.
    skew: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ("documents", "sessions", "system-prompt"):
            raise ValueError(f"context shape must be documents, sessions or system-prompt, got {self.kind!r}")
        if not (self.context_tokens * self.scale >= 1 and self.context_sigma >= 0 and self.uses >= 1
                and self.active >= 1 and self.skew >= 0):
            raise ValueError("a context shape needs a context of at least one token, uses >= 1, active >= 1 and "
                             "skew >= 0")

    def with_(self, **kw) -> "ContextShape":
        return replace(self, **kw)


# The datasets' published shapes (TokenLake §7), the rest assumed: LooGLE's documents take about 8
# questions each (its long-dependency QA: some 6,400 questions over some 780 documents), questions
# of ~48 tokens and short answers; SCBench's sessions a 227K-token mean first context and 5 turns
# on average (1 + Poisson(4)), turns of ~64 tokens and ~256-token answers; o3's system prompt taken
# as 2,048 tokens (the paper gives no length) before ShareGPT-like chats kept under 2.4K tokens.
CONTEXT_SHAPES = {
    "documents": ContextShape("documents", 24_000, 0.5, 8, LengthDist("lognormal", 48, 0.5, 96, 0.7)),
    "sessions": ContextShape("sessions", 227_000, 0.4, 5, LengthDist("lognormal", 64, 0.5, 256, 0.6), active=8),
    "system-prompt": ContextShape("system-prompt", 2_048, 0.0, 1, LengthDist("lognormal", 128, 0.9, 200, 0.7),
                                  active=1),
}
CHAT_LIMIT = 2_400  # system-prompt: a ShareGPT chat's prompt and answer stay under this (§7)


def parse_context_shape(spec: str) -> ContextShape:
    """documents | sessions | system-prompt, with :KEY=VALUE overrides of context_tokens,
    uses, active, scale or skew (documents:active=32:scale=0.5)."""
    name, *overrides = spec.split(":")
    if name not in CONTEXT_SHAPES:
        raise ValueError(f"context shape {spec!r}: use one of {', '.join(CONTEXT_SHAPES)} with :KEY=VALUE overrides")
    kw: dict = {}
    for o in overrides:
        key, _, value = o.partition("=")
        if key not in ("context_tokens", "uses", "active", "scale", "skew") or not value:
            raise ValueError(f"context shape {spec!r}: {o!r} is not context_tokens=, uses=, active=, scale= or skew=")
        try:
            kw[key] = int(value) if key == "active" else float(value)
        except ValueError:
            raise ValueError(f"context shape {spec!r}: {o!r} is not a number") from None
    return CONTEXT_SHAPES[name].with_(**kw)


def parse_lengths(spec: str) -> LengthDist:
    """SL | LL | sharegpt | normal:IN:IN_SD:OUT:OUT_SD | lognormal:IN_MEDIAN:IN_SIGMA:OUT_MEDIAN:OUT_SIGMA | fixed:IN:OUT"""
    if spec in LENGTH_PRESETS:
        return LENGTH_PRESETS[spec]
    kind, _, rest = spec.partition(":")
    try:
        nums = [float(x) for x in rest.split(":")] if rest else []
    except ValueError:
        nums = []
    if kind == "fixed" and len(nums) == 2:
        return LengthDist("fixed", nums[0], 0.0, nums[1], 0.0)
    if kind in ("normal", "lognormal") and len(nums) == 4:
        return LengthDist(kind, *nums)
    raise ValueError(f"cannot parse lengths {spec!r}: use SL, LL, sharegpt, normal:IN:IN_SD:OUT:OUT_SD, "
                     f"lognormal:IN_MEDIAN:IN_SIGMA:OUT_MEDIAN:OUT_SIGMA or fixed:IN:OUT")


def parse_reading_rates(spec: str) -> tuple[tuple[float, float], ...]:
    """'20' (everyone at 20 tokens/s) or 'RATE:FRACTION,...' such as '15:0.4,20:0.6'."""
    out = []
    try:
        for part in spec.split(","):
            rate, _, frac = part.partition(":")
            out.append((float(rate), float(frac) if frac else 1.0))
    except ValueError:
        raise ValueError(f"cannot parse reading rates {spec!r}: use a rate such as 20 or a mix such as 15:0.4,20:0.6") from None
    if any(not 0 < r < math.inf for r, _ in out) or any(f <= 0 for _, f in out):
        raise ValueError(f"reading rates {spec!r}: rates must be finite and above 0, fractions above 0")
    total = sum(f for _, f in out)
    if abs(total - 1.0) > 1e-6:
        raise ValueError(f"reading rate fractions in {spec!r} add up to {total:g}, not 1")
    return tuple(out)


@dataclass(frozen=True)
class WorkloadSpec:
    arrival: str = "burst"
    num_requests: int | None = 100  # None: the whole trace (synthetic arrivals need a number)
    rate: float | None = None  # requests/s (poisson, gamma)
    burstiness: float = 1.0  # gamma shape k
    lengths: LengthDist = field(default_factory=lambda: LENGTH_PRESETS["SL"])
    output_scale: float = 1.0  # multiplies output lengths (TokenFlow's H200 runs: 2)
    reading_rates: tuple[tuple[float, float], ...] = ((20.0, 1.0),)  # (tokens/s, fraction of requests)
    seed: int = 0
    trace: str | None = None  # Mooncake trace file (arrival "trace"); None: DEFAULT_TRACE if it exists
    time_scale: float = 1.0  # trace: arrival = timestamp · time_scale (below 1 replays faster)
    max_prompt_len: int | None = None  # trace: truncate longer prompts (their block ids with them); contexts: cut
    # trace: tokens per block of the trace's prefix hashes (512); fewer scale every prompt down by
    # block_tokens / 512 and keep which blocks requests share (a small model on a CPU); contexts:
    # the block their shared contexts are whole numbers of
    block_tokens: int = BLOCK_TOKENS
    burst_spread: float = 0.0  # burst: arrivals uniform over [0, burst_spread] s (0: all at t = 0)
    # the share of requests whose client sets max_tokens = max_tokens_bound (where the answer fits
    # in it); the others set none
    max_tokens_share: float = 0.0
    max_tokens_bound: int = 4096
    # synthetic arrivals: requests share long contexts of this shape (lengths then unused); None: none
    contexts: ContextShape | None = None

    def __post_init__(self) -> None:
        if self.arrival not in ARRIVALS:
            raise ValueError(f"arrival must be one of {', '.join(ARRIVALS)}, got {self.arrival!r}")
        if self.num_requests is None and self.arrival != "trace":
            raise ValueError(f"a {self.arrival} workload needs a number of requests")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if self.arrival in ("poisson", "gamma") and not (self.rate is not None and 0 < self.rate < math.inf):
            raise ValueError(f"a {self.arrival} workload needs a request rate above 0 (requests/s)")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness (gamma shape) must be above 0, got {self.burstiness}")
        if not self.output_scale > 0 or not self.time_scale > 0:
            raise ValueError("output_scale and time_scale must be above 0")
        if self.max_prompt_len is not None and self.max_prompt_len < 1:
            raise ValueError("max_prompt_len must be >= 1")
        if not 1 <= self.block_tokens <= BLOCK_TOKENS:
            raise ValueError(f"block_tokens must be in [1, {BLOCK_TOKENS}], got {self.block_tokens}")
        if not self.reading_rates or abs(sum(f for _, f in self.reading_rates) - 1.0) > 1e-6:
            raise ValueError("reading rate fractions must add up to 1")
        if not self.burst_spread >= 0:
            raise ValueError(f"burst_spread must be >= 0 s, got {self.burst_spread}")
        if not 0.0 <= self.max_tokens_share <= 1.0:
            raise ValueError(f"max_tokens_share must be in [0, 1], got {self.max_tokens_share}")
        if self.max_tokens_bound < 1:
            raise ValueError(f"max_tokens_bound must be >= 1, got {self.max_tokens_bound}")
        if self.contexts is not None and self.arrival == "trace":
            raise ValueError("a trace brings its own prefixes: a context shape is for synthetic arrivals")

    @classmethod
    def parse(cls, arrival: str, **kw) -> "WorkloadSpec":
        """From a compact arrival spec: burst[:N] | poisson:RATE | gamma:RATE:SHAPE | trace[:PATH].
        A count in the spec (burst:400) sets num_requests; keywords give the rest."""
        kind, _, rest = arrival.partition(":")
        args = rest.split(":") if rest else []
        try:
            if kind == "burst" and len(args) <= 1:
                if args:
                    kw["num_requests"] = int(args[0])
            elif kind == "poisson" and len(args) == 1:
                kw["rate"] = float(args[0])
            elif kind == "gamma" and len(args) == 2:
                kw["rate"], kw["burstiness"] = float(args[0]), float(args[1])
            elif kind == "trace":
                if rest:
                    kw["trace"] = rest
            else:
                raise ValueError
        except ValueError:
            raise ValueError(f"cannot parse workload {arrival!r}: use burst[:N], poisson:RATE, gamma:RATE:SHAPE "
                             f"or trace[:PATH]") from None
        return cls(arrival=kind, **kw)


# -- building ---------------------------------------------------------------------------------
def arrival_times(kind: str, n: int, rate: float | None, burstiness: float, rng: np.random.Generator,
                  burst_spread: float = 0.0) -> list[float]:
    """n non-decreasing arrival times (s), the first at 0."""
    if kind == "burst":
        if burst_spread <= 0:
            return [0.0] * n
        return [0.0] + np.sort(rng.uniform(0.0, burst_spread, n - 1)).tolist()
    if kind == "poisson":
        gaps = rng.exponential(1.0 / rate, n - 1)
    elif kind == "gamma":
        gaps = rng.gamma(burstiness, 1.0 / (rate * burstiness), n - 1)
    else:
        raise ValueError(f"no synthetic arrivals of kind {kind!r}")
    return [0.0] + np.cumsum(gaps).tolist()


def assign_reading_rates(rates: tuple[tuple[float, float], ...], n: int, rng: np.random.Generator) -> list[float]:
    """Exactly round(fraction · n) requests per rate (largest remainder), in a seeded random order."""
    quotas = [f * n for _, f in rates]
    counts = [int(q) for q in quotas]
    by_remainder = sorted(range(len(rates)), key=lambda i: (-(quotas[i] - counts[i]), i))
    for i in by_remainder[: n - sum(counts)]:
        counts[i] += 1
    out = [rate for (rate, _), c in zip(rates, counts) for _ in range(c)]
    return [out[i] for i in rng.permutation(n)]


def resolve_trace_path(trace: str | None) -> Path:
    path = Path(trace) if trace else DEFAULT_TRACE
    if not path.is_file():
        raise ValueError(f"Mooncake trace {path} not found: pass --trace PATH to conversation_trace.jsonl")
    return path


def read_trace(path: Path, limit: int | None) -> list[dict]:
    """The first `limit` records of a Mooncake trace (JSON lines: timestamp, input_length, output_length, hash_ids)."""
    rows = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if limit is not None and len(rows) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                rows.append((float(row["timestamp"]), int(row["input_length"]), int(row["output_length"]),
                             tuple(int(h) for h in row["hash_ids"])))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{line_no}: not a Mooncake trace record ({e})") from None
    rows.sort(key=lambda r: r[0])  # stable: records of one timestamp keep the file's order
    return [dict(zip(("timestamp", "input_length", "output_length", "hash_ids"), r)) for r in rows]


def build_workload(spec: WorkloadSpec) -> list[WorkloadRequest]:
    """The requests of `spec`, in arrival order."""
    # spawn(k)'s first children do not depend on k: a stream added later leaves the others as they were
    arrivals_rng, lengths_rng, rates_rng, bounds_rng = (np.random.default_rng(s)
                                                        for s in np.random.SeedSequence(spec.seed).spawn(4))
    if spec.arrival == "trace":
        rows = read_trace(resolve_trace_path(spec.trace), spec.num_requests)
        if not rows:
            raise ValueError("the trace has no records")
        t0 = rows[0]["timestamp"]
        arrivals = [(r["timestamp"] - t0) / 1000.0 * spec.time_scale for r in rows]
        bt = spec.block_tokens
        scaled = [max(1, math.ceil(r["input_length"] * bt / BLOCK_TOKENS)) for r in rows]
        prompts = [min(n, spec.max_prompt_len or n) for n in scaled]
        outputs = [max(1, round(r["output_length"] * spec.output_scale)) for r in rows]
        blocks = [r["hash_ids"][: math.ceil(p / bt)] for r, p in zip(rows, prompts)]
        if any(len(b) * bt < p for b, p in zip(blocks, prompts)):
            raise ValueError("a trace record has fewer hash_ids than its input_length needs")
    else:
        n = spec.num_requests
        arrivals = arrival_times(spec.arrival, n, spec.rate, spec.burstiness, arrivals_rng, spec.burst_spread)
        if spec.contexts is not None:
            prompts, outputs, blocks = shared_contexts(spec.contexts, n, lengths_rng, spec.seed, spec.output_scale,
                                                       spec.block_tokens, spec.max_prompt_len)
        else:
            prompts, outputs = spec.lengths.sample(lengths_rng, n, spec.output_scale)
            # fresh block ids per request, so no prefix is shared; numbered from the seed, so that
            # two seeds send different prompts
            blocks, next_id = [], spec.seed << 32
            for p in prompts:
                k = math.ceil(p / BLOCK_TOKENS)
                blocks.append(tuple(range(next_id, next_id + k)))
                next_id += k
    n = len(arrivals)
    rates = assign_reading_rates(spec.reading_rates, n, rates_rng)
    bounded = bounds_rng.random(n) < spec.max_tokens_share
    bounds = [spec.max_tokens_bound if b and out <= spec.max_tokens_bound else None for b, out in zip(bounded, outputs)]
    width = len(str(n - 1))
    bt = spec.block_tokens if spec.arrival == "trace" or spec.contexts is not None else BLOCK_TOKENS
    return [WorkloadRequest(f"r{i:0{width}d}", arrivals[i], prompts[i], outputs[i], rates[i], blocks[i], bounds[i],
                            block_tokens=bt) for i in range(n)]


def shared_contexts(shape: ContextShape, n: int, rng: np.random.Generator, seed: int, output_scale: float = 1.0,
                    block_tokens: int = BLOCK_TOKENS, max_prompt_len: int | None = None
                    ) -> tuple[list[int], list[int], list[tuple[int, ...]]]:
    """n requests of `shape` in arrival order: (prompt lengths, output lengths, block ids of
    `block_tokens` tokens). Block ids are numbered from the seed; a context's blocks, and a
    session's earlier turns, are shared by the requests that use them. `max_prompt_len`: a longer
    context is cut to it (less a question's room), and a session whose next turn would not fit
    ends; a question is cut to fit."""
    ids = iter(range(seed << 32, (seed + 1) << 32))
    bt = block_tokens
    room = math.inf if max_prompt_len is None else max(1, (max_prompt_len - 1) // bt - 1)  # context blocks

    def fresh(tokens: int) -> tuple[int, ...]:
        return tuple(next(ids) for _ in range(math.ceil(tokens / bt)))

    def context() -> list:  # [blocks so far, uses left]
        mean = shape.context_tokens * shape.scale
        tokens = mean if shape.context_sigma == 0 else \
            rng.lognormal(math.log(mean) - shape.context_sigma ** 2 / 2, shape.context_sigma)
        uses = 1 << 62 if shape.kind == "system-prompt" else 1 + int(rng.poisson(shape.uses - 1))
        return [fresh(min(room, max(1, round(tokens / bt))) * bt), uses]

    queries, outputs = shape.query.sample(rng, n, output_scale)
    active = [context() for _ in range(shape.active)]
    weights = 1.0 / np.arange(1, shape.active + 1) ** shape.skew
    picks = rng.choice(shape.active, size=n, p=weights / weights.sum()).tolist() if shape.skew else None
    prompts, blocks = [], []
    for i, (q, out) in enumerate(zip(queries, outputs)):
        k = picks[i] if picks is not None else int(rng.integers(len(active)))
        ctx = active[k]
        if shape.kind == "sessions" and len(ctx[0]) + math.ceil((q + out) / bt) > room:
            ctx = active[k] = context()  # the session's context is full: a new session
        if max_prompt_len is not None:
            q = max(1, min(q, max_prompt_len - len(ctx[0]) * bt))
        if shape.kind == "system-prompt":  # a ShareGPT chat stays under CHAT_LIMIT
            q = min(q, CHAT_LIMIT // 2)
            outputs[len(prompts)] = out = min(out, CHAT_LIMIT - q)
        if shape.kind == "sessions":  # the turn (question and answer) joins the session's context
            turn = fresh(q + out)
            prompts.append(len(ctx[0]) * bt + q)
            blocks.append(ctx[0] + turn[: math.ceil(q / bt)])
            ctx[0] += turn
        else:
            prompts.append(len(ctx[0]) * bt + q)
            blocks.append(ctx[0] + fresh(q))
        ctx[1] -= 1
        if ctx[1] == 0:
            active[k] = context()
    return prompts, outputs, blocks


def prompt_token_ids(req: WorkloadRequest, vocab_size: int) -> list[int]:
    """The prompt's token ids in [0, vocab_size): block j is the first tokens of the sequence its
    id seeds, so equal ids at equal positions give equal tokens."""
    out: list[int] = []
    bt = req.block_tokens
    for j, block in enumerate(req.hash_ids):
        n = min(bt, req.prompt_len - j * bt)
        out.extend(np.random.default_rng(block).integers(0, vocab_size, bt)[:n].tolist())
    return out
