"""N engines of one node on one virtual timeline: today's cache-aware routing against the node's
prefix-cache pool (`--pool-mode query`). Each engine is the engine's own EngineCore (scheduler, KV
manager, page pool, policy) over the cost model's executor, as in simulator.py; what differs is
where a request runs and what it computes.

    an arrival is routed when it arrives (router.py, the daemon's own code):
      routing   Router.pick: the engine with the longest cached prefix unless it is clearly busier
      pool      Router.pick_pooled: the least loaded engine (by work); the prompt's prefix pages that engines
                hold are pinned where they are and read there, so the request computes only the rest
                (named again and pinned once the request is near the front of its engine's queue,
                pool/ahead.py, Router.reads: from where the pool holds them then, as the daemon's
                engine asks its front with ResolveReads);
                its new whole segments are put at their homes (homes.py segment_homes) once its prompt is
                computed, and no longer cached where it ran (what the daemon's --pool-placement
                home did before it wrote into the home)
      pool-local  the same, new segments kept where they are computed (--pool-placement local,
                the daemon's default); the request goes to the engine holding most of its prefix
                among those whose work is within router.AFFINITY_SLACK prompts of the least (it
                reads that part without the round trips)
      pool-write  the same, but once its prompt is computed its new segments are written into
                their homes and it lets go of its own pages of them, reading them at the homes
                from then on (the daemon's --pool-placement home, PoolHooks._hand_off): the node
                holds each segment once. The router learns at the step's end that the homes hold
                them and that the engine let go of its own (the daemon's step message says both:
                StepOutputs.keys_moved). Readers that arrive before the write read the pages
                where they are being computed, once computed (the engine publishes them as it goes),
                and read them at the homes once they are written there (NodeConfig.follow, the
                daemon's protocol.Moved: PoolMember.follow), the sender's copy then let go of.
                With NodeConfig.hand_off "segment" (--pool-hand-off segment) each whole segment
                goes as soon as it is computed; with "auto" (the default, as the daemon's) so does
                each of a prompt over a quarter of the engine's KV (pool/hand_off.py)
    in every pool mode (NodeConfig.steal, the daemon's default), at the end of each step an idle
    engine (nothing queued, a seat and a quarter of its pages free) takes the last queued request
    that has started nothing from the engine with the longest queue, but for those that read most
    of their prompt there (`stays`), as the daemon's front has it do (pool/steal.py;
    Router.pick_pooled names its reads and homes for where it runs now)
    then the engine whose clock is earliest takes a step, until every request has finished. What a
    step does beyond its engine (prefix events into the router's index, pages put or written into
    homes, pins let go of) takes effect at the step's end: an engine whose clock is behind, or an
    arrival before it, does not see it. An engine that has run nothing for STUCK_SECONDS while
    requests wait gives their pins back, as the daemon's PoolHooks._unblock does (engines whose
    waiting requests pin each other's pages would otherwise leave each other no room for ever).

The pool's costs (query mode, TokenLake §3.3). Per layer of a step, the holders that the step's
rows read are asked together, as the daemon's PooledAttention does: one round trip and the rows'
payload on the link, 2α + rows·payload/B, a request's rows once to each holder whatever runs of its
prefix the holder holds (PoolMember.holders; before, once a run: a prefix dealt round the homes paid
its rows about six times over), and the holder's answer: pool/attention.py sends the
rows before each layer's own attention and collects them after it, so the requester's step waits
only for what the round trips and the slowest holder's answer take beyond its own attention
(NodeConfig.overlap_queries). Before, every round trip was added to the step in full and the
answer not waited for (overlap_queries False): too dear for a decode step over a long context of
its own, too cheap for a prompt chunk whose holder attends its rows over a long prefix. The holder's attention
over its pages for those rows is added to the holder's next step, costed as the engine's own: the
larger of its FLOPs (4·heads·head_dim per row, prefix token and layer) and reading the pages' KV
once per request (the query service attends per request, as the engine's own decode does; costed
as FLOPs alone, a decode row's read of a long prefix elsewhere came out ~100x cheaper than the
same read at home, and the pool "won" by reading remotely). A put, a write into a home, or a hot
segment copied in (Choice.copies, as the engine's PoolMember.copy_in: once per engine, and read
there from then on) costs the receiver or sender the pages' KV it lacked on the link, added to its
next step. An engine that idles meanwhile does that work as it idles (`_idle_until`): a holder idle
for minutes once charged its next request's first step with every answer it gave in them. Read
mode (NodeConfig.read_rows, the daemon's --pool-mode read with --pool-read-rows): a request with at
least that many rows in a step attends its holders' pages itself, read over the link (its FLOPs or
that read, whichever bounds it, added to the step), and asks the holders nothing; one with fewer is
costed as in query mode. Pages a request reads in its own engine's cache through its pins (its
segments homed there, a replica copied in) are attended there as its own KV is, in the step's
roofline (before, they cost nothing: a decode over a long prefix homed on its own engine came out as
cheap as one over none).
Balance, five ways, each but the first a CV across engines in each second while requests arrive,
averaged: busy_cv, the CV across engines of each one's busy time over the whole run (a burst's last
long decodes, one engine each, weigh on it); load_cv, of the prompt tokens of the requests each
holds (what the router balances); access_cv, TokenLake's (§7.2, Figure 10: "the prefix cache
accesses on each instance"; its holders attend the queries shipped to them at every step), of the
KV tokens steps read from each one's memory: a step reads its requests' own KV where they run and
the pages they pinned where those are held (as sim/pool.py counts tokens served per window), and
access_cv_by_reads, the same with each second weighted by its reads (a near-idle second of a light
load counts for little); served_cv, of the reads served to peers alone (own_access_share: the share
of reads the engines' own steps made); cache_access_cv, of the prefix tokens requests found cached
in each one's memory, each request counted once, as its first step begins (its own engine's hit
there, its pins at their holders): the lookups alone, lumpier (a second holds few first steps in
overload).
Pins are taken as the request nears the front of its engine's queue (pool/ahead.py; it is not
admitted before) and hold the pages until the request ends or gives them back. Each engine's
prefix-cache key events are applied to the router's index at the end of each of its steps.
Each engine has a host KV tier where NodeConfig.offload says so (the daemon's --offload, whose
default is write-through): a preempted request's KV comes back over the engine's host link, as the
one-engine Simulator has it, instead of being computed again. Without one (NodeConfig's default,
and the figures in bench/results/ before node_contexts_host_*), a preempted prompt is computed again.
"""
from __future__ import annotations

import bisect
import heapq
import math
import random
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

