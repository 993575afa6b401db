"""Prometheus metrics: engine state read from the supervisor at scrape time, request latencies
observed by the front as it sends tokens.

Engine gauges and the preemption counter come from a collector over the engines' last reported
stats (no copy to keep in sync); the histograms and token counters are ordinary client objects.
Everything lives in the app's own registry, so several daemons can share a process (tests). With
several API server processes (--api-servers N), the histograms and counters are prometheus-client's
multiprocess values (PROMETHEUS_MULTIPROC_DIR, set by the supervisor): any front's /metrics sums
them over every front, live or gone.
"""
from __future__ import annotations

import os
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from tokenflowd.daemon.procstats import process_figures

if TYPE_CHECKING:
    from tokenflowd.daemon.supervisor import Supervisor

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)
class BatchHistogram(Histogram):
    """A Histogram that takes `count` equal samples in one call: the tokens of one SSE event share its
    gap, and a call per token was the front's costliest metric at thousands of streams. Adds to the
    same per-bucket values `observe` does (prometheus-client's `_sum`, `_buckets`, `_upper_bounds`,
    unchanged since 0.4); tests/unit/test_metrics.py checks it matches `count` observes."""

    def observe_many(self, amount: float, count: int) -> None:
        if count <= 0:
            return
        self._raise_if_not_observable()
        self._sum.inc(amount * count)
        for bucket, bound in zip(self._buckets, self._upper_bounds):
            if amount <= bound:
                bucket.inc(count)
                break


_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)
_REBUFFER_BUCKETS = (0, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 40, 80)


def _per_engine(family, slots, value: Callable[[Any], float]):
    """`family` with one sample per engine that has reported stats: value(its stats)."""
    for slot in slots:
        if slot.stats is not None:
            family.add_metric([str(slot.engine_id)], value(slot.stats))
    return family


