"""A disaggregated cluster on a virtual clock: N prefill nodes, M decode nodes and the conductor in
front of them, the Mooncake trace replayed, to compare early-rejection policies (Mooncake §7, §8.2).

    arrival ──► conductor: place() (federation/placement.py, Algorithm 1) picks the prefill node of
                least predicted TTFT (queue + prefill of the uncached tokens, or a fetch of a longer
                prefix from another prefill node first) and the decode node of least predicted TBT,
                and rejects when the TTFT breaks its SLO; then the gate (federation/rejection.py:
                off | current | predicted | survival) may refuse it before any prefill is spent
       │ accepted
       ▼
    prefill node: FIFO, one request at a time, its uncached tokens in chunks of the cost model's
                max_num_batched_tokens (each chunk attends to everything before it); the first token
                comes out at the end. An LRU cache of the trace's 512-token prefix blocks; a request's
                blocks are inserted when its prefill ends.
       │ KV: prompt tokens × kv_bytes_per_token / link_bandwidth
       ▼
    decode node: continuous batching of at most decode_batch requests; a step's time is the cost
                model's roofline at the batch's size and contexts; a request leaves after its output
                length. One that arrives to a full batch is rejected there, its prefill wasted (a
                "late" rejection, what early rejection is for).

The conductor knows what a real one knows: the prefill queues (sums of predicted prefill times;
here exact), each node's cached prefix, the requests it sent each decode node, and the decode pool's
starts and ends (DecodeLoad). It never sees output lengths. place() is called with an infinite TBT
SLO: the decode side is the gate's to judge, so that `off` is the paper's baseline (each stage checks
only its own load, when the request reaches it).

What is not modelled: chunked pipeline parallelism across prefill nodes, decode-node KV memory per
token (a node's batch is full at decode_batch requests, sized for the workload's mean request, so a
batch of long requests may hold more KV than the card has), prefill batching across requests, and
prefix caching on decode nodes. Matched prefix blocks are taken as held from placement to prefill.
"""
from __future__ import annotations

import heapq
import math
import statistics
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Sequence

from tokenflowd.federation.placement import DecodeNode, PrefillNode, Rejection, place
from tokenflowd.federation.rejection import DecodeLoad, EarlyRejection
from tokenflowd.sim.cost import CostModel, StepWork
from tokenflowd.sim.workload import BLOCK_TOKENS, WorkloadRequest

MODES = ("off", "current", "predicted", "survival")
# How the conductor rates a decode node for place(): `predicted`: its batch when the request would
# reach it, every decode lasting T_d (a DecodeLoad per node); `sent`: the requests it has sent there
# that have not ended, wherever they are (queued, prefilling, in transfer, decoding).
DECODE_CHOICES = ("predicted", "sent")
TIES = ("file", "reverse", "spread")
_GATES = {"current": False, "predicted": True, "survival": "survival"}