from tokenflowd.buffer import make_policy
from tokenflowd.buffer.qos import Timeline, summarize
from tokenflowd.config import OFFLOAD_MODES, POOL_HAND_OFFS, PolicyConfig
from tokenflowd.daemon.prefix_index import PrefixIndex
from tokenflowd.daemon.router import Choice, Router
from tokenflowd.engine.core import EngineCore
from tokenflowd.engine.request import Request, RequestStatus, SamplingParams
from tokenflowd.engine.scheduler import ScheduledBatch, Scheduler
from tokenflowd.kv.manager import KVCacheManager
from tokenflowd.kv.pages import OutOfPages, PagePool, chain_page_keys
from tokenflowd.offload.traffic import HostOffloader
from tokenflowd.pool.ahead import ASK_EVERY, ToldPending, asks_again, due, pins_on_arrival, waits
from tokenflowd.pool.hand_off import by_segment, tail_end
from tokenflowd.pool.heat import within_replica_cap
from tokenflowd.pool.steal import idle, staying, victim, withdrawable
from tokenflowd.pool.stuck import StuckTimer
from tokenflowd.sim.clock import VirtualClock
from tokenflowd.sim.cost import CostModel
from tokenflowd.sim.executor import CostModelExecutor
from tokenflowd.sim.pool import coefficient_of_variation
from tokenflowd.sim.simulator import SIM_EOS, SIM_VOCAB_SIZE, RequestRecord, SimulationError, host_offloader
from tokenflowd.sim.workload import WorkloadRequest, prompt_token_ids

MODES = ("routing", "pool", "pool-write", "pool-local")
# TokenLake's SLO (§7): every input and output token within 10x its latency at a batch of one (a
# request's TTFT within 10x its prompt's prefill alone, its mean time between tokens within 10x a
# decode step of one request at its mean context)
SLO_FACTOR = 10.0
# s between an idle engine's reports (the daemon's --heartbeat-interval default): the front checks
# whether an engine can take a queued request from a busy one on each report (pool/steal.py)
HEARTBEAT = 0.5
# s between samples of each engine's load (NodeResult.load_cv; the daemon's benchmark samples once a second)
LOAD_WINDOW = 1.0


@dataclass(frozen=True)
class NodeConfig:
    engines: int = 8
    policy: str = "fcfs"
    # the query path between two GPUs of the node: NVLink (A100 SXM: 300 GB/s each way of 600;
    # a round trip of a small message through the query service: tens of µs, TokenLake §7)
    link_alpha: float = 20e-6  # s, one way
    link_bandwidth: float = 150e9  # bytes/s, effective
    segment_pages: int = 32  # the pool's segment: 512 tokens, near the paper's threshold of 568
    seed: int = 0
    # pool-write: new segments go to their homes once the prompt is computed ("prompt"), each once it
    # is ("segment"), or segment by segment where the prompt is over a quarter of the engine's KV
    # ("auto"), as the daemon's --pool-hand-off (pool/hand_off.py)
    hand_off: str = "auto"
    # pool-write: s an engine keeps its own cached copy of what it wrote into the homes, the front
    # finding it there too meanwhile (the daemon kept it two heartbeats, 1 s, before its step message
    # said where the segments went); 0: it lets go at once, as the daemon does
    let_go_after: float = 0.0
    # pool-write: requests that read a sender's pages of what it wrote into the homes read them at
    # the homes from then on, and the sender's copy goes (the daemon's PoolMember.follow); False:
    # they read the sender's copy, kept for them, until they end (the daemon before it followed)
    follow: bool = True
    # the query path's round trips as pool/attention.py makes them: sent before the engine's own
    # attention of each layer, collected after it (only what they and the holder's answer take
    # beyond it adds); False: every round trip adds to the step and the answer is not waited for
    # (the simulator before: --serial-queries)
    overlap_queries: bool = True
    # read mode (the daemon's --pool-mode read): a request whose rows in a step are at least these
    # attends its holders' pages here, reading them over the link (PeerCache over the holder's cache
    # mapped over CUDA IPC), rather than sending the rows to the holders (query mode); fewer rows are
    # sent, as the daemon's --pool-read-rows has it. 0: query mode, every row sent; 1: every row read
    # here. link_ridge_rows: the fewest rows whose attention over a page takes as long as reading it
    # over the link, from where reading in place costs no more than the holder's answer
    read_rows: int = 0
    steal: bool = True  # pool: an idle engine takes a queued request from a busy one (--no-pool-steal: False)
    copy: bool = True  # pool: hot segments an engine reads elsewhere are copied into it (--no-pool-copy: False)
    # routing: ties between engines of the best score go to one at random (seeded by `seed`), not to the
    # lower id as the daemon's router has them (bench/node_noise.py: what that alone moves)
    random_ties: bool = False
    # each engine's host KV tier, as the daemon's --offload (its default: write-through): a preempted
    # request's KV comes back from it over the engine's host link (the cost model's) instead of being
    # computed again; "none": recomputed. Its pages: host_kv_scale times the engine's device pool (the
    # daemon's default is 4x within the engine's share of a quarter of the host's RAM: on an 8-GPU
    # node about the device pool's size)
    offload: str = "none"
    host_kv_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.offload not in OFFLOAD_MODES:
            raise ValueError(f"offload must be one of {', '.join(OFFLOAD_MODES)}, got {self.offload!r}")
        if not self.host_kv_scale > 0:
            raise ValueError(f"host_kv_scale must be above 0, got {self.host_kv_scale}")

    def link_time(self, cost: CostModel, tokens: int) -> float:
        """Seconds to move `tokens` tokens' KV over the link (a put, a copy, a read in place)."""
        return tokens * cost.kv_bytes_per_token / self.link_bandwidth


