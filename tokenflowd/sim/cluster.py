"""A disaggregated cluster on a virtual clock: N prefill nodes, M decode nodes and the conductor in
front of them, the Mooncake trace replayed, to compare early-rejection gates (Mooncake §7, §8.2).

    arrival ──► conductor: place() (federation/conductor/placement.py, Algorithm 1) picks the prefill node of
                least predicted TTFT (its queue + the prefill of what its cache lacks, or a fetch of
                a longer prefix from another prefill node first) and the decode node of least
                predicted TBT, and rejects a TTFT over its SLO; then the gate (rejection.py's
                EarlyRejection on a DecodeLoad of the whole decode pool) may refuse the request
                before any prefill is spent: off | current | predicted | uniform | survival
       │ accepted
       ▼
    prefill node: FIFO, one request at a time, what its cache lacks in chunks of the cost model's
                max_num_batched_tokens (each chunk attends to all before it); the first token comes
                out at the end. An LRU cache of the trace's 512-token blocks, a request's blocks
                inserted when its prefill ends (fetched ones too: hot prefixes replicate by use).
       │ KV: prompt tokens × kv_bytes_per_token / link_bandwidth, after the prefill (not overlapped)
       ▼
    decode node: continuous batching of at most decode_batch requests; a step's time is the cost
                model's roofline at the batch's size and contexts; a request leaves after its output
                length. With `decode_admission = "pool"` a request whose KV is ready takes a seat on
                the node placement chose or, if that one is full, on the decode node with the most
                free seats (the conductor binds the node when the KV is ready); with "bound", only
                on the node chosen at arrival. One that finds no seat is rejected there, its prefill
                wasted: a "late" rejection, which early rejection exists to avoid.

The conductor knows what a real one knows: the prefill queues (sums of predicted prefill times,
exact here), each node's cached prefix, the requests it sent each decode node and the decode starts
and ends (DecodeLoad); never an output length. place() gets an infinite TBT SLO: the decode pool is
the gate's to judge, so that `off` is the paper's baseline (each stage checks its own load when the
request reaches it). A decode node is rated for place() by its batch when the request would reach
it (`predicted`, a DecodeLoad per node: placement.py's "predicted TBT when the request reaches it")
or by the requests sent there that have not ended (`sent`).

Not modelled: chunked pipeline parallelism across prefill nodes, prefill batching, decode-node KV
memory per token (a batch is full at decode_batch requests, sized for the workload's mean request,
so a batch of long ones may hold more KV than the card has), prefix caching on decode nodes. A
request's matched blocks are taken as held from its placement to its prefill.

NOTE: on a100-llama2-7b a decode node holds ~9 trace requests and is chosen a prefill queue ahead
(~17 s at 2x), so with "bound" nearly every late rejection is one full node while others have room:
no gate on the pool's load sees those (`rejected_late_with_room`; bench/results/cluster_sim_2x.json).

Oscillation (Mooncake Fig. 9, 10) is the swing of the pools' loads: `decode_load_sd` and
`prefill_load_sd`, and `phase_flips`, how often the majority decision of a flip_window flips between
accepting and refusing. `flips` counts every change between consecutive decisions, so a gate that
meters requests near its threshold (accept, refuse, accept) scores high on it without any swing.
"""
from __future__ import annotations

import heapq
import math
import statistics
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Sequence

from tokenflowd.federation.conductor.placement import DecodeNode, PrefillNode, Rejection, place
from tokenflowd.federation.conductor.rejection import GATES, DecodeLoad, EarlyRejection
from tokenflowd.sim.cost import CostModel, StepWork
from tokenflowd.sim.workload import BLOCK_TOKENS, WorkloadRequest

MODES = ("off",) + GATES
DECODE_CHOICES = ("predicted", "sent")
DECODE_ADMISSIONS = ("pool", "bound")
TIES = ("file", "reverse", "spread")