class EngineCollector(Collector):
    def __init__(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        gauges = {
            "requests_running": ("Requests running in an engine's batch", lambda s: s.num_running),
            "requests_waiting": ("Requests queued or preempted in an engine", lambda s: s.num_waiting),
            "kv_pages_used": ("KV pages referenced by live requests", lambda s: s.kv_pages_used),
            "kv_pages_cached": ("Unreferenced KV pages kept for prefix-cache hits", lambda s: s.kv_pages_cached),
            "kv_pages_total": ("KV pages in an engine's device pool", lambda s: s.kv_pages_total),
            "host_kv_pages_used": ("Host-tier KV pages held by requests or copies in flight",
                                   lambda s: s.host_kv_pages_used),
            "host_kv_pages_cached": ("Unreferenced host-tier KV pages kept for prefix-cache hits",
                                     lambda s: s.host_kv_pages_cached),
            "host_kv_pages_total": ("KV pages in an engine's host tier (0: offload off)", lambda s: s.host_kv_pages_total),
            "kv_remote_pages": ("KV pages held for transfers from prefill nodes that gave up or ended early, until "
                                "the sender can write no more (federation)", lambda s: s.kv_remote_pages),
        }
        for name, (doc, value) in gauges.items():
            g = GaugeMetricFamily(f"tokenflowd_{name}", doc, labels=["engine"])
            for slot in self.supervisor.slots:
                if slot.stats is not None:
                    g.add_metric([str(slot.engine_id)], value(slot.stats))
            yield g
        c = CounterMetricFamily("tokenflowd_preemptions", "Requests preempted (KV freed, resumed later)",
                                labels=["engine"])
        for slot in self.supervisor.slots:
            c.add_metric([str(slot.engine_id)], slot.num_preemptions)
        yield c
        moved = CounterMetricFamily("tokenflowd_kv_offload_pages", "KV pages copied between the device and the host "
                                    "tier (write: device to host; load: host to device)", labels=["engine", "direction"])
        for slot in self.supervisor.slots:
            if slot.stats is not None:
                moved.add_metric([str(slot.engine_id), "write"], slot.stats.kv_pages_written)
                moved.add_metric([str(slot.engine_id), "load"], slot.stats.kv_pages_loaded)
        yield moved
        shed = CounterMetricFamily("tokenflowd_requests_shed", "Requests an engine refused at once because their "
                                   "predicted time to first token exceeded --max-queue-delay", labels=["engine"])
        for slot in self.supervisor.slots:
            if slot.stats is not None:
                shed.add_metric([str(slot.engine_id)], slot.stats.num_shed)
        yield shed
        yield from self._prompt_sources()
        if self.supervisor.engine_config.pool_mode != "off":
            yield from self._pool()
        up = GaugeMetricFamily("tokenflowd_engine_up", "1 while an engine serves", labels=["engine"])
        restarts = CounterMetricFamily("tokenflowd_engine_restarts", "Engine processes restarted", labels=["engine"])
        fallback = GaugeMetricFamily("tokenflowd_engine_fallback", "1 while an engine runs a plainer path because a "
                                     "fast one failed at start-up (/health says which, and why)", labels=["engine"])
        paths = GaugeMetricFamily("tokenflowd_engine_attention", "1 for the attention path each engine runs",
                                  labels=["engine", "attention", "cuda_graphs"])
        for slot in self.supervisor.slots:
            up.add_metric([str(slot.engine_id)], float(slot.ready))
            restarts.add_metric([str(slot.engine_id)], slot.num_restarts)
            if slot.info is not None:
                fallback.add_metric([str(slot.engine_id)], float(bool(slot.info.fallback)))
                paths.add_metric([str(slot.engine_id), slot.info.attention, str(slot.info.cuda_graphs).lower()], 1.0)
        yield up
        yield restarts
        yield fallback
        yield paths
        yield from self._processes()

    def _prompt_sources(self) -> Iterator[CounterMetricFamily]:
        """Where the prompt tokens an engine took came from: its own prefix cache (local), pages a
        peer of the pool holds (peer), or computed (miss). Counted at a request's first admission."""
        c = CounterMetricFamily("tokenflowd_prompt_token_sources", "Prompt tokens by where their KV came from: "
                                "local (the engine's prefix cache), peer (the pool: another engine's pages), miss "
                                "(computed)", labels=["engine", "source"])
        for slot in self.supervisor.slots:
            s = slot.stats
            if s is not None:
                c.add_metric([str(slot.engine_id), "local"], s.hit_tokens)
                c.add_metric([str(slot.engine_id), "peer"], s.peer_tokens)
                c.add_metric([str(slot.engine_id), "miss"], max(0, s.prompt_tokens - s.hit_tokens - s.peer_tokens))
        yield c

    def _pool(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        """The node's prefix-cache pool (--pool-mode query|read)."""
        index, slots = self.supervisor.index, self.supervisor.slots
        pages = GaugeMetricFamily("tokenflowd_pool_pages", "Prefix-cache pages an engine holds for the pool",
                                  labels=["engine"])
        for slot in slots:
            pages.add_metric([str(slot.engine_id)], index.num_keys(slot.engine_id))
        yield pages
        yield GaugeMetricFamily("tokenflowd_pool_replicated_pages", "Prefix-cache pages held by more than one engine "
                                "(each counted once)", value=index.num_replicated())
        loads = [slot.load for slot in slots if slot.ready]
        mean = statistics.fmean(loads) if loads else 0.0
        cv = statistics.pstdev(loads) / mean if mean else 0.0
        yield GaugeMetricFamily("tokenflowd_pool_load_cv", "Coefficient of variation of the requests in flight "
                                "across serving engines", value=cv)
        figures = {
            "tokenflowd_pool_queries": (("Layer queries shipped to peers (query mode; in read mode, the rows of "
                                         "peers that are not read in place: --pool-read-rows)"),
                                        lambda s: s.pool_queries),
            "tokenflowd_pool_reads": (("Layers whose attention over a peer's pages an engine read in place (read "
                                       "mode: the peer's cache mapped)"), lambda s: s.pool_reads),
            "tokenflowd_pool_query_bytes": ("Bytes of shipped query rows and answers", lambda s: s.pool_query_bytes),
            "tokenflowd_pool_query_seconds": ("Time steps waited for peers' answers (divide by queries for the "
                                              "mean latency)", lambda s: s.pool_query_seconds),
            "tokenflowd_pool_put_pages": ("Pages of new segments an engine computed and wrote into their homes on "
                                          "peers",
                                          lambda s: s.pool_put_pages),
            "tokenflowd_pool_stored_pages": ("Pages peers wrote into an engine, their segments' home",
                                             lambda s: s.pool_stored_pages),
            "tokenflowd_pool_copied_pages": ("Pages of heavy hitters an engine read on peers and copied in (replicas "
                                             "its later requests read there)", lambda s: s.pool_copied_pages),
            "tokenflowd_pool_unblocked_requests": ("Waiting requests that gave their pool pins back because their "
                                                   "engine could run nothing (pins held by waiting requests "
                                                   "left no room)", lambda s: s.pool_unblocked),
            "tokenflowd_pool_pinned_queued_requests": ("Requests whose pool reads waited while they were far back in "
                                                       "the queue, pinned once they neared its front",
                                                       lambda s: s.pool_pinned_queued),
            "tokenflowd_pool_resolved_requests": ("Of those, the requests that pinned reads their front named again "
                                                  "as they neared the queue's front (where the pool held their "
                                                  "prefix then)", lambda s: s.pool_resolved),
            "tokenflowd_pool_followed_pages": ("Pages an engine's requests read on a peer that the peer then wrote "
                                               "into their segments' homes, read at the homes from then on",
                                               lambda s: s.pool_followed),
        }
        for name, (doc, value) in figures.items():
            yield _per_engine(CounterMetricFamily(name, doc, labels=["engine"]), slots, value)
        gauges = {
            "tokenflowd_pool_pinned_pages": ("Pages an engine keeps pinned for peers' requests", lambda s: s.pool_pins),
            "tokenflowd_pool_share": ("Share of an engine's time that serving its pool peers took lately (its "
                                      "step-time model is slowed by it)", lambda s: s.pool_share),
        }
        for name, (doc, value) in gauges.items():
            yield _per_engine(GaugeMetricFamily(name, doc, labels=["engine"]), slots, value)

    def _processes(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        """Each live engine process as the OS sees it (psutil): a leaking or spinning engine shows."""
        rss = GaugeMetricFamily("tokenflowd_engine_resident_memory_bytes", "Resident memory of an engine process",
                                labels=["engine"])
        cpu = CounterMetricFamily("tokenflowd_engine_cpu_seconds", "CPU time (user + system) of an engine process",
                                  labels=["engine"])
        threads = GaugeMetricFamily("tokenflowd_engine_threads", "Threads of an engine process", labels=["engine"])
        fds = GaugeMetricFamily("tokenflowd_engine_open_fds", "Open file descriptors (files, sockets, pipes) of an "
                                "engine process", labels=["engine"])
        for slot in self.supervisor.slots:
            f = process_figures(slot.pid)
            if f is None:
                continue
            e = [str(slot.engine_id)]
            rss.add_metric(e, f.rss_bytes)
            cpu.add_metric(e, f.cpu_seconds)
            threads.add_metric(e, f.threads)
            fds.add_metric(e, f.open_fds)
        yield from (rss, cpu, threads, fds)


class Metrics:
    def __init__(self, supervisor: Supervisor) -> None:
        self.registry = CollectorRegistry()  # what /metrics shows
        self.registry.register(EngineCollector(supervisor))
        r = self.registry
        shared = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if shared:  # one of several API server processes: each writes its own files, a scrape sums them all
            MultiProcessCollector(self.registry, path=shared)
            r = CollectorRegistry()  # the objects below write to the files; this registry is never shown
        self.ttft = Histogram("tokenflowd_time_to_first_token_seconds", "Arrival to first token sent",
                              ["engine"], buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = BatchHistogram("tokenflowd_inter_token_latency_seconds", "Time between tokens sent to a client, "
                             "one sample per token (the tokens of one SSE event share its gap)",
                             ["engine"], buckets=_ITL_BUCKETS, registry=r)
        self.sse_events = Counter("tokenflowd_sse_events", "SSE events carrying tokens sent to streaming clients "
                                  "(fewer than tokens where coalescing gathered them), counted as streams end",
                                  registry=r)
        self.connections_refused = Counter("tokenflowd_connections_refused", "Connections refused or closed by the "
                                          "front: limit (--max-connections), header_timeout (slow request head)",
                                          ["reason"], registry=r)
        self.e2e = Histogram("tokenflowd_e2e_request_latency_seconds", "Arrival to the last token sent",
                             ["engine"], buckets=_LATENCY_BUCKETS, registry=r)
        self.rebuffer = Histogram("tokenflowd_rebuffer_seconds",
                                  "Per request: time its client stalled with an empty buffer at its reading rate",
                                  ["engine"], buckets=_REBUFFER_BUCKETS, registry=r)
        self.prompt_tokens = Counter("tokenflowd_prompt_tokens", "Prompt tokens of admitted requests",
                                     ["engine"], registry=r)
        self.generation_tokens = Counter("tokenflowd_generation_tokens", "Tokens generated", ["engine"], registry=r)
        self.requests = Counter("tokenflowd_requests", "Requests finished, by outcome", ["engine", "outcome"],
                                registry=r)
        self.rejected = Counter("tokenflowd_requests_rejected", "Requests refused before a first token (the waiting "
                                "bound, an engine's --max-queue-delay), by HTTP status",
                                ["status"], registry=r)
        self.refused = Counter("tokenflowd_requests_refused", "Requests answered with a refusal (400, 401, 403, 404, "
                               "405, 408, 409, 413, 429, 503), by status and reason (the error's code)",
                               ["status", "reason"], registry=r)
        self.loop_lag = Histogram("tokenflowd_event_loop_lag_seconds", "How late the API server's event loop woke "
                                  "from a 0.1 s sleep: time no stream and no request was served",
                                  buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0), registry=r)
        self.federation = Counter("tokenflowd_federation_prefills", "Federation: prompts a prefill node computed for a "
                                  "decode node (side prefill), those a decode node asked for (side decode), replies' "
                                  "KV a decode node gave back to its prefill node (side return), and longer prefixes "
                                  "a prefill node pulled from another before it computed a prompt (side pull), by "
                                  "outcome (ok, or failed: the prompt was computed without it)", ["side", "outcome"],
                                  registry=r)
        self.moved = Counter("tokenflowd_pool_moved_requests", "The pool: queued requests that had started nothing, "
                             "given back by the engine with the longest queue and sent to an idle engine, by the "
                             "engine they left", ["engine"], registry=r)
        for side in ("prefill", "decode", "return", "pull"):
            for outcome in ("ok", "failed"):
                self.federation.labels(side, outcome)  # every series from 0
        self._engines: dict[int, EngineMetrics] = {}

    def engine(self, engine_id: int) -> EngineMetrics:
        """The metrics of one engine's requests, label lookups done once (they are per token)."""
        m = self._engines.get(engine_id)
        if m is None:
            e = str(engine_id)
            m = self._engines[engine_id] = EngineMetrics(
                self.ttft.labels(e), self.itl.labels(e), self.e2e.labels(e), self.rebuffer.labels(e),
                self.prompt_tokens.labels(e), self.generation_tokens.labels(e),
                lambda outcome: self.requests.labels(e, outcome))
        return m


@dataclass(frozen=True, slots=True)
class EngineMetrics:
    ttft: Any
    itl: Any
    e2e: Any
    rebuffer: Any
    prompt_tokens: Any
    generation_tokens: Any
    requests: Callable[[str], Any]  # outcome -> counter