@dataclass
class NodeResult:
    mode: str
    records: list[RequestRecord]
    prompt_tokens: int
    local_tokens: int  # prompt tokens the running engine's own prefix cache held
    peer_tokens: int  # prompt tokens read where other engines hold them (pool)
    computed_tokens: int  # over all steps, recomputation included
    busy_seconds: list[float] = field(default_factory=list)  # per engine
    put_pages: int = 0  # pages of new segments put at their homes (pool)
    slo: list[tuple[float, float]] = field(default_factory=list)  # per record: its TTFT and mean TBT bounds
    # each engine's load (the prompt tokens of the requests it holds, queued or running, the tokens
    # read where the pool holds them included: what the router balances), sampled every LOAD_WINDOW
    # while requests arrive
    load_samples: list[list[int]] = field(default_factory=list)
    # per LOAD_WINDOW while requests arrive, the KV tokens steps read from each engine's memory
    access_samples: list[list[int]] = field(default_factory=list)
    # per LOAD_WINDOW while requests arrive, the prefix tokens requests found cached in each engine's
    # memory (counted once a request, as its first step begins)
    cache_samples: list[list[int]] = field(default_factory=list)
    # per LOAD_WINDOW while requests arrive, of access_samples the KV tokens each engine's memory served
    # to its peers' steps (the pages they pinned there); the rest its own steps read
    served_samples: list[list[int]] = field(default_factory=list)

    def load_cv(self) -> float:
        """The imbalance of the router's load across engines over time: each sample's CV across
        engines, averaged (a burst's last long decodes after the arrivals end do not weigh)."""
        return _mean_cv(self.load_samples)

    def access_cv(self) -> float:
        """TokenLake's Figure 10 measure: the CV across engines of the KV tokens read from each one's
        memory (its cache accesses) in each window, averaged over windows with any access."""
        return _mean_cv(self.access_samples)

    def access_cv_by_reads(self) -> float:
        """access_cv with each window weighted by the KV tokens read in it: the imbalance per token of
        bandwidth used. At a light load the plain mean counts a second in which one request's first
        chunk was all the node read (one engine reading, CV sqrt(7) over 8) as much as a busy one:
        14 such seconds of 273 made the A100's 32-document questions read 0.169 at 1 req/s, 0.064
        weighted. Where every second is busy, as where TokenLake measures, the two agree."""
        weights = [sum(x) for x in self.access_samples]
        total = sum(weights)
        return sum(w * coefficient_of_variation(x) for w, x in zip(weights, self.access_samples)) / total \
            if total else 0.0

    def served_cv(self) -> float:
        """access_cv of the reads served to peers alone: how evenly the pool's placement spreads what
        it places. What an engine's own steps read where they run (a request's tail and outputs, its
        segments homed there) follows where requests run and in which phase their engine is."""
        return _mean_cv(self.served_samples)

    def own_access_share(self) -> float:
        """The share of the reads counted in access_samples that engines' own steps made."""
        total = sum(map(sum, self.access_samples))
        return 1 - sum(map(sum, self.served_samples)) / total if total else 0.0

    def cache_access_cv(self) -> float:
        """The lookups alone: the CV across engines of the prefix tokens requests found cached in
        each one's memory in each window (each request once, as its first step begins), averaged over
        windows with any."""
        return _mean_cv(self.cache_samples)

    def loaded_throughput(self, summary: dict) -> float:
        """Output tokens/s from the first arrival until every request has its first token: the node's
        rate while requests still wait to start. After that only the last decodes drain, and
        `throughput` (to the last token) is decided by when the longest of them began, one request's
        luck: in overload, one with 1,500 tokens to go decoding alone for 30 s set the span (the A100's
        32-document questions, seed 2). Where a request never had a token, `throughput`."""
        records = self.records
        if not records or not all(r.token_times for r in records):
            return summary["throughput"]
        start, until = min(r.arrival for r in records), max(r.token_times[0] for r in records)
        if until <= start:
            return summary["throughput"]
        return sum(bisect.bisect_right(r.token_times, until) for r in records) / (until - start)

    def meets_slo(self, tbt: bool = True) -> list[bool]:
        """Per record: whether it met its SLO (SLO_FACTOR); `tbt` False: its TTFT bound alone."""
        out = []
        for r, (ttft, gap) in zip(self.records, self.slo):
            t = r.token_times
            out.append(bool(t) and t[0] - r.arrival <= ttft
                       and (not tbt or len(t) < 2 or (t[-1] - t[0]) / (len(t) - 1) <= gap))
        return out

    def summary(self) -> dict:
        out = summarize([Timeline(r.arrival, r.reading_rate, r.token_times) for r in self.records])
        if self.slo:
            met = self.meets_slo()
            out.update(slo_attainment=sum(met) / len(met), slo_throughput=sum(
                len(r.token_times) for r, ok in zip(self.records, met) if ok) / out["span"] if out["span"] else 0.0,
                ttft_slo_attainment=sum(self.meets_slo(tbt=False)) / len(met))
        out["loaded_throughput"] = self.loaded_throughput(out)
        busy = self.busy_seconds
        out.update(hit_rate=(self.local_tokens + self.peer_tokens) / self.prompt_tokens if self.prompt_tokens else 0.0,
                   local_tokens=self.local_tokens, peer_tokens=self.peer_tokens, computed_tokens=self.computed_tokens,
                   put_pages=self.put_pages,
                   busy_cv=coefficient_of_variation(busy) if busy else 0.0,
                   load_cv=self.load_cv(), access_cv=self.access_cv(), access_cv_by_reads=self.access_cv_by_reads(),
                   served_cv=self.served_cv(), own_access_share=self.own_access_share(),
                   cache_access_cv=self.cache_access_cv())
        return out


def _mean_cv(samples: list[list[int]]) -> float:
    cvs = [coefficient_of_variation(x) for x in samples if any(x)]
    return statistics.fmean(cvs) if cvs else 0.0


class _Executor(CostModelExecutor):
    """The cost model's step, plus the pool's: the link to each holder the step reads, and the
    peers' queries this engine answered since its last step."""

    def __init__(self, engine: "_Engine", *args) -> None:
        super().__init__(*args)
        self.engine = engine

    def step_time(self, batch: ScheduledBatch) -> float:
        cost, node, engine = self.cost, self.engine.node, self.engine
        reads: list[tuple[_Engine, int]] = []  # (engine, KV tokens the step reads there): LOAD_WINDOWs once timed
        rows: dict[int, int] = {}
        answer: dict[int, float] = {}  # holder -> s of its attention for this step's rows
        own = attended = 0  # KV tokens the step's own attention reads here, and the (row, key) pairs it attends
        chunks: list[tuple[int, int]] = []  # per row, (the KV it attends here, its new tokens): the roofline's
        read_in_place: list[float] = []  # s of each read of a holder's pages over the link (read mode)
        for rid, position, n in zip(batch.request_ids, batch.positions, batch.num_tokens):
            # per holder, the tokens of the request's prefix it holds, its runs there together: a request's
            # rows go to each holder once, whatever runs it holds (PoolMember.holders: its pages by engine)
            held: dict[_Engine, int] = {}
            for holder, pages in engine.pins.get(rid, ()):
                held[holder] = held.get(holder, 0) + len(pages) * cost.page_size
            # tokens it reads in this engine's own cache through its pins (its segments homed here, a
            # replica): attended as its own KV is
            mine = held.pop(engine, 0)
            if rid not in engine.started:  # its first step: the prefix it found cached, where that is held
                engine.started.add(rid)
                now = engine.clock.now
                engine.cache_access(now, position + mine)
                for holder, tokens in held.items():
                    holder.cache_access(now, tokens)
            reads.append((engine, n + engine.scheduler.requests[rid].num_computed_tokens + mine))
            for holder, tokens in held.items():
                reads.append((holder, tokens))
                if node.read_rows and n >= node.read_rows:
                    # read mode: this engine attends the rows over the holder's pages, read over the
                    # link as the kernel goes (its FLOPs or that read, whichever bounds it); the
                    # holder does nothing
                    read_in_place.append(max(cost.attention_time(n * tokens, 0), node.link_time(cost, tokens)))
                    continue
                rows[holder.engine_id] = rows.get(holder.engine_id, 0) + n
                # the holder's attention for these rows over the request's pages, as its own step's:
                # the FLOPs, or reading the pages' KV, whichever bounds it (the query service
                # attends per request: attend_pages reads each one's pages, shared or not)
                work = cost.attention_time(n * tokens, tokens)
                holder.owe(work, engine.clock.now)
                answer[holder.engine_id] = answer.get(holder.engine_id, 0.0) + work
            done = engine.scheduler.requests[rid].num_computed_tokens + mine
            own += n + done
            attended += n * done + n * (n + 1) // 2
            chunks.append((position + mine, n))
        t = self.chunks_time(chunks) + engine.debt
        engine.debt = 0.0
        for read in read_in_place:
            t += read
        payload = 2 * cost.num_heads * cost.head_dim * cost.kv_dtype_bytes + 4 * cost.num_heads
        if rows:  # the holders are asked together and answer in parallel (pool/attention.py)
            link = 2 * node.link_alpha + sum(rows.values()) * payload / node.link_bandwidth
            if node.overlap_queries:
                # per layer, the rows go out before this engine's own attention and are collected
                # after it: only what the round trip and the slowest holder's answer take beyond
                # the step's own attention (costed as the holder's) adds
                t += max(0.0, cost.num_layers * link + max(answer.values()) - cost.attention_time(attended, own))
            else:
                t += cost.num_layers * link
        start = engine.clock.now - engine.origin
        for where, tokens in reads:
            where.read(start, t, tokens, peer=where is not engine)
        return t


