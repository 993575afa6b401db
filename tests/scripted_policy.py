"""A policy for tests: FCFS plus the preemptions a script names, step by step."""
from __future__ import annotations

from typing import Callable

from tokenflowd.buffer.fcfs import FCFSPolicy
from tokenflowd.buffer.policy import Plan, SchedulerView, SchedulingPolicy


class ScriptedPolicy(SchedulingPolicy):
    """FCFS, plus whatever preemptions `preempt(step, view)` names; every admitted request whose
    KV the host holds is reloaded when `reload` says so (else the scheduler picks the faster way)."""

    name = "scripted"

    def __init__(self, preempt: Callable[[int, SchedulerView], tuple[str, ...]], reload: bool = True) -> None:
        self.fcfs = FCFSPolicy()
        self.preempt = preempt
        self.reload = reload
        self.num_plans = 0

    def plan(self, view: SchedulerView) -> Plan:
        plan = self.fcfs.plan(view)
        victims = self.preempt(self.num_plans, view)
        self.num_plans += 1
        scheduled = tuple((rid, n) for rid, n in plan.scheduled if rid not in victims)
        reload = tuple(r.request_id for r in view.waiting if self.reload and r.host_tokens)
        return Plan(scheduled, tuple(dict.fromkeys(plan.preempted + victims)), reload)
