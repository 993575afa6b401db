"""First come, first served with prefill first: what SGLang and vLLM do by default.

Prompt chunks (of running requests mid-prompt, then of waiting requests in arrival order) take the
step's token budget first; decodes share what is left. A waiting request that does not fit blocks
the ones behind it. When a running request cannot get a page, the newest running request is
preempted (its KV is recomputed later); the oldest running request can therefore always progress,
so the engine never deadlocks on memory.
"""
from __future__ import annotations

from tokenflowd.buffer.policy import Plan, RequestView, SchedulerView, SchedulingPolicy


class FCFSPolicy(SchedulingPolicy):
    name = "fcfs"

    def __init__(self, watermark: float = 0.01) -> None:
        self.watermark = watermark  # fraction of pages admission leaves free for running requests to grow

    def plan(self, view: SchedulerView) -> Plan:
        ps = view.page_size
        budget, free = view.token_budget, view.free_pages
        scheduled: dict[str, int] = {}
        preempted: list[str] = []
        victims = list(view.running)  # arrival order: preempted from the end

        def room(req: RequestView) -> int:
            """Tokens of `req` that fit in its pages plus the free ones."""
            return (req.pages_held + free) * ps - req.num_computed_tokens

        def run(req: RequestView, n: int) -> None:
            """Schedule up to n tokens of a running request, preempting newer ones for a page."""
            nonlocal budget, free
            while room(req) < 1:
                victim = next((v for v in reversed(victims) if v.request_id not in scheduled), None)
                victims.remove(victim)  # victim is req itself at worst: it has a page or free > 0
                preempted.append(victim.request_id)
                free += victim.pages_held
                if victim is req:
                    return
            n = min(n, room(req))
            scheduled[req.request_id] = n
            budget -= n
            free -= req.pages_to_run(n, ps)

        decoding = [r for r in view.running if r.tokens_left == 1]
        for req in view.running:
            if budget == 0:
                break
            if req.tokens_left > 1 and req.request_id not in preempted:
                run(req, min(req.tokens_left, budget))

        # Admission leaves room for this step's decodes and a watermark for growth; with nothing
        # running it takes what there is, so a prompt as large as the pool still gets in.
        reserve = int(self.watermark * view.total_pages) + sum(r.pages_to_run(1, ps) for r in decoding)
        if not victims:
            reserve = 0
        num_running = len(victims)
        for req in view.waiting:
            if budget == 0 or num_running >= view.max_num_seqs:
                break
            n = min(req.tokens_left, budget)
            need = req.pages_to_run(n, ps)
            if need > free - reserve:
                break  # head-of-line: nothing behind it jumps the queue
            scheduled[req.request_id] = n
            budget -= n
            free -= need
            num_running += 1

        for req in decoding:
            if budget == 0:
                break
            if req.request_id not in preempted:
                run(req, 1)

        return Plan(scheduled=tuple(scheduled.items()), preempted=tuple(preempted))