class _Engine:
    def __init__(self, engine_id: int, cost: CostModel, config: NodeConfig, output_lens: dict[str, int],
                 origin: float = 0.0) -> None:
        self.engine_id = engine_id
        self.node = config
        self.clock = VirtualClock()
        self.pool = PagePool(cost.num_pages, True)
        self.pool.drain_key_events()  # record from here on: the router's index follows them
        # keys its step in flight published as it began, drained with a peer's put into it: the
        # router's index has them at the step's end (NodeSimulator._update_now)
        self.unreported: list[bytes] = []
        self.kv = KVCacheManager(self.pool, cost.page_size, _host_tier(cost, config, self.pool, self.clock))
        policy = make_policy(config.policy, PolicyConfig())
        self.scheduler = Scheduler(self.kv, policy, cost.max_num_batched_tokens, cost.max_num_seqs, clock=self.clock)
        self.executor = _Executor(self, cost, output_lens, self.clock, 0, SIM_EOS)
        self.core = EngineCore(self.executor, self.scheduler, max_model_len=cost.max_model_len,
                               vocab_size=SIM_VOCAB_SIZE, eos_token_ids=(SIM_EOS,))
        # s of peers' queries answered and of KV written to peers, charged to the next step (less
        # what an idle spell covers: _idle_until)
        self.debt = 0.0
        self.origin = origin  # the first arrival: LOAD_WINDOW windows count from it
        self.accessed: dict[int, float] = {}  # window -> KV tokens steps read from this engine's memory
        self.served: dict[int, float] = {}  # window -> those read by its peers' steps (pinned here)
        # window -> prefix tokens requests found cached here as their first step began (the lookups:
        # a request's hit in its own engine, and what it pinned here from another)
        self.cache_reads: dict[int, int] = {}
        self.started: set[str] = set()  # requests that ran a step here
        self.reported = 0.0  # an idle engine's last report (the pool's stealing: NodeSimulator._steal)
        self.stuck = StuckTimer()  # since when it has run nothing with requests waiting
        self.busy = 0.0
        self.pins: dict[str, list[tuple[_Engine, list[int]]]] = {}  # request -> (holder, its pages) it reads
        self.deferred: dict[str, list[tuple[int, list[bytes]]]] = {}  # queued request -> its reads, not pinned yet
        self.scheduler.held = self.deferred  # not admitted before its reads are pinned
        self.places: dict[str, list[tuple[int, list[bytes]]]] = {}  # pool: request -> (home, keys) of its new segments
        # pool-write: request -> (each new page's home, the keys that end its segments), as the daemon's
        self.homes: dict[str, tuple[dict[bytes, int], set[bytes]]] = {}
        self.kept: dict[str, tuple[int, list[bytes]]] = {}  # request -> (home, keys) of its tail segment (tail_end)
        self.later: set[str] = set()  # deferred requests answered empty: they ask again when wanted, or at again_at
        self.again_at: dict[str, float] = {}  # those, and those told their prefix is being computed -> next ask
        self.scheduler.waiting_on = ToldPending(self.again_at, self.later)  # (the daemon's PoolHooks)
        self.letting_go: deque[tuple[float, list[bytes]]] = deque()  # (when, keys) written into homes, cached here
        self.replicas: set[bytes] = set()  # keys of hot segments named to copy in, kept here (PoolMember.replicas)

    @property
    def load(self) -> int:
        return len(self.scheduler.requests)

    def cache_access(self, at: float, tokens: int) -> None:
        """`tokens` of cached prefix read here by a request whose first step begins at `at` (s on
        the clock of the engine it runs on: each engine's clock runs apart)."""
        if tokens:
            window = int((at - self.origin) // LOAD_WINDOW)
            self.cache_reads[window] = self.cache_reads.get(window, 0) + tokens

    def read(self, start: float, duration: float, tokens: int, peer: bool = False) -> None:
        """`tokens` of KV read here by a step (a peer's: `peer`) from `start` (s after the origin) for `duration`,
        spread over the LOAD_WINDOWs it spans by the share of its time in each. Counted whole in the
        window it began in, a step of 0.7 s moved a burst's one-second access CV by where it began:
        the A100 burst behind one system prompt (test_node_sim.py) read 0.08 where an engine's long
        step began just before the second's end and 0.44 where it began just after; spread, 0.21
        and 0.22."""
        windows = (self.accessed, self.served) if peer else (self.accessed,)
        if duration <= 0:
            window = int(start // LOAD_WINDOW)
            for into in windows:
                into[window] = into.get(window, 0) + tokens
            return
        end = start + duration
        window = int(start // LOAD_WINDOW)
        while window * LOAD_WINDOW < end:
            share = (min(end, (window + 1) * LOAD_WINDOW) - max(start, window * LOAD_WINDOW)) / duration
            for into in windows:
                into[window] = into.get(window, 0) + tokens * share
            window += 1

    @property
    def work(self) -> int:
        """As the daemon's EngineHandle.work: the whole prompts of the requests it holds, the tokens
        read where the pool holds them included."""
        return sum(r.prefix_offset + r.num_prompt_tokens for r in self.scheduler.requests.values())

    def owe(self, seconds: float, now: float | None = None) -> None:
        """Work for its peers (an answer to their query, KV written to them) charged to its next step,
        asked of it at `now` (None: its own clock's): idle until then, it could not have done it
        sooner (`_idle_until`)."""
        if now is not None and not self.scheduler.has_unfinished():
            _idle_until(self, now)
        self.debt += seconds

    def release(self, request_id: str) -> None:
        for holder, pages in self.pins.pop(request_id, ()):
            _release(holder.pool, pages)


def _idle_until(e: _Engine, now: float) -> None:
    """e idles until `now`: what it owes for its peers (`_Engine.debt`: answers to their queries,
    writes into homes) is done meanwhile, as its query service answers while it runs nothing; the
    rest falls on its next step."""
    if now > e.clock.now:
        e.debt = max(0.0, e.debt - (now - e.clock.now))
        e.clock.now = now


def _host_tier(cost: CostModel, config: NodeConfig, pool: PagePool, clock: VirtualClock) -> HostOffloader | None:
    """An engine's host KV tier (NodeConfig.offload), bookkeeping only, its copies in the engine's
    virtual time (as the one-engine Simulator's); None without one."""
    if config.offload == "none":
        return None
    return host_offloader(cost, pool, clock, config.offload, max(1, int(cost.num_pages * config.host_kv_scale)))


def _hold(pool: PagePool, keys: list[bytes]) -> list[int]:
    """As PoolMember.put: a referenced page for each leading key the pool can give, the one it holds
    or a new one registered under the key (held while it allocates, so none is evicted for another)."""
    taken: list[int] = []
    try:
        for key in keys:
            found = pool.lookup([key])
            if found:
                pool.incref(found[0])
            else:
                found = [pool.allocate()]
                pool.register(found[0], key)
            taken.append(found[0])
    except OutOfPages:
        pass
    return taken


def _release(pool: PagePool, pages: list[int]) -> None:
    """Unreference pages, the segment's end first into the LRU (eviction takes a prefix from its end)."""
    for page in reversed(pages):
        pool.decref(page)


class NodeSimulator:
    def __init__(self, cost: CostModel, workload: Sequence[WorkloadRequest], mode: str, config: NodeConfig) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if config.hand_off not in POOL_HAND_OFFS:
            raise ValueError(f"hand_off must be one of {', '.join(POOL_HAND_OFFS)}, got {config.hand_off!r}")
        room = cost.max_tokens_in_pool
        for r in workload:
            if r.prompt_len + r.output_len > room:
                raise ValueError(f"request {r.request_id} needs {r.prompt_len + r.output_len} tokens of KV; the "
                                 f"{cost.name} pool holds {room}: cap prompts (--max-prompt-len)")
        self.cost, self.mode, self.config = cost, mode, config
        self.workload = sorted(workload, key=lambda r: r.arrival_time)  # stable: ties keep workload order
        output_lens = {r.request_id: r.output_len for r in workload}
        origin = self.workload[0].arrival_time if self.workload else 0.0
        self.engines = [_Engine(i, cost, config, output_lens, origin) for i in range(config.engines)]
        self.index = PrefixIndex()
        self.router = Router(cost.page_size, self.index, clock=lambda: self._now, copy_hot=config.copy,
                             ties=random.Random(f"ties {config.seed}") if config.random_ties else None)
        self.rng = random.Random(config.seed)
        self._now = 0.0
        self.records = {r.request_id: RequestRecord(r.request_id, r.arrival_time, r.reading_rate, r.prompt_len,
                                                    r.output_len) for r in workload}
        self.prompt_tokens = sum(r.prompt_len for r in workload)
        self.peer_tokens = 0
        self.put_pages = 0
        self.read_peer: dict[str, int] = {}  # request -> prompt tokens it reads where peers hold them
        self.unblocked = 0  # requests that gave their pins back (_unblock)
        self.pinned_queued = 0  # requests that pinned their reads while queued (pool/ahead.py)
        self.stolen = 0  # queued requests an idle engine took from a busy one (pool/steal.py)
        self.copied_pages = 0  # pages of hot segments copied into engines that read them elsewhere
        self.keys: dict[str, list[bytes]] = {}  # queued request -> its prompt's page keys, once a steal weighed it

    def _route(self, w: WorkloadRequest) -> None:
        self._now = w.arrival_time
        ids = prompt_token_ids(w, SIM_VOCAB_SIZE)
        req = Request(w.request_id, ids, SamplingParams(max_tokens=w.max_tokens), eos_token_ids=(SIM_EOS,),
                      arrival_time=w.arrival_time, reading_rate=w.reading_rate, priority=w.priority)
        if self.mode == "routing":
            target, choice = self.engines[self.router.pick(self.engines, ids).engine_id], None
        else:
            choice = self.router.pick_pooled(self.engines, ids, self.config.segment_pages, self.rng,
                                             place=self.mode != "pool-local", request_id=w.request_id)
            target = self.engines[choice.engine_id]
        self._admit(target, req, choice, w.arrival_time, w.prompt_len + w.output_len)

    def _admit(self, target: _Engine, req: Request, choice: Choice | None, now: float, tokens: int) -> None:
        """Queue `req` on `target`, with the pool's `choice` (None: routing): its reads pinned now, or
        named again once it nears the front; the homes of its new segments. `tokens`: its prompt and
        output."""
        if not target.scheduler.has_unfinished():
            _idle_until(target, now)  # it was idle until now (a copy it makes now is not done before)
        if choice is not None:
            if choice.copies:
                self._copy(target, choice.copies)
            waiting, free, ps = target.scheduler.waiting, target.pool.num_free, self.cost.page_size
            if pins_on_arrival(waiting, req, free, ps, choice.pending):
                self._pin(target, req, choice.runs)
            if not req.foreign_token_ids and req.num_prompt_tokens > ps and waits(waiting, req, free, ps,
                                                                                  choice.pending):
                # its reads are named when it nears the front, from where the pool holds them then
                target.deferred[req.request_id] = choice.runs
            seg = self.config.segment_pages
            if choice.places and self.mode == "pool-write":
                target.homes[req.request_id] = (
                    {k: home for home, keys in choice.places for k in keys},
                    {keys[j] for _, keys in choice.places for j in range(seg - 1, len(keys), seg)})
            elif choice.places:
                target.places[req.request_id] = choice.places
        req.max_model_len = max(self.cost.max_model_len, tokens) - req.prefix_offset
        target.scheduler.add(req)

    def _steal(self, e: _Engine, now: float) -> None:
        """As the daemon's front does on each engine's report (Front._steal, pool/steal.py): an idle
        engine takes the last request that has started nothing from the longest queue, its reads and
        homes named for where it runs now. An engine reports at the end of each step, and one that
        runs nothing every HEARTBEAT seconds."""
        cost = self.cost
        for thief in self.engines:
            s = thief.scheduler
            if thief is not e:
                if s.has_unfinished() or now - thief.reported < HEARTBEAT:
                    continue
                thief.reported = now
            if not idle(len(s.waiting), len(s.running), cost.max_num_seqs, thief.pool.num_free, cost.num_pages):
                continue
            giver = victim({x.engine_id: len(x.scheduler.waiting) for x in self.engines}, thief.engine_id)
            if giver is None:
                return
            g = self.engines[giver]
            old = withdrawable(g.scheduler.waiting, self._staying(g, thief))
            if old is None:
                continue
            rid = old.request_id
            g.scheduler.abort(rid)
            for plans in (g.deferred, g.places, g.homes):
                plans.pop(rid, None)
            req = Request(rid, old.prompt_token_ids, old.sampling_params, eos_token_ids=(SIM_EOS,),
                          arrival_time=old.arrival_time, reading_rate=old.reading_rate, priority=old.priority)
            choice = self.router.pick_pooled(self.engines, req.prompt_token_ids, self.config.segment_pages, self.rng,
                                             self.mode != "pool-local", target=thief.engine_id, count=False,
                                             request_id=rid)
            rec = self.records[rid]
            self._admit(thief, req, choice, now, rec.prompt_len + rec.output_len)
            self.stolen += 1

    def _staying(self, giver: _Engine, thief: _Engine) -> list[str]:
        """As the front's Front._staying: the requests queued on `giver` that have started nothing
        and stay there rather than go to `thief` (pool/steal.py `staying`)."""
        def keys_of(req: Request) -> list[bytes]:
            keys = self.keys.get(req.request_id)
            if keys is None:
                keys = self.keys[req.request_id] = self.router.prompt_keys(req.prompt_token_ids)
            return keys

        fresh = [r for r in giver.scheduler.waiting if not (r.num_computed_tokens or r.num_preemptions)]
        return staying(fresh, keys_of, self.index, giver.engine_id, thief.engine_id, self.cost.page_size)

    def _copy(self, target: _Engine, copies: list[tuple[int, list[bytes]]]) -> None:
        """Hot segments that target reads on peers, copied into its pages (as the engine's
        PoolMember.copy_in): the pages it lacks, unreferenced in its prefix cache; it pays their KV on
        the link at its next step."""
        cost = self.cost
        copied: list[bytes] = []
        for holder_id, keys in copies:
            keys = keys[: len(self.engines[holder_id].pool.lookup(keys))]
            have = len(target.pool.lookup(keys))
            if len(keys) - have > target.pool.num_unused or not within_replica_cap(
                    target.replicas, keys, cost.num_pages, len(self.engines)):
                continue  # a replica: unused pages only, at most 1/N of the engine's in all (PoolMember.copy_in)
            fresh = [not target.pool.holds(key) for key in keys]
            taken = _hold(target.pool, keys)
            _release(target.pool, taken)
            target.pool.evict_first([page for page, new in zip(taken, fresh) if new])
            target.replicas.update(keys[: len(taken)])
            copied += keys[: len(taken)]
            new = max(0, len(taken) - have)
            self.copied_pages += new
            target.owe(self.config.link_alpha + self.config.link_time(cost, new * cost.page_size))
        self._update_now(target, copied)

    def _pin(self, target: _Engine, req: Request, runs: list[tuple[int, list[bytes]]], queued: bool = False) -> None:
        """The runs' pages, where they are, up to the first that is gone (as the engine's PoolMember);
        `queued`: the request waits in target's queue already."""
        pinned, keys_done = [], []
        for engine_id, keys in runs:
            holder = self.engines[engine_id]
            if holder is not target and len(target.pool.lookup(keys)) == len(keys):
                holder = target  # a copy here (a hot segment copied in): read here
            pages = holder.pool.lookup(keys)
            for page in pages:
                holder.pool.incref(page)
            if pages:
                pinned.append((holder, pages))
            keys_done += keys[: len(pages)]
            if len(pages) < len(keys):
                break
        n = len(keys_done) * self.cost.page_size
        if not pinned or n >= req.num_prompt_tokens:
            for holder, pages in pinned:
                _release(holder.pool, pages)
            return
        if queued:
            target.scheduler.give_foreign_prefix(req, n, keys_done[-1])
            self.pinned_queued += 1
        else:
            req.set_foreign_prefix(n, keys_done[-1])
        target.pins[req.request_id] = pinned
        read_peer = sum(len(p) for h, p in pinned if h is not target) * self.cost.page_size
        self.peer_tokens += read_peer
        self.read_peer[req.request_id] = read_peer

    def _pin_due(self, e: _Engine) -> None:
        """Before e's step, as the daemon's PoolHooks._pin_due: its queued requests near the front pin
        their reads (pool/ahead.py); one that finds nothing anywhere asks again when the policy picks
        it or ASK_EVERY later (`asks_again`), and one whose prefix another request is computing waits
        for it (Reads.pending: `_done`, or ASK_EVERY); those admitted without them, or gone, forget
        theirs."""
        sched = e.scheduler
        for rid in list(e.deferred):
            req = sched.requests.get(rid)
            if req is None or req.status is not RequestStatus.WAITING or req.num_computed_tokens:
                del e.deferred[rid]
                e.again_at.pop(rid, None)
        e.later.intersection_update(e.deferred)
        now = self._now = max(self._now, e.clock.now)
        for req in due(sched.waiting, e.deferred, e.pool.num_free, self.cost.page_size, sched.held_back, e.later,
                       e.again_at, now):
            rid = req.request_id
            runs, copies = self.router.reads(self.engines, req.prompt_token_ids, self.config.segment_pages,
                                             e.engine_id, self.rng)
            if self.router.being_computed(rid):
                e.again_at[rid] = now + ASK_EVERY
                e.later.discard(rid)
                continue
            e.again_at.pop(rid, None)
            if asks_again(bool(runs), rid in sched.held_back, lambda: bool(e.kv.match(req).device_pages)):
                e.later.add(rid)
                e.again_at[rid] = now + ASK_EVERY
                continue
            del e.deferred[rid]
            e.later.discard(rid)
            if copies:
                self._copy(e, copies)
            if runs:
                self._pin(e, req, runs, queued=True)

    def _place(self, e: _Engine) -> None:
        """Put the new segments of e's requests whose prompts are computed at their homes (as the
        engine's process does): the home stores the pages it lacks, unreferenced; e unpublishes what
        the home holds. The sender pays the pages' KV on the link at its next step."""
        cost = self.cost
        for rid in list(e.places):
            req = e.scheduler.requests.get(rid)
            if req is not None and req.num_computed_tokens < req.num_prompt_tokens:
                continue
            for home_id, keys in e.places.pop(rid):
                pages = e.pool.lookup(keys)
                if not pages:  # one it read where it is (the pick names every segment's home), or let go of
                    continue
                home = self.engines[home_id]
                held = len(taken := _hold(home.pool, keys[: len(pages)]))
                _release(home.pool, taken)
                e.pool.unpublish([key for key in keys[:held] if key not in e.replicas])
                self.put_pages += held
                e.owe(self.config.link_alpha + self.config.link_time(cost, held * cost.page_size))
                self._update_now(home, keys[:held])

    def _hand_off(self, e: _Engine) -> None:
        """Write into the home, as the daemon's PoolHooks._hand_off: once a running request's prompt
        is computed (by segment, pool/hand_off.py: once a new segment is), its leading pages up to
        its last whole new segment are read where their segments live from then on: its own segments' pages
        pinned where they are, a peer's written into the peer (the pages it lacks; the sender pays
        their KV on the link) and pinned there, up to the first home without room. The request lets
        go of its pages of those, and they stop being cached here; what no home took stays its own
        and is not tried again. The prompt's last whole segment waits for the request's end
        (pool/hand_off.py tail_end, `_hand_off_tail`)."""
        ps, seg = self.cost.page_size, self.config.segment_pages
        for rid in [rid for rid in e.kept if rid not in e.scheduler.requests]:
            self._hand_off_tail(e, *e.kept.pop(rid))
        for rid in list(e.homes):
            req = e.scheduler.requests.get(rid)
            if req is None or req.is_finished:
                del e.homes[rid]
                continue
            whole = req.num_computed_tokens >= req.num_prompt_tokens
            if req.status is not RequestStatus.RUNNING or (
                    not whole and not by_segment(self.config.hand_off, req.num_prompt_tokens, e.pool.num_pages * ps)):
                continue
            homes, ends = e.homes[rid]
            st = e.kv.state(req)
            tail = tail_end(req.num_prompt_tokens, ps, seg)  # (that segment waits for the request's end)
            computed = min(st.num_published_pages, max(tail - 1, 0))
            n = max((i + 1 for i, key in enumerate(st.page_hashes[:computed]) if key in ends), default=0)
            last = st.page_hashes[tail - 1] if whole and 0 < tail <= len(st.page_hashes) else None
            if last in ends and homes[last] != e.engine_id:
                e.kept[rid] = (homes[last], st.page_hashes[tail - seg:tail])
            if not n:
                if whole:
                    del e.homes[rid]
                continue
            keys = st.page_hashes[:n]
            runs: list[tuple[int, list[bytes]]] = []
            for key in keys:
                home = homes.pop(key, e.engine_id)
                ends.discard(key)
                if runs and runs[-1][0] == home:
                    runs[-1][1].append(key)
                else:
                    runs.append((home, [key]))
            if whole or not ends:
                del e.homes[rid]
            got, pinned = 0, e.pins.setdefault(rid, [])
            for home_id, run in runs:
                home = self.engines[home_id]
                if home is e:
                    held = e.pool.lookup(run)
                    for page in held:
                        e.pool.incref(page)
                else:
                    held = self._put(e, home, run)
                if held:
                    pinned.append((home, held))
                got += len(held)
                if len(held) < len(run):
                    break
            if not pinned:
                del e.pins[rid]
            if not got:
                continue
            for page in reversed(e.kv.hand_off(req, got)):
                e.pool.decref(page)
            req.extend_foreign_prefix(got * ps, keys[got - 1])
            away = {k: home for home, run in runs if home != e.engine_id for k in run}
            self._went(e, {k: away[k] for k in keys[:got] if k in away})  # what the homes took, and where

    def _hand_off_tail(self, e: _Engine, home_id: int, keys: list[bytes]) -> None:
        """A finished request's last whole segment, kept in e's cache while it ran (pool/hand_off.py
        tail_end), written into its home as far as e still holds it and the home has room."""
        pages = e.pool.lookup(keys)
        if not pages:
            return
        held = self._put(e, self.engines[home_id], keys[:len(pages)])
        _release(self.engines[home_id].pool, held)
        if held:
            self._went(e, dict.fromkeys(keys[:len(held)], home_id))

    def _put(self, e: _Engine, home: _Engine, keys: list[bytes]) -> list[int]:
        """e writes the leading `keys` it computed into `home` (PoolMember.put): the pages the home
        lacks, as far as it has room; e pays their KV on the link, and the round trip whatever the home
        took. -> the home's pages of the keys it holds now, referenced."""
        fresh = sum(not home.pool.lookup([key]) for key in keys)
        held = _hold(home.pool, keys)
        fresh = min(fresh, len(held))
        self.put_pages += fresh
        e.owe(self.config.link_alpha + self.config.link_time(self.cost, fresh * self.cost.page_size))
        self._update_now(home, keys[:len(held)])
        return held

    def _went(self, e: _Engine, moved: dict[bytes, int]) -> None:
        """Segments e computed are at their homes now (`moved`: key -> home): readers of e's copy
        follow them there, and e stops caching them (after NodeConfig.let_go_after)."""
        if self.config.follow:
            self._follow(e, moved)
        e.letting_go.append((e.clock.now + self.config.let_go_after, list(moved)))

    def _follow(self, e: _Engine, homes: dict[bytes, int]) -> None:
        """As the daemon's PoolMember.follow, told by the front (protocol.Moved): requests on any
        engine that read e's pages of segments e wrote into their homes (`homes`: key -> home) read
        them at the homes from then on, pinned there, e's pins let go of (its copy goes once no one
        reads it). What a home no longer holds stays read on e."""
        for x in self.engines:
            for pins in x.pins.values():
                if not any(holder is e for holder, _ in pins):
                    continue
                out: list[tuple[_Engine, list[int]]] = []
                for holder, pages in pins:
                    moving: dict[int, list[int]] = {}
                    for page in pages if holder is e else ():
                        home = homes.get(e.pool.key_of(page))
                        if home is not None:
                            moving.setdefault(home, []).append(page)
                    gone = {page for mine in moving.values() for page in mine}
                    stay = [page for page in pages if page not in gone]
                    for home_id, mine in moving.items():
                        home = self.engines[home_id]
                        there = home.pool.lookup([e.pool.key_of(page) for page in mine])
                        for page in there:
                            home.pool.incref(page)
                        if there:
                            out.append((home, there))
                        _release(e.pool, mine[: len(there)])
                        stay += mine[len(there):]
                    if stay:
                        out.append((holder, stay))
                pins[:] = out

    @staticmethod
    def _let_go(e: _Engine) -> None:
        """Stop caching on e what its requests wrote into the homes once NodeConfig.let_go_after
        has passed (at the end of its first step after that), but hot segments named to copy in:
        replicas stay."""
        while e.letting_go and e.letting_go[0][0] <= e.clock.now:
            e.pool.unpublish([k for k in e.letting_go.popleft()[1] if k not in e.replicas])

    def _unblock(self, e: _Engine, now: float) -> None:
        """As the daemon's PoolHooks._unblock: an engine that has run nothing for STUCK_SECONDS while
        requests wait, none running, gives its waiting requests' pins back (they compute their prefix
        here)."""
        sched = e.scheduler
        if not e.stuck.expired(now, not (sched.running or sched.loading) and bool(sched.waiting)):
            return
        for req in [r for r in sched.waiting if r.foreign_token_ids]:
            read = self.read_peer.pop(req.request_id, 0)
            if self.records[req.request_id].admit_time is None:  # (hits count at the first admission)
                self.peer_tokens -= read
            sched.take_foreign_prefix(req)
            e.release(req.request_id)
            self.unblocked += 1

    def _effects(self, e: _Engine, finished: list[str], started: list[str]) -> None:
        """What e's step did beyond e, at the step's end (`started`: the requests it gave a first
        token, their prompts computed)."""
        if e.places:
            self._place(e)
        if e.homes or e.kept:
            self._hand_off(e)
        if e.letting_go:
            self._let_go(e)
        added, removed = e.pool.drain_key_events()
        if e.unreported:
            added = [key for key in e.unreported if e.pool.holds(key)] + added
            e.unreported = []
        self._update(e.engine_id, added, removed)
        for rid in started:
            self._done(rid)  # (the front's Supervisor.on_started)
        for rid in finished:
            e.release(rid)
            self.keys.pop(rid, None)
            self._done(rid)
        if self.config.steal and self.mode != "routing":
            self._steal(e, e.clock.now)

    def _done(self, request_id: str) -> None:
        """As the front's Front.done: the requests that waited for what `request_id` computed hear
        where their prefix is now (they ask at their engine's next step)."""
        for waiter in self.router.done(request_id):
            for e in self.engines:
                if waiter in e.again_at:
                    e.again_at[waiter] = -math.inf
                    break

    def _update_now(self, e: _Engine, keys: list[bytes]) -> None:
        """Pages of `keys` a peer put or copied into e just now, into the router's index, with what
        e evicted for them. e's other new keys wait for its step's end (`_effects`): a step publishes
        the pages it computes as it begins, and the router found them on e before they were computed
        (a request arriving meanwhile was sent to e to read a document e was still computing, and
        read it there, not at its homes, while it ran). The daemon's engines report them with the step."""
        added, removed = e.pool.drain_key_events()
        now = set(keys)
        e.unreported += [key for key in added if key not in now]
        self._update(e.engine_id, [key for key in added if key in now], removed)

    def _update(self, engine_id: int, added: list[bytes], removed: list[bytes]) -> None:
        """An engine's key events into the router's index, and the index's word on where chains end
        back to the engines (the daemon's PoolMarks)."""
        self.index.update(engine_id, added, removed)
        if removed:  # (but those cached there again since)
            pool = self.engines[engine_id].pool
            self.engines[engine_id].replicas.difference_update([key for key in removed if not pool.holds(key)])
        for e, (inner, ends) in self.index.drain_marks().items():
            self.engines[e].pool.set_inner(inner, True)
            self.engines[e].pool.set_inner(ends, False)

    def run(self) -> NodeResult:
        pending = deque(self.workload)
        records, computed, local = self.records, 0, 0
        # A step's effects beyond its engine (its prefix events in the router's index, segments put
        # or written into homes, pins let go of) happen when the step ends, not when it starts: an
        # engine whose clock is behind that must not see them yet, nor an arrival before it.
        effects: list[tuple[float, int, _Engine, list[str]]] = []
        samples: list[list[int]] = []
        sample_at, last_arrival = (self.workload[0].arrival_time, self.workload[-1].arrival_time) if self.workload \
            else (0.0, 0.0)
        seq = 0
        while True:
            busy = [e for e in self.engines if e.scheduler.has_unfinished()]
            t = min((e.clock.now for e in busy), default=float("inf"))
            now = min(t, pending[0].arrival_time if pending else float("inf"))
            if effects and effects[0][0] <= now:
                _, _, done, finished, started = heapq.heappop(effects)
                self._effects(done, finished, started)
                continue
            while sample_at <= min(now, last_arrival):
                samples.append([e.work for e in self.engines])
                sample_at += LOAD_WINDOW
            if pending and pending[0].arrival_time <= t:
                self._route(pending.popleft())
                continue
            if not busy:
                break
            e = min(busy, key=lambda x: (x.clock.now, x.engine_id))
            start = e.clock.now
            if e.deferred:
                self._pin_due(e)
            outs = e.core.step()
            batch = e.core.last_batch
            if not len(batch):
                if e.clock.now == start:  # the policy ran nothing: let time pass to the next event
                    _idle_until(e, start + max(self.cost.step_overhead, 1e-3))
                self._unblock(e, start)
                continue
            e.stuck.since = None
            e.busy += e.clock.now - start
            computed += batch.total_tokens
            for rid in batch.request_ids:
                rec = records[rid]
                if rec.admit_time is None:
                    rec.admit_time = start
                    self.router.computing(rid)  # (protocol.Computing, sent as the step begins)
                    req = e.scheduler.requests.get(rid)
                    cached = req.prefix_offset + req.num_cached_tokens if req is not None else \
                        next(o.num_cached_tokens for o in outs if o.request_id == rid)
                    rec.num_cached_tokens = cached
            finished, started = [], []
            for out in outs:
                rec = records[out.request_id]
                if out.new_token_ids:
                    rec.token_times.append(e.clock.now)
                    if len(rec.token_times) == 1:
                        started.append(out.request_id)
                if out.finished:
                    rec.finish_time = e.clock.now
                    finished.append(out.request_id)
            heapq.heappush(effects, (e.clock.now, seq, e, finished, started))
            seq += 1
        for e in self.engines:
            e.core.wait_copies()  # copies still in flight pin pages: let them end
            if e.pool.num_used:
                raise SimulationError(f"engine {e.engine_id}: {e.pool.num_used} KV pages held after every "
                                      "request ended")
            if e.kv.host.pool.num_used:
                raise SimulationError(f"engine {e.engine_id}: {e.kv.host.pool.num_used} host KV pages held after "
                                      "every request ended")
        ordered = [records[w.request_id] for w in self.workload]
        # num_cached_tokens of a pool request counts its peers' prefix too (EngineCoreOutput)
        local = sum(r.num_cached_tokens for r in ordered) - self.peer_tokens
        cost = self.cost
        slo = [(SLO_FACTOR * cost.prefill_time(r.prompt_len),
                SLO_FACTOR * cost.decode_step_time(1, r.prompt_len + r.output_len // 2)) for r in ordered]
        windows = range(max(1, int((last_arrival - self.engines[0].origin) // LOAD_WINDOW)))  # whole ones
        accesses = [[e.accessed.get(w, 0) for e in self.engines] for w in windows]
        cache = [[e.cache_reads.get(w, 0) for e in self.engines] for w in windows]
        served = [[e.served.get(w, 0) for e in self.engines] for w in windows]
        return NodeResult(self.mode, ordered, self.prompt_tokens, local, self.peer_tokens, computed,
                          [e.busy for e in self.engines], self.put_pages, slo, samples, accesses, cache, served)


def link_ridge_rows(cost: CostModel, config: NodeConfig) -> int:
    """The fewest rows of one request whose attention over a page of KV takes at least as long as
    reading that page over the link: from there, read mode's attention in place is bound by its FLOPs,
    as the holder's answer would be (NodeConfig.read_rows)."""
    page = cost.page_size
    return max(1, math.ceil(config.link_time(cost, page) / cost.attention_time(page, 0)))


def simulate_node(cost: CostModel, workload: Sequence[WorkloadRequest], modes: Sequence[str] = MODES,
                  config: NodeConfig = NodeConfig()) -> dict[str, NodeResult]:
    return {mode: NodeSimulator(cost, workload, mode, config).run() for mode in modes}


def ideal_hit_rate(workload: Sequence[WorkloadRequest], page_size: int) -> float:
    """The hit rate no placement can beat: a node whose cache keeps every page computed, each
    request reading the leading pages of its prompt that any request before it had (in arrival
    order, computed the moment they arrive, never evicted). As the engines count hits, whole pages
    only and never the prompt's last token. Where routing's hit rate is already near it, no pool
    can gain much on hits (TokenLake's 1.5x needs routing at two thirds of it or less)."""
    seen: set[bytes] = set()
    hit = total = 0
    for w in workload:
        ids = prompt_token_ids(w, SIM_VOCAB_SIZE)
        keys = chain_page_keys(ids, page_size, [])
        usable = (len(ids) - 1) // page_size  # (never more than the keys)
        n = 0
        while n < usable and keys[n] in seen:
            n += 1
        hit += n * page_size
        total += len(ids)
        seen.update(keys)
    return hit / total if total else 0.0