@dataclass(frozen=True)
class ClusterConfig:
    prefill_nodes: int = 8
    decode_nodes: int = 8
    rejection: str = "predicted"  # one of MODES
    ttft_slo: float = 30.0  # s (Mooncake §8.1.3, its runs on the real trace)
    tbt_slo: float = 0.1  # s
    link_bandwidth: float = 100e9  # bytes/s: 800 Gbps RDMA (Mooncake §8.1's testbed)
    balancing_threshold: float = 1.5  # Algorithm 1's kvcache_balancing_threshold (the conductor's default)
    decode_batch: int | None = None  # None: resolve() sizes it
    cache_blocks: int | None = None  # per prefill node; None: resolve() sizes it
    decode_seconds: float = 20.0  # T_d until decodes have finished (the conductor's default)
    decode_choice: str = "predicted"  # one of DECODE_CHOICES
    decode_admission: str = "pool"  # one of DECODE_ADMISSIONS
    sample_interval: float = 1.0  # s between samples of the pools' loads
    flip_window: float = 10.0  # s: phase_flips counts flips of each window's majority decision

    def __post_init__(self) -> None:
        for name, allowed in (("rejection", MODES), ("decode_choice", DECODE_CHOICES),
                              ("decode_admission", DECODE_ADMISSIONS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        if self.prefill_nodes < 1 or self.decode_nodes < 1:
            raise ValueError("a cluster needs at least one prefill and one decode node")
        for name in ("ttft_slo", "tbt_slo", "link_bandwidth", "decode_seconds", "sample_interval", "flip_window"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be above 0, got {getattr(self, name)}")
        if (self.decode_batch or 1) < 1 or (self.cache_blocks or 0) < 0:
            raise ValueError("decode_batch must be >= 1 and cache_blocks >= 0")

    def resolve(self, cost: CostModel, workload: Sequence[WorkloadRequest]) -> "ClusterConfig":
        """decode_batch: the most requests of the workload's mean size (prompt + output) whose KV
        fits the card's pool and whose step at that context meets the TBT SLO (at least 1);
        cache_blocks: the card's KV pool in 512-token blocks."""
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
    """The trace stamps arrivals in groups ~3 s apart (up to 28 at one stamp), so their order within
    a group decides who finds room. `file`: a group arrives at one instant in the file's order;
    `reverse`: in the opposite order; `spread`: evenly over the gap to the next group, in file order."""
    if ties not in TIES:
        raise ValueError(f"ties must be one of {', '.join(TIES)}, got {ties!r}")
    groups: list[list[WorkloadRequest]] = []
    for r in sorted(workload, key=lambda r: r.arrival_time):  # stable: the file's order within a stamp
        if groups and groups[-1][0].arrival_time == r.arrival_time:
            groups[-1].append(r)
        else:
            groups.append([r])
    out: list[WorkloadRequest] = []
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
    # arriving | prefilling | decoding, then one of rejected-ttft | rejected-early | rejected-late | finished
    outcome: str = "arriving"
    prefill: int | None = None  # node indices
    decode: int | None = None
    cached_tokens: int = 0  # prompt tokens its prefill did not compute (cached or fetched)
    prefill_work: float = 0.0  # s its prefill node spent on it (a fetch included)
    first_token: float | None = None  # the end of its prefill
    finish: float | None = None
    join_step: int = 0  # its decode node's step count when it joined the batch

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.w.arrival_time

    @property
    def tbt(self) -> float | None:
        """Mean time between its tokens after the first, the KV transfer included."""
        if self.finish is None or self.first_token is None:
            return None
        return (self.finish - self.first_token) / max(1, self.w.output_len - 1)


@dataclass
class _PrefillNode:
    capacity: int  # blocks
    cache: OrderedDict = field(default_factory=OrderedDict)  # block id -> None, least recently used first
    free_at: float = 0.0  # when the requests queued here will all have been prefilled
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
    load: DecodeLoad  # what the conductor knows of this node alone
    batch: dict[str, ClusterRequest] = field(default_factory=dict)
    joining: list[ClusterRequest] = field(default_factory=list)  # arrived during a step: join the next
    ends: list = field(default_factory=list)  # heap: (step count at its last token, seq, request id)
    steps: int = 0
    context: int = 0  # Σ tokens of KV over the batch
    stepping: bool = False
    sent: int = 0  # requests the conductor sent here that have not ended
    sent_tokens: int = 0  # their prompts' tokens

    @property
    def size(self) -> int:
        return len(self.batch) + len(self.joining)


class ClusterSim:
    def __init__(self, cost: CostModel, workload: Sequence[WorkloadRequest], config: ClusterConfig) -> None:
        config = config.resolve(cost, workload)
        self.cost, self.config = cost, config
        self.requests = [ClusterRequest(w) for w in workload]  # arrival order, ties as given
        self.prefill = [_PrefillNode(config.cache_blocks) for _ in range(config.prefill_nodes)]
        self.decode = [_DecodeNode(DecodeLoad(config.decode_batch, config.decode_seconds))
                       for _ in range(config.decode_nodes)]
        self.load = DecodeLoad(capacity=config.decode_nodes * config.decode_batch, decode_seconds=config.decode_seconds)
        self.gate = EarlyRejection(self.load, config.rejection) if config.rejection != "off" else None
        self._events: list = []  # heap: (time, kind order, seq, handler, argument)
        self._seq = 0
        self.decisions: list[tuple[float, bool]] = []  # (when, accepted?), per arrival
        self.decode_samples: list[int] = []
        self.prefill_samples: list[int] = []
        self.late_with_room = 0  # late rejections while another decode node had a free slot

    # -- costs ------------------------------------------------------------------------------------
    def prefill_seconds(self, prompt: int, cached: int) -> float:
        """What the cache lacks (at least one token) in chunks of max_num_batched_tokens."""
        t, done, chunk = 0.0, min(cached, prompt - 1), self.cost.max_num_batched_tokens
        while done < prompt:
            n = min(chunk, prompt - done)
            t += self.cost.step_time([(done, n)])
            done += n
        return t

    def decode_step_seconds(self, batch: int, context: int) -> float:
        """The roofline of a step in which `batch` requests holding Σ `context` tokens of KV each
        compute one token: cost.step_time([(context_i, 1) ...]) without the list."""
        c = self.cost
        attended = context + batch
        flops = 2.0 * c.num_params * batch + 4.0 * c.num_layers * c.num_heads * c.head_dim * attended
        return c.time_of(StepWork(flops, c.weight_bytes + float(c.kv_bytes_per_token) * attended))

    def transfer_seconds(self, tokens: int) -> float:
        return tokens * self.cost.kv_bytes_per_token / self.config.link_bandwidth

    # -- the loop ---------------------------------------------------------------------------------
    def _at(self, t: float, order: int, handler, arg) -> None:
        """At one instant decode steps end first (freeing slots), then prefills, KV arrivals and
        arrivals, each kind in the order it was scheduled: the same for every gate."""
        self._seq += 1
        heapq.heappush(self._events, (t, order, self._seq, handler, arg))

    def run(self) -> "ClusterResult":
        for r in self.requests:
            self._at(r.w.arrival_time, 3, self._arrive, r)
        last_arrival = self.requests[-1].w.arrival_time if self.requests else 0.0
        next_sample = 0.0
        while self._events:
            t, _, _, handler, arg = heapq.heappop(self._events)
            while next_sample <= min(t, last_arrival):  # the state holds from the last event to t
                self.decode_samples.append(sum(d.size for d in self.decode))
                self.prefill_samples.append(sum(p.in_flight for p in self.prefill))
                next_sample += self.config.sample_interval
            handler(t, arg)
        if self.load.current() or any(d.sent or d.batch for d in self.decode):
            raise RuntimeError("a request was left in the decode pool after every event ran")
        return ClusterResult(self.config, self.requests, self.decisions, self.decode_samples, self.prefill_samples,
                             self.late_with_room, last_arrival)

    def _arrive(self, now: float, r: ClusterRequest) -> None:
        c, w = self.config, r.w
        prefill = [PrefillNode(f"p{i}", min(p.prefix_blocks(w.hash_ids) * w.block_tokens, w.prompt_len),
                               max(0.0, p.free_at - now), self.prefill_seconds) for i, p in enumerate(self.prefill)]
        kw = dict(bandwidth=lambda a, b: c.link_bandwidth, kv_bytes_per_token=self.cost.kv_bytes_per_token,
                  balancing_threshold=c.balancing_threshold, ttft_slo=c.ttft_slo, tbt_slo=math.inf)
        # Pass 1 picks the prefill node (Algorithm 1 picks it apart from the decode node), which
        # says when the request would reach decode; pass 2 rates the decode nodes for that time.
        choice = place(w.prompt_len, prefill, [DecodeNode("d0", 0.0)], **kw)
        if isinstance(choice, Rejection):
            return self._reject(r, "rejected-ttft")
        decode_start = now + choice.ttft_seconds + self.transfer_seconds(w.prompt_len)
        choice = place(w.prompt_len, prefill, self._rate_decode(now, decode_start, w.prompt_len), **kw)
        earliest = now + min(p.queue_seconds for p in prefill)  # the soonest one arriving now could prefill
        if self.gate is not None and not self.gate.admit(now, decode_start, earliest):
            return self._reject(r, "rejected-early")
        self.decisions.append((now, True))
        r.outcome, r.prefill, r.decode = "prefilling", int(choice.prefill[1:]), int(choice.decode[1:])
        p, d = self.prefill[r.prefill], self.decode[r.decode]
        r.cached_tokens = prefill[r.prefill].prefix_tokens + choice.fetch_tokens
        held = w.hash_ids[:math.ceil(r.cached_tokens / w.block_tokens)]
        p.touch(held)
        if choice.fetch_from is not None:
            self.prefill[int(choice.fetch_from[1:])].touch(held)
        # NOTE: place()'s TTFT is this FIFO's finish time exactly: queue (free_at − now) + fetch + prefill.
        r.prefill_work = choice.ttft_seconds - prefill[r.prefill].queue_seconds
        p.free_at = now + choice.ttft_seconds
        p.in_flight += 1
        d.sent += 1
        d.sent_tokens += w.prompt_len
        for load in (self.load, d.load):
            load.accepted(w.request_id, decode_start)
        self._at(p.free_at, 1, self._prefilled, r)

    def _reject(self, r: ClusterRequest, outcome: str) -> None:
        r.outcome = outcome
        self.decisions.append((r.w.arrival_time, False))

    def _rate_decode(self, now: float, decode_start: float, prompt: int) -> list[DecodeNode]:
        """Each decode node's TBT with this request in its batch of n (predicted for decode_start,
        or sent and not ended), at the mean context of the requests sent there."""
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
        d, full = self.decode[r.decode], self.config.decode_batch
        if d.size >= full and self.config.decode_admission == "pool":
            j = min(range(len(self.decode)), key=lambda j: self.decode[j].size)
            if self.decode[j].size < full:  # another node has a seat: the request moves there
                self._unsend(r, now)
                r.decode, d = j, self.decode[j]
                d.sent += 1
                d.sent_tokens += r.w.prompt_len
        if d.size >= full:  # the decode node's own check: a full batch
            self.late_with_room += any(e.size < self.config.decode_batch for e in self.decode)
            return self._end(now, r, "rejected-late")
        r.outcome = "decoding"
        for load in (self.load, d.load):
            load.started(r.w.request_id, now)
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
        self._unsend(r, now)
        self.load.finished(r.w.request_id, now)

    def _unsend(self, r: ClusterRequest, now: float) -> None:
        """r leaves its decode node's count (ended, or moved to another node)."""
        d = self.decode[r.decode]
        d.sent -= 1
        d.sent_tokens -= r.w.prompt_len
        d.load.finished(r.w.request_id, now)


@dataclass
class ClusterResult:
    config: ClusterConfig
    requests: list[ClusterRequest]
    decisions: list[tuple[float, bool]]  # (when, accepted?), per arrival in order
    decode_samples: list[int]  # requests in the decode pool, every sample_interval from 0 to the last arrival
    prefill_samples: list[int]  # requests queued or prefilling
    late_with_room: int
    span: float  # s from the first arrival to the last

    def summary(self) -> dict:
        c, rs = self.config, self.requests
        count = {k: sum(r.outcome == k for r in rs) for k in ("rejected-ttft", "rejected-early", "rejected-late")}
        admitted = [r for r in rs if r.first_token is not None]  # accepted: their prefill ran
        finished = [r for r in rs if r.outcome == "finished"]
        ttfts = sorted(r.ttft for r in admitted)
        good = [r for r in finished if r.ttft <= c.ttft_slo and r.tbt <= c.tbt_slo]
        work = sum(r.prefill_work for r in admitted)
        capacity = c.decode_nodes * c.decode_batch
        return {
            "requests": len(rs),
            "accepted": len(admitted),
            "rejected": sum(count.values()),
            "rejected_ttft": count["rejected-ttft"],  # by place(): predicted TTFT over its SLO
            "rejected_early": count["rejected-early"],  # by the gate, before prefill
            "rejected_late": count["rejected-late"],  # by a full decode node, after prefill
            "rejected_late_with_room": self.late_with_room,  # ... while another decode node had a slot
            "finished": len(finished),
            "goodput_requests": len(good),  # finished with TTFT and mean TBT within their SLOs
            # output tokens of those over the arrivals' span: one denominator for every gate
            "goodput_tokens_per_s": sum(r.w.output_len for r in good) / self.span if self.span else math.nan,
            "ttft_mean": statistics.fmean(ttfts) if ttfts else math.nan,
            "ttft_p99": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] if ttfts else math.nan,
            "ttft_over_slo_20pct": sum(t > 1.2 * c.ttft_slo for t in ttfts) / len(ttfts) if ttfts else 0.0,
            "tbt_over_slo": sum(r.tbt > c.tbt_slo for r in finished),
            "flips": sum(a != b for (_, a), (_, b) in zip(self.decisions, self.decisions[1:])),
            "phase_flips": self.phase_flips(),
            "decode_load_mean": statistics.fmean(self.decode_samples) if self.decode_samples else 0.0,
            "decode_load_sd": statistics.pstdev(self.decode_samples) if self.decode_samples else 0.0,
            "decode_capacity": capacity,
            "prefill_load_sd": statistics.pstdev(self.prefill_samples) if self.prefill_samples else 0.0,
            "prefill_busy": work / (c.prefill_nodes * self.span) if self.span else math.nan,
            "wasted_prefill_s": sum(r.prefill_work for r in rs if r.outcome == "rejected-late"),
            "cache_hit_rate": sum(r.cached_tokens for r in admitted) / max(1, sum(r.w.prompt_len for r in admitted)),
        }


    def phase_flips(self) -> int:
        """Flips of the majority decision (accept or refuse) between consecutive flip_windows that
        saw arrivals: the slow swing of Mooncake Fig. 10a, not the metering of a gate at its threshold."""
        windows: dict[int, list[int]] = {}
        for t, accepted in self.decisions:
            counts = windows.setdefault(int(t // self.config.flip_window), [0, 0])
            counts[accepted] += 1
        phases = [counts[1] >= counts[0] for _, counts in sorted(windows.items())]
        return sum(a != b for a, b in zip(phases, phases[1:]))


def simulate_cluster(cost: CostModel, workload: Sequence[WorkloadRequest], modes: Sequence[str],
                     config: ClusterConfig = ClusterConfig(), ties: str = "file") -> dict[str, ClusterResult]:
    """Each gate on the same arrivals, in the same order, with the same resolved config."""
    ordered = order_ties(workload, ties)
    config = config.resolve(cost, ordered)
    return {m: ClusterSim(cost, ordered, replace(config, rejection=m)).run() for m in modes}
