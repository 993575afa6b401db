"""First come, first served, with preemption by recompute under memory pressure.

Memory goes by age: every running request, oldest first, is given room for its next token; when
there is none, the newest running requests are preempted (their KV is recomputed later). So the
oldest running request always progresses and memory never livelocks the engine.

The token budget: each running decode keeps its one token per step; prompt chunks fill the rest,
those of running requests mid-prompt first, then waiting requests in arrival order (a waiting
request that does not fit blocks the ones behind it). Decodes come first in the budget because with
recompute preemption a prompt-only step order can starve decodes forever: preempted prompts come
back as new prompt work and take every step's budget (seen with a 4-token budget and 10 pages).
"""
from __future__ import annotations

from tokenflowd.buffer.policy import Plan, SchedulerView, SchedulingPolicy


class FCFSPolicy(SchedulingPolicy):
    name = "fcfs"

    def __init__(self, watermark: float = 0.01) -> None:
        self.watermark = watermark  # fraction of pages admission leaves free for running requests to grow

    def plan(self, view: SchedulerView) -> Plan:
        ps = view.page_size
        free = view.free_pages
        preempted: list[str] = []

        # 1. Memory by age: room for one more token each, preempting from the newest end.
        kept = list(view.running)
        i = 0
        while i < len(kept):
            req = kept[i]
            need = req.pages_to_run(1, ps)
            while need > free and len(kept) > i + 1:
                victim = kept.pop()  # the newest: it has reserved nothing yet
                preempted.append(victim.request_id)
                free += victim.pages_freed
            if need > free:
                kept.pop()  # req is now the newest: it yields its pages to the older ones
                preempted.append(req.request_id)
                free += req.pages_freed
                break
            free -= need
            i += 1

        # 2. The budget: one token for each decode, oldest first.
        budget = view.token_budget
        scheduled: dict[str, int] = {}
        for req in kept:
            if req.tokens_left == 1 and budget > 0:
                scheduled[req.request_id] = 1
                budget -= 1

        # 3. Prompt chunks of running requests, growing into free pages beyond their reserved one.
        for req in kept:
            if req.tokens_left > 1 and budget > 0:
                reserved = req.pages_to_run(1, ps)
                room = (req.pages_held + reserved + free) * ps - req.num_computed_tokens
                n = min(req.tokens_left, budget, room)
                scheduled[req.request_id] = n
                budget -= n
                free -= req.pages_to_run(n, ps) - reserved

        # 4. Admission from what is left, keeping a watermark of pages for running requests to grow.
        reserve = int(self.watermark * view.total_pages) if kept else 0
        num_seqs = len(kept)
        for req in view.waiting:
            if budget == 0 or num_seqs >= view.max_num_seqs:
                break
            n = min(req.tokens_left, budget)
            need = req.pages_to_run(n, ps)
            if need > free - reserve:
                break  # head-of-line: nothing behind it jumps the queue
            scheduled[req.request_id] = n
            budget -= n
            free -= need
            num_seqs += 1

        return Plan(scheduled=tuple(scheduled.items()), preempted=tuple(preempted))
