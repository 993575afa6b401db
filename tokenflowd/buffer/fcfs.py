"""First come, first served with prefill first: what SGLang and vLLM do by default.

Prefill chunks (of running requests mid-prompt, then of waiting requests in arrival order) take the
step's token budget first; decodes share what is left. A waiting request that does not fit blocks
the ones behind it. Under memory pressure the newest running request is preempted (recompute).
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
        victims = list(view.running)  # preempted from the end: the newest first

        def make_room(req: RequestView, need: int) -> bool:
            nonlocal free
            while need > free:
                victim = next((v for v in reversed(victims) if v.request_id not in scheduled), None)
                if victim is None or victim is req:
                    return False
                victims.remove(victim)
                preempted.append(victim.request_id)
                free += victim.pages_held
            return True

        prefilling = [r for r in view.running if r.tokens_left > 1]
        decoding = [r for r in view.running if r.tokens_left == 1]
        for req in prefilling:
            if budget == 0:
                break
            if req.request_id in preempted:
                continue
            n = min(req.tokens_left, budget)
            # A prompt chunk shrinks to the room there is rather than preempting others.
            n = min(n, (req.pages_held + free) * ps - req.num_computed_tokens)
            if n <= 0:
                continue
            scheduled[req.request_id] = n
            budget -= n
            free -= req.pages_to_run(n, ps)

        # Admission leaves room for this step's decodes and a watermark for growth.
        reserve = int(self.watermark * view.total_pages) + sum(r.pages_to_run(1, ps) for r in decoding)
        num_running = len(view.running)
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
            if req.request_id in preempted:
                continue
            need = req.pages_to_run(1, ps)
            if not make_room(req, need):
                preempted.append(req.request_id)  # it cannot grow: give its pages to the others
                victims.remove(req)
                free += req.pages_held
                continue
            scheduled[req.request_id] = 1
            budget -= 1
            free -= need

        return Plan(scheduled=tuple(scheduled.items()), preempted=tuple(preempted))
