"""The buffer-balancing pass's working set W (tokenflow.txt §4.2): running requests, then loading
ones, then preempted ones whose clients read, as numpy columns; their swap tiers and utility.

Every quantity here is a numpy column, built once per pass; the rules over them never loop over
RequestViews.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tokenflowd.buffer.policy import RequestView, SchedulerView
from tokenflowd.buffer.qos import effective_weights

# Swap tiers of the working set (swap_tiers), in the order the greedy fill takes them.
PINNED_RUNNING, URGENT, SAFE_RUNNING, IDLE_RUNNING, RESTING, DORMANT = 0, 1, 2, 3, 4, 5


@dataclass(slots=True)
class WorkingSet:
    """The pass's working set W as columns: running requests first, in arrival order, then loading
    ones, then preempted ones in queue order; one numpy array per quantity."""

    reqs: list[RequestView]
    num_running: int
    num_on_device: int  # running, then loading (admitted, KV coming back): reqs[num_running:num_on_device]
    num_tokens: np.ndarray  # int64
    rate: np.ndarray  # tokens/s its client reads
    buffer: np.ndarray  # tokens its client holds unread now
    b_pred: np.ndarray  # tokens buffered once its overhead has passed: b − r·overhead, ≥ 0
    overhead: np.ndarray  # s before it produces again: 0 running, else min(t_IO, t_recompute)
    expected: np.ndarray  # output tokens it is expected to produce in all
    reloaded: np.ndarray  # bool: its overhead is the host tier's t_IO, not a recompute
    away: np.ndarray  # running: s it would take to come back if preempted now, min(t_IO, t_recompute)
    dry: np.ndarray  # s its client has waited on an empty buffer


def build_working_set(view: SchedulerView, members: list[RequestView], expected_output_len: float) -> WorkingSet:
    """W as columns. A request's expected output: the engine's prediction, else its max_tokens,
    else `expected_output_len`."""
    nr, nd = len(view.running), len(view.running) + len(view.loading)
    reqs = [*view.running, *view.loading, *members]
    num_tokens = np.array([r.num_tokens for r in reqs], dtype=np.int64)
    rate = np.array([r.reading_rate for r in reqs], dtype=np.float64)
    buffer = np.array([r.buffer for r in reqs], dtype=np.float64)
    expected = np.array([r.expected_output_tokens or r.max_output_tokens or expected_output_len for r in reqs],
                        dtype=np.float64)
    dry = np.array([r.dry_for for r in reqs], dtype=np.float64)
    computed = np.array([r.num_computed_tokens for r in reqs], dtype=np.int64)
    io = np.array([math.inf if r.io_time is None else r.io_time for r in reqs], dtype=np.float64)
    per_token = view.cost.recompute_time(1)  # linear in tokens
    overhead = np.zeros(len(reqs))
    overhead[nd:] = per_token * (num_tokens[nd:] - computed[nd:])
    reloaded = np.zeros(len(reqs), dtype=bool)
    reloaded[nd:] = io[nd:] < overhead[nd:]  # a host copy, and loading it is faster than recomputing
    overhead[reloaded] = io[reloaded]
    b_pred = np.maximum(buffer - rate * overhead, 0.0)
    away = np.minimum(per_token * num_tokens[:nr], io[:nr])
    return WorkingSet(reqs, nr, nd, num_tokens, rate, buffer, b_pred, overhead, expected, reloaded, away, dry)


def swap_tiers(ws: WorkingSet, interval: float, mu: float) -> tuple[np.ndarray, np.ndarray]:
    """The swap tier of each request in W (lower goes first in the greedy fill), and which
    running ones a *new* request may displace (§4.2.1's rule, μ× the time away):
        PINNED_RUNNING  running, its buffer would not last the shortest time away (its
                        recompute or reload plus one pass): must stay; and every loading one
        URGENT          preempted, its buffer down to μ× its way back plus a pass: must return
        SAFE_RUNNING    running, its buffer outlasts a swap: may make way for an urgent one
        RESTING         preempted with buffer to spare, its next tokens worth their full
                        weight (§7.1.3: buffer within 10% of its expected output)
        IDLE_RUNNING    running, its buffer covers μ× its time away and its next tokens are
                        worth less than half (buffer past 15% of its output): it makes way
                        for a resting member or a new request
        DORMANT         preempted, buffer to spare and tokens worth less than their full weight
    RESTING before IDLE_RUNNING before DORMANT, with the hysteresis between 10% and 15%, is
    what keeps a long burst's readers fed in turns: a running request whose reader is far
    ahead yields to one that is catching up, and not back and forth."""
    index = np.arange(len(ws.reqs))
    running = index < ws.num_running
    seconds = ws.buffer / ws.rate
    away = np.zeros(len(ws.reqs))
    away[: ws.num_running] = ws.away
    away += interval  # a running request's time away if preempted now
    back = ws.overhead + interval  # a preempted request's way back (io or recompute) plus a pass
    weight = effective_weights(ws.b_pred, ws.expected)
    victim = running & (seconds >= mu * away)
    tier = np.where(running, np.where(seconds >= away, SAFE_RUNNING, PINNED_RUNNING),
                    np.where(seconds <= mu * back, URGENT, np.where(weight >= 1.0, RESTING, DORMANT)))
    tier[victim & (weight < 0.5)] = IDLE_RUNNING
    tier[ws.num_running: ws.num_on_device] = PINNED_RUNNING  # its load is under way: it stays
    return tier, victim


def buffer_utility(ws: WorkingSet, g: float, interval: float, stall_penalty: float) -> np.ndarray:
    """U = v·(t − overhead) + γ·e^(−b_pred / r), with v = g·w(b_pred) (the §7.1.3 weight)."""
    v = g * effective_weights(ws.b_pred, ws.expected)
    return v * np.maximum(interval - ws.overhead, 0.0) + stall_penalty * np.exp(-ws.b_pred / ws.rate)