@dataclass(frozen=True)
class ClusterConfig:
    prefill_nodes: int = 8
    decode_nodes: int = 8
    rejection: str = "predicted"
    ttft_slo: float = 30.0  # s (Mooncake §8.1.3, the real-trace runs)
    tbt_slo: float = 0.1  # s
    link_bandwidth: float = 100e9  # bytes/s: 800 Gbps RDMA (Mooncake §8.1)
    balancing_threshold: float = 1.5  # Algorithm 1's kvcache_balancing_threshold (the conductor's default)
    decode_batch: int | None = None  # None: resolve() sizes it from the cost model and the workload
    cache_blocks: int | None = None  # per prefill node; None: the cost model's KV pool in 512-token blocks
    decode_seconds: float = 20.0  # T_d until the first decodes finish (the conductor's default)
    sample_interval: float = 1.0  # s between samples of the pools' loads
    decode_choice: str = "predicted"  # see DECODE_CHOICES

    def __post_init__(self) -> None:
        if self.rejection not in MODES:
            raise ValueError(f"rejection must be one of {', '.join(MODES)}, got {self.rejection!r}")
        if self.decode_choice not in DECODE_CHOICES:
            raise ValueError(f"decode_choice must be one of {', '.join(DECODE_CHOICES)}, got {self.decode_choice!r}")
        if self.prefill_nodes < 1 or self.decode_nodes < 1:
            raise ValueError("a cluster needs at least one prefill and one decode node")
        for name in ("ttft_slo", "tbt_slo", "link_bandwidth", "decode_seconds", "sample_interval"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be above 0, got {getattr(self, name)}")
        if self.decode_batch is not None and self.decode_batch < 1 or self.cache_blocks is not None and self.cache_blocks < 0:
            raise ValueError("decode_batch must be >= 1 and cache_blocks >= 0")

    def resolve(self, cost: CostModel, workload: Sequence[WorkloadRequest]) -> "ClusterConfig":
        """decode_batch: the most requests of the workload's mean size (prompt + output) whose KV
        fits the card and whose step at that context meets the TBT SLO (at least 1);
        cache_blocks: the card's KV pool in the trace's blocks."""
        batch, blocks = self.decode_batch, self.cache_blocks
        if batch is None:
            mean = statistics.fmean(r.prompt_len + r.output_len for r in workload)
            batch = min(cost.max_num_seqs, int(cost.max_tokens_in_pool // mean))
            while batch > 1 and cost.decode_step_time(batch, int(mean)) > self.tbt_slo:
                batch -= 1
            batch = max(1, batch)
        if blocks is None:
            blocks = cost.max_tokens_in_pool // BLOCK_TOKENS
        return replace(self, decode_batch=batch, cache_blocks=blocks)


def order_ties(workload: Sequence[WorkloadRequest], ties: str) -> list[WorkloadRequest]:
    """The trace stamps arrivals in ~3 s groups. `file`: a group's requests arrive at one instant
    in the file's order; `reverse`: in the opposite order; `spread`: evenly over the gap to the next
    group, in file order. Every mode sees the same order."""
    if ties not in TIES:
        raise ValueError(f"ties must be one of {', '.join(TIES)}, got {ties!r}")
    groups: list[list[WorkloadRequest]] = []
    for r in sorted(workload, key=lambda r: r.arrival_time):
        if groups and groups[-1][0].arrival_time == r.arrival_time:
            groups[-1].append(r)
        else:
            groups.append([r])
    out = []
    for i, g in enumerate(groups):
        if ties == "reverse":
            g = g[::-1]
        elif ties == "spread" and i + 1 < len(groups):
            gap = (groups[i + 1][0].arrival_time - g[0].arrival_time) / len(g)
            g = [replace(r, arrival_time=r.arrival_time + k * gap) for k, r in enumerate(g)]
        out += g
    return out


@dataclass(slots=True)
class ClusterRequest:
    """One request on its way through the cluster (times in virtual s)."""

    w: WorkloadRequest
    # arriving | prefilling | decoding, then rejected-ttft | rejected-early | rejected-late | finished
    outcome: str = "arriving"
    prefill: int | None = None
    decode: int | None = None
    cached_tokens: int = 0
    prefill_work: float = 0.0  # s its prefill node spent on it (a fetched prefix's transfer included)
    first_token: float | None = None  # the end of its prefill
    finish: float | None = None
    join_step: int = 0  # the decode node's step count when it joined the batch

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.w.arrival_time

    @property
    def tbt(self) -> float | None:
        """Mean time between its tokens after the first (transfer and join waits included)."""
        if self.finish is None or self.first_token is None:
            return None
        return (self.finish - self.first_token) / max(1, self.w.output_len - 1)


@dataclass
class _PrefillNode:
    capacity: int  # blocks its prefix cache holds
    cache: OrderedDict = field(default_factory=OrderedDict)  # block id -> None, least recently used first
    free_at: float = 0.0  # when the requests already queued here will have been prefilled
    in_flight: int = 0  # queued or prefilling

    def prefix_blocks(self, hash_ids: tuple[int, ...]) -> int:
        n = 0
        while n < len(hash_ids) and hash_ids[n] in self.cache:
            n += 1
        return n

    def touch(self, hash_ids: tuple[int, ...]) -> None:
        for h in hash_ids:
            self.cache[h] = None
            self.cache.move_to_end(h)
        while len(self.cache) > self.capacity:
            self.cache.popitem(last=False)


@dataclass
class _DecodeNode:
    load: DecodeLoad  # the conductor's view of this node alone
    batch: dict[str, ClusterRequest] = field(default_factory=dict)
    joining: list[ClusterRequest] = field(default_factory=list)  # arrived during a step: join the next
    ends: list = field(default_factory=list)  # heap of (step count its last token comes at, seq, request id)
    steps: int = 0
    context: int = 0  # Σ tokens of KV over the batch
    stepping: bool = False
    sent: int = 0  # requests the conductor sent here that have not ended
    sent_tokens: int = 0  # their prompts' tokens


class ClusterSim:
    def __init__(self, cost: CostModel, workload: Sequence[WorkloadRequest], config: ClusterConfig) -> None:
        if config.decode_batch is None or config.cache_blocks is None:
            config = config.resolve(cost, workload)
        self.cost, self.config = cost, config
        self.requests = [ClusterRequest(w) for w in workload]  # arrival order: ties as the caller ordered them
        self.prefill = [_PrefillNode(config.cache_blocks) for _ in range(config.prefill_nodes)]
        self.decode = [_DecodeNode(DecodeLoad(capacity=config.decode_batch, decode_seconds=config.decode_seconds))
                       for _ in range(config.decode_nodes)]
        self.load = DecodeLoad(capacity=config.decode_nodes * config.decode_batch,
                               decode_seconds=config.decode_seconds)
        self.gate = EarlyRejection(self.load, _GATES[config.rejection]) if config.rejection in _GATES else None
        self._events: list = []  # (time, kind order, seq, handler, argument)
        self._seq = 0
        self.decisions: list[bool] = []  # accepted?, per arrival
        self.decode_samples: list[int] = []
        self.prefill_samples: list[int] = []
        self.wasted_prefill = 0.0  # s of prefill spent on requests rejected late

    # -- costs ------------------------------------------------------------------------------------
    def prefill_seconds(self, prompt: int, cached: int) -> float:
        """The uncached tokens in chunks of max_num_batched_tokens; at least one token is computed."""
        t, done, chunk = 0.0, min(cached, prompt - 1), self.cost.max_num_batched_tokens
        while done < prompt:
            n = min(chunk, prompt - done)
            t += self.cost.step_time([(done, n)])
            done += n
        return t

    def decode_step_seconds(self, batch: int, context: int) -> float:
        """One decode step: each of `batch` requests computes one token over its KV (Σ `context`)."""
        c = self.cost
        attended = context + batch
        flops = 2.0 * c.num_params * batch + 4.0 * c.num_layers * c.num_heads * c.head_dim * attended
        return c.time_of(StepWork(flops, c.weight_bytes + float(c.kv_bytes_per_token) * attended))

    def transfer_seconds(self, tokens: int) -> float:
        return tokens * self.cost.kv_bytes_per_token / self.config.link_bandwidth

    # -- events -----------------------------------------------------------------------------------
    def _at(self, t: float, order: int, handler, arg) -> None:
        """Events of one instant run decode steps' ends first, then prefills' ends, KV arrivals and
        arrivals, each kind in the order it was scheduled."""
        self._seq += 1
        heapq.heappush(self._events, (t, order, self._seq, handler, arg))

    def run(self) -> "ClusterResult":
        for r in self.requests:
            self._at(r.w.arrival_time, 3, self._arrive, r)
        last_arrival = self.requests[-1].w.arrival_time if self.requests else 0.0
        next_sample = 0.0
        while self._events:
            t, _, _, handler, arg = heapq.heappop(self._events)
            while next_sample <= min(t, last_arrival):
                self.decode_samples.append(sum(len(d.batch) + len(d.joining) for d in self.decode))
                self.prefill_samples.append(sum(p.in_flight for p in self.prefill))
                next_sample += self.config.sample_interval
            handler(t, arg)
        assert self.load.current() == 0 and all(not d.batch and not d.sent for d in self.decode)
        return ClusterResult(self.config, self.requests, self.decisions, self.decode_samples, self.prefill_samples,
                             self.wasted_prefill, last_arrival)

    def _arrive(self, now: float, r: ClusterRequest) -> None:
        c, w = self.config, r.w
        bt = w.block_tokens
        matched = [p.prefix_blocks(w.hash_ids) for p in self.prefill]
        prefill = [PrefillNode(f"p{i}", min(k * bt, w.prompt_len), max(0.0, p.free_at - now), self.prefill_seconds)
                   for i, (p, k) in enumerate(zip(self.prefill, matched))]
        kw = dict(bandwidth=lambda a, b: c.link_bandwidth, kv_bytes_per_token=self.cost.kv_bytes_per_token,
                  balancing_threshold=c.balancing_threshold, ttft_slo=c.ttft_slo, tbt_slo=math.inf)
        # Pass 1 picks the prefill node (Algorithm 1 picks it apart from the decode node) and so
        # tells when the request would reach decode; pass 2 rates the decode nodes at that time.
        choice = place(w.prompt_len, prefill, [DecodeNode("d0", 0.0)], **kw)
        if isinstance(choice, Rejection):
            r.outcome = "rejected-ttft"
            self.decisions.append(False)
            return
        decode_start = now + choice.ttft_seconds + self.transfer_seconds(w.prompt_len)
        choice = place(w.prompt_len, prefill, self._rate_decode(now, decode_start, w.prompt_len), **kw)
        if self.gate is not None and not self.gate.admit(now, decode_start):
            r.outcome = "rejected-early"
            self.decisions.append(False)
            return
        self.decisions.append(True)
        r.outcome = "prefilling"
        r.prefill, r.decode = int(choice.prefill[1:]), int(choice.decode[1:])
        p, d = self.prefill[r.prefill], self.decode[r.decode]
        r.cached_tokens = prefill[r.prefill].prefix_tokens + choice.fetch_tokens
        held = math.ceil(r.cached_tokens / bt)
        p.touch(w.hash_ids[:held])
        if choice.fetch_from is not None:
            self.prefill[int(choice.fetch_from[1:])].touch(w.hash_ids[:held])
        # NOTE: place()'s TTFT is this FIFO's exact finish time: queue (free_at − now) + fetch + prefill.
        r.prefill_work = choice.ttft_seconds - prefill[r.prefill].queue_seconds
        p.free_at = now + choice.ttft_seconds
        p.in_flight += 1
        d.sent += 1
        d.sent_tokens += w.prompt_len
        self.load.accepted(w.request_id, decode_start)
        d.load.accepted(w.request_id, decode_start)
        self._at(p.free_at, 1, self._prefilled, r)

    def _rate_decode(self, now: float, decode_start: float, prompt: int) -> list[DecodeNode]:
        """Each decode node's TBT with this request in its batch, at the contexts of the requests
        sent there (their mean, times the batch expected)."""
        out = []
        for j, d in enumerate(self.decode):
            n = d.load.predicted(decode_start, now) if self.config.decode_choice == "predicted" else d.sent
            mean = d.sent_tokens / d.sent if d.sent else 0.0
            out.append(DecodeNode(f"d{j}", self.decode_step_seconds(n + 1, int(n * mean) + prompt)))
        return out

    def _prefilled(self, now: float, r: ClusterRequest) -> None:
        p = self.prefill[r.prefill]
        p.in_flight -= 1
        p.touch(r.w.hash_ids)
        r.first_token = now
        if r.w.output_len <= 1:  # the prefill's token was the whole answer
            self._end(now, r, "finished")
        else:
            self._at(now + self.transfer_seconds(r.w.prompt_len), 2, self._kv_arrived, r)

    def _kv_arrived(self, now: float, r: ClusterRequest) -> None:
        d = self.decode[r.decode]
        if len(d.batch) + len(d.joining) >= self.config.decode_batch:
            self.wasted_prefill += r.prefill_work
            self._end(now, r, "rejected-late")
            return
        r.outcome = "decoding"
        self.load.started(r.w.request_id, now)
        d.load.started(r.w.request_id, now)
        d.joining.append(r)
        if not d.stepping:
            self._step(now, r.decode)

    def _step(self, now: float, j: int) -> None:
        d = self.decode[j]
        for r in d.joining:
            r.join_step = d.steps
            d.batch[r.w.request_id] = r
            d.context += r.w.prompt_len
            self._seq += 1
            heapq.heappush(d.ends, (d.steps + r.w.output_len - 1, self._seq, r.w.request_id))
        d.joining.clear()
        d.stepping = True
        self._at(now + self.decode_step_seconds(len(d.batch), d.context), 0, self._stepped, j)

    def _stepped(self, now: float, j: int) -> None:
        d = self.decode[j]
        d.steps += 1
        d.context += len(d.batch)
        while d.ends and d.ends[0][0] <= d.steps:
            r = d.batch.pop(heapq.heappop(d.ends)[2])
            d.context -= r.w.prompt_len + d.steps - r.join_step
            self._end(now, r, "finished")
        d.stepping = False
        if d.batch or d.joining:
            self._step(now, j)

    def _end(self, now: float, r: ClusterRequest, outcome: str) -> None:
        r.outcome = outcome
        if outcome == "finished":
            r.finish = now
        d = self.decode[r.decode]
        d.sent -= 1
        d.sent_tokens -= r.w.prompt_len
        self.load.finished(r.w.request_id, now)
        d.load.finished(r.w.request_id, now)


@dataclass
class ClusterResult:
    config: ClusterConfig
    requests: list[ClusterRequest]
    decisions: list[bool]
    decode_samples: list[int]  # requests in the decode pool, each sample_interval from 0 to the last arrival
    prefill_samples: list[int]  # requests queued or prefilling
    wasted_prefill: float  # s of prefill node time spent on the late rejections
    span: float  # s from the first arrival to the last

    def summary(self) -> dict:
        c, rs = self.config, self.requests
        count = {k: sum(r.outcome == k for r in rs)
                 for k in ("rejected-ttft", "rejected-early", "rejected-late", "finished")}
        admitted = [r for r in rs if r.first_token is not None]
        ttfts = sorted(r.ttft for r in admitted)
        good = [r for r in rs if r.outcome == "finished" and r.ttft <= c.ttft_slo and r.tbt <= c.tbt_slo]
        return {
            "requests": len(rs),
            "accepted": len(admitted),
            "rejected": count["rejected-ttft"] + count["rejected-early"] + count["rejected-late"],
            "rejected_ttft": count["rejected-ttft"],  # by place(): predicted TTFT over its SLO
            "rejected_early": count["rejected-early"],  # by the gate
            "rejected_late": count["rejected-late"],  # at a full decode node, after prefill
            "finished": count["finished"],
            "goodput_requests": len(good),
            "goodput_tokens_per_s": sum(r.w.output_len for r in good) / self.span if self.span else math.nan,
            "ttft_mean": statistics.fmean(ttfts) if ttfts else math.nan,
            "ttft_p99": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] if ttfts else math.nan,
            "ttft_over_slo_20pct": sum(t > 1.2 * c.ttft_slo for t in ttfts) / len(ttfts) if ttfts else 0.0,
            "tbt_over_slo": sum(r.tbt > c.tbt_slo for r in rs if r.outcome == "finished"),
            "flips": sum(a != b for a, b in zip(self.decisions, self.decisions[1:])),
            "decode_load_mean": statistics.fmean(self.decode_samples) if self.decode_samples else 0.0,
            "decode_load_sd": statistics.pstdev(self.decode_samples) if self.decode_samples else 0.0,
            "prefill_load_sd": statistics.pstdev(self.prefill_samples) if self.prefill_samples else 0.0,
            "wasted_prefill_s": self.wasted_prefill,
            "cache_hit_rate": sum(r.cached_tokens for r in admitted) / max(1, sum(r.w.prompt_len for r in admitted)),
        }


def simulate_cluster(cost: CostModel, workload: Sequence[WorkloadRequest], modes: Sequence[str],
                     config: ClusterConfig = ClusterConfig(), ties: str = "file") -> dict[str, ClusterResult]:
    """Each mode on the same arrivals, the same resolved config but for the gate."""
    ordered = order_ties(workload, ties)
    config = config.resolve(cost, ordered)
    return {m: ClusterSim(cost, ordered, replace(config, rejection=m)).run() for m in modes}
