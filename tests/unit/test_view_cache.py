"""The scheduler's view keeps a waiting request's prefix match (kv.view_matches) and, before its
first token, its whole RequestView from one step to the next. Under any preempt / resume / abort
schedule, with every tier, each waiting request's view must equal one built afresh from a new
walk of the tiers; and the schedules must have reached both the kept and the moved cases."""
from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scripted_policy import ScriptedPolicy
from test_offload import PAGE, make, page_bytes

from tokenflowd.buffer.estimates import OutputLengthModel
from tokenflowd.buffer.policy import SchedulerView
from tokenflowd.engine.core import EngineCore
from tokenflowd.engine.request import Request, SamplingParams
from tokenflowd.engine.scheduler import _request_view

FAMILIES = [[5 + 7 * f + i for i in range(64)] for f in range(3)]  # shared prefixes: hits in every tier
MATCH_FIELDS = ("device_pages", "num_evictable", "num_load_tokens", "num_pages_to_load", "num_disk_pages",
                "num_unwritten_pages", "io_time", "sources")


def check_view(core: EngineCore, view: SchedulerView, last: dict, seen: Counter) -> None:
    """Each waiting view against one built from kv.match now; counts which were kept."""
    s, kv = core.scheduler, core.kv
    for v in view.waiting:
        r = s.requests[v.request_id]
        kept, fresh = s._matches[r.request_id], kv.match(r)
        for f in MATCH_FIELDS:
            assert getattr(kept, f) == getattr(fresh, f), (r.request_id, f, getattr(kept, f), getattr(fresh, f))
        e = float(s._expected_outputs([r])[0])
        want = _request_view(r, view.now, fresh.num_device_pages * PAGE, fresh.num_device_pages, e,
                             fresh.num_evictable, io_time=fresh.io_time, host_tokens=fresh.num_load_tokens,
                             dry_for=r.buffer.dry_for(view.now))
        assert v == want, (v, want)
        before = last.get(r.request_id)
        if before is not None:
            seen["kept" if before[0] is kept else "moved"] += 1
            seen["view kept"] += before[1] is v
        last[r.request_id] = (kept, v)


schedules = st.fixed_dictionaries({
    "mode": st.sampled_from(["write-through", "write-back", "none"]),
    "step_overlap": st.booleans(),
    "host_pages": st.sampled_from([6, 64]),
    "disk": st.booleans(),
    "prefix_caching": st.booleans(),
    "num_pages": st.sampled_from([14, 24]),  # 14: requests wait, and cached pages are evicted
    "prompts": st.lists(st.tuples(st.integers(0, 2), st.integers(3, 44), st.integers(0, 6)), min_size=2, max_size=7),
    "preempt": st.lists(st.integers(0, 15), min_size=5, max_size=40),
    "reload": st.booleans(),
    "abort": st.one_of(st.none(), st.tuples(st.integers(0, 6), st.integers(0, 30))),
})


def test_a_kept_view_equals_a_fresh_one_under_any_schedule(tiny, tmp_path_factory):
    seen: Counter = Counter()

    @settings(max_examples=60, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(s=schedules)
    def check(s):
        def preempt(step: int, view: SchedulerView) -> tuple[str, ...]:
            bits = s["preempt"][step] if step < len(s["preempt"]) else 0
            return tuple(r.request_id for i, r in enumerate(view.running) if bits >> i & 1)

        pb = page_bytes(tiny)
        core = make(tiny, ScriptedPolicy(preempt, s["reload"]), offload=s["mode"], overlap=s["step_overlap"],
                    num_pages=s["num_pages"], host_kv_memory=s["host_pages"] * pb,
                    disk_kv_memory=32 * pb if s["disk"] and s["mode"] != "none" else 0,
                    disk_kv_dir=str(tmp_path_factory.mktemp("disk")), enable_prefix_caching=s["prefix_caching"])
        # predictions learned from the first finished request on (so that they move during the run)
        core.scheduler.output_lengths = OutputLengthModel(core.scheduler.output_lengths.prior, min_samples=1)
        last: dict = {}
        build = core.scheduler._view

        def checked() -> SchedulerView:
            view = build()
            check_view(core, view, last, seen)
            return view

        core.scheduler._view = checked
        reqs = []
        try:
            for step in range(3000):
                # requests arrive over the run, so some wait behind others' pages
                for i, (fam, n, at) in enumerate(s["prompts"]):
                    if at == step:
                        reqs.append(Request(f"r{i}", FAMILIES[fam][:n],
                                            SamplingParams(temperature=0, max_tokens=4 + i, ignore_eos=True)))
                        core.add_request(reqs[-1])
                if s["abort"] and s["abort"][1] == step and s["abort"][0] < len(reqs):
                    core.abort(reqs[s["abort"][0]].request_id)
                if step > 6 and not core.has_unfinished():
                    break
                core.step()
            assert not core.has_unfinished()
        finally:
            core.close()

    check()
    # the kept path ran, and so did the cases where what a match read had moved
    assert seen["kept"] > 100 and seen["view kept"] > 50 and seen["moved"] > 20, seen
