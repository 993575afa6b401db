"""The hierarchical KV cache (offload/) on a tiny model, CPU: greedy output unchanged by any
preempt / resume schedule, byte-identical KV through host and disk, no page leaked in any tier,
written-through pages freed at once on preemption, pages pinned while a copy uses them."""
from __future__ import annotations

import threading
from collections import Counter
from typing import Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scripted_policy import ScriptedPolicy

from tokenflowd.buffer.policy import SchedulerView, SchedulingPolicy
from tokenflowd.config import EngineConfig
from tokenflowd.engine.core import EngineCore
from tokenflowd.engine.request import Request, RequestStatus, SamplingParams
from tokenflowd.engine.scheduler import ScheduledBatch
from tokenflowd.kv.copier import LOAD, WRITE, CopyJob
from tokenflowd.offload.copier import ThreadCopier
from tokenflowd.kv.pages import chain_page_keys
from tokenflowd.offload.tiers import DiskTier

PAGE = 4
FAMILIES = [[5 + 7 * f + i for i in range(48)] for f in range(3)]  # shared prefixes: prefix hits in every tier


def make(tiny, policy: SchedulingPolicy | None = None, **kw) -> EngineCore:
    base = dict(model="tiny", device="cpu", dtype="float32", page_size=PAGE, num_pages=24,
                max_num_batched_tokens=16, max_num_seqs=4)
    core = EngineCore.from_config(EngineConfig.resolve(**{**base, **kw}), tiny)
    if policy is not None:
        core.scheduler.policy = policy
    return core


def page_bytes(tiny) -> int:
    from tokenflowd.engine.runner import page_bytes as bytes_of_page

    return bytes_of_page(tiny.config, PAGE, torch.float32)


def device_pages(core: EngineCore) -> torch.Tensor:
    """[num_pages + 1, layers, *rest]: page i of every layer is row i."""
    return core.runner.kv_cache.movedim(1 + core.runner.attn.page_axis, 0)


def check_tiers(core: EngineCore) -> None:
    """Every page's reference count in each tier is exactly the tables holding it plus the pins
    of copies in flight."""
    kv = core.kv
    dev = Counter(p for r in core.scheduler.requests.values() for p in kv.block_table(r))
    host = Counter(p for r in core.scheduler.requests.values() for p in kv.state(r).host_pages)
    pins = kv.pins()
    dev.update(pins[0])
    host.update(pins[1])
    for page in range(core.pool.num_pages):
        assert core.pool.ref_count(page) == dev[page], f"device page {page}"
    for page in range(kv.host.num_pages):
        assert kv.host.pool.ref_count(page) == host[page], f"host page {page}"
    for r in core.scheduler.waiting:
        assert not kv.block_table(r)


def run(core: EngineCore, prompts: list[list[int]], max_tokens: list[int],
        abort_at: dict[int, int] | None = None) -> dict[str, list[int]]:
    reqs = [Request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))
            for i, (p, m) in enumerate(zip(prompts, max_tokens))]
    for r in reqs:
        core.add_request(r)
    for step in range(3000):  # a cap: a livelock fails instead of hanging
        if not core.has_unfinished():
            break
        for i, at in (abort_at or {}).items():
            if at == step:
                core.abort(reqs[i].request_id)
        core.step()
        check_tiers(core)
    assert not core.has_unfinished()
    core.wait_copies()
    check_tiers(core)
    assert core.pool.num_used == 0
    assert core.kv.host.pool.num_used == 0 and not core.scheduler.loading
    return {r.request_id: r.output_token_ids for r in reqs}


_REFERENCE: dict[tuple, list[int]] = {}


def reference(tiny, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    """Each request's uninterrupted run (roomy pool, no host tier), computed once per prompt."""
    keys = [(tuple(p), m) for p, m in zip(prompts, max_tokens)]
    todo = [k for k in dict.fromkeys(keys) if k not in _REFERENCE]
    if todo:
        core = make(tiny, num_pages=400, offload="none", max_num_seqs=16, overlap=False)
        out = run(core, [list(p) for p, _ in todo], [m for _, m in todo])
        _REFERENCE.update({k: out[f"r{i}"] for i, k in enumerate(todo)})
    return [_REFERENCE[k] for k in keys]


# -- greedy equivalence under any preempt / resume schedule ------------------------------------------------
schedules = st.fixed_dictionaries({
    "mode": st.sampled_from(["write-through", "write-back", "none"]),
    "overlap": st.booleans(),
    "step_overlap": st.booleans(),  # overlap scheduling (engine/core.py): the next step launched before this one ends
    "host_pages": st.sampled_from([6, 64]),  # 6: the host fills up, and writes stop short
    "disk": st.booleans(),
    "prompts": st.lists(st.tuples(st.integers(0, 2), st.integers(3, 40)), min_size=1, max_size=4),
    "max_tokens": st.lists(st.integers(2, 14), min_size=4, max_size=4),
    "preempt": st.lists(st.integers(0, 15), min_size=5, max_size=40),  # per step: a bit per running request
    "reload": st.booleans(),
    "prefix_caching": st.booleans(),  # off: nothing survives on the device, every resume loads
    "abort": st.one_of(st.none(), st.tuples(st.integers(0, 3), st.integers(0, 30))),
})

def test_greedy_tokens_equal_the_uninterrupted_run_under_any_preempt_resume_schedule(tiny, tmp_path_factory):
    """Every schedule hypothesis draws keeps each request's greedy tokens; and the schedules drawn
    reached every path (a property test is only as good as what its schedules reach)."""
    coverage: Counter = Counter()

    @settings(max_examples=100, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(s=schedules)
    def check(s):
        prompts = [FAMILIES[f][:n] for f, n in s["prompts"]]
        max_tokens = s["max_tokens"][: len(prompts)]
        expected = reference(tiny, prompts, max_tokens)

        def preempt(step: int, view: SchedulerView) -> tuple[str, ...]:
            bits = s["preempt"][step] if step < len(s["preempt"]) else 0
            return tuple(r.request_id for i, r in enumerate(view.running) if bits >> i & 1)

        pb = page_bytes(tiny)
        core = make(tiny, ScriptedPolicy(preempt, s["reload"]), offload=s["mode"], load_evict_overlap=s["overlap"],
                    overlap=s["step_overlap"],
                    host_kv_memory=s["host_pages"] * pb,
                    disk_kv_memory=32 * pb if s["disk"] and s["mode"] != "none" else 0,
                    disk_kv_dir=str(tmp_path_factory.mktemp("disk")), enable_prefix_caching=s["prefix_caching"])
        assert not core.kv.can_reload or core.kv.page_bytes == pb
        abort_at = {s["abort"][0]: s["abort"][1]} if s["abort"] and s["abort"][0] < len(prompts) else {}
        try:
            got = run(core, prompts, max_tokens, abort_at)
        finally:
            core.close()
        for i, want in enumerate(expected):
            tokens = got[f"r{i}"]
            if i in abort_at:
                assert tokens == want[: len(tokens)]
            else:
                assert tokens == want, f"r{i}"
        coverage["preemptions"] += core.scheduler.num_preemptions
        coverage["pages_loaded"] += core.kv.stats.pages_loaded
        coverage["overlapped_preemptions"] += core.scheduler.num_preemptions if core.overlap else 0
        coverage["pages_evicted"] += core.kv.stats.pages_evicted
        coverage["pages_shared"] += core.kv.stats.pages_shared
        coverage["host_full"] += core.kv.stats.host_full
        coverage["disk_reads"] += core.kv.host.disk.num_reads if core.kv.host.disk else 0

    check()
    assert coverage["preemptions"] > 50 and coverage["overlapped_preemptions"] > 20, coverage
    assert coverage["pages_loaded"] > 50 and coverage["pages_evicted"] > 10, coverage
    assert coverage["host_full"] > 0 and coverage["pages_shared"] > 0, coverage


# -- byte-identical round trips ----------------------------------------------------------------------------
def test_copier_round_trip_is_byte_identical():
    g = torch.Generator().manual_seed(0)
    dev = torch.randn(10, 3, 2, 4, 8, generator=g)  # [pages, layers, *rest]
    host = torch.zeros(6, 3, 2, 4, 8)
    copier = ThreadCopier(dev, host)
    try:
        before = dev.clone()
        copier.submit(CopyJob(WRITE, [7, 2, 5], [3, 4, 0], 0))
        copier.wait()
        assert [j.lane for j in copier.poll()] == [WRITE]
        dev[[7, 2, 5]] = float("nan")
        copier.submit(CopyJob(LOAD, [7, 2, 5], [3, 4, 0], 0))
        copier.wait()
        copier.poll()
        assert torch.equal(dev.view(torch.int32), before.view(torch.int32))  # bit for bit
    finally:
        copier.close()


def test_disk_tier_round_trip_is_byte_identical_and_evicts_least_recently_used(tmp_path):
    page = torch.randn(3, 2, 4, 8)
    disk = DiskTier(str(tmp_path), 2, page.numel() * 4)
    try:
        disk.put(b"a", page)
        disk.put(b"b", page * 2)
        out = torch.empty_like(page)
        assert disk.get(b"a", out) and torch.equal(out, page)  # a is now the most recent
        disk.put(b"c", page * 3)  # the file holds two: b goes
        assert b"b" not in disk and disk.get(b"c", out) and torch.equal(out, page * 3)
        assert not disk.get(b"b", out)
        assert list(tmp_path.iterdir()) == []  # the file is unlinked: nothing outlives the process
    finally:
        disk.close()


def step_until(core: EngineCore, cond: Callable[[], bool], limit: int = 200) -> None:
    for _ in range(limit):
        if cond():
            return
        core.step()
    raise AssertionError("condition never held")


def test_a_resumed_request_has_byte_identical_kv(tiny):
    """Device -> host -> device: the pages a resumed request gets back hold exactly the bytes it
    had when it was preempted (prefix caching off, so every page comes back by a load)."""
    victim: list[str] = []
    core = make(tiny, ScriptedPolicy(lambda step, view: tuple(victim)), enable_prefix_caching=False)
    req = Request("a", FAMILIES[0][:30], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    core.add_request(req)
    step_until(core, lambda: req.num_output_tokens >= 5)
    core.drain()  # the step in flight (overlap scheduling) has written its KV
    n_pages = -(-req.num_computed_tokens // PAGE)  # a partial last page: 30 + 4 computed tokens
    snapshot = device_pages(core)[core.kv.block_table(req)[:n_pages]].clone()
    victim.append("a")
    core.step()  # preempted; the pages the host lacked are written, then freed
    victim.clear()
    assert req.status is RequestStatus.PREEMPTED and core.scheduler.num_preemptions == 1
    core.wait_copies()
    device_pages(core)[: core.pool.num_pages] = float("nan")  # nothing on the device survives
    core.step()  # admitted: LOADING
    assert req.status is RequestStatus.LOADING
    while req.status is RequestStatus.LOADING:  # the loads end; the request runs again (no step computes)
        core.wait_copies()
        core.scheduler.issue_copies(ScheduledBatch())
    assert req.status is RequestStatus.RUNNING and req.num_computed_tokens == 34
    got = device_pages(core)[core.kv.block_table(req)[:n_pages]]
    assert torch.equal(got.view(torch.int32), snapshot.view(torch.int32))
    core.close()


def test_prefix_pages_come_back_from_the_disk_tier_byte_identical(tiny, tmp_path):
    """A finished request's prefix pages: written through to the host, spilled to disk when the
    host fills, evicted from the device, then loaded back for a new request with that prefix."""
    pb = page_bytes(tiny)
    # The policy plans the load: left to the timed costs, a tiny model's fitted per-token cost on a
    # loaded machine can price recomputing below it, and c would never load.
    core = make(tiny, ScriptedPolicy(lambda step, view: ()), num_pages=12, host_kv_memory=10 * pb,
                disk_kv_memory=64 * pb, disk_kv_dir=str(tmp_path))
    a = Request("a", FAMILIES[0][:33], SamplingParams(temperature=0, max_tokens=1))
    core.add_request(a)
    step_until(core, lambda: a.is_finished)
    core.wait_copies()
    host = core.kv.host
    keys = chain_page_keys(a.token_ids, PAGE, [])[:8]
    pages = host.pool.lookup(keys)
    assert len(pages) == 8  # all eight full prompt pages are on the host, under their keys
    prefix = host.pages[pages].clone()
    # Another family fills the device and the host: a's pages leave the device and spill to disk.
    b = Request("b", FAMILIES[1][:45], SamplingParams(temperature=0, max_tokens=1))
    core.add_request(b)
    step_until(core, lambda: b.is_finished)
    core.wait_copies()
    found = host.lookup(keys)
    assert core.pool.lookup(keys) == [] and len(found) == 8 and found.count(None) >= 4  # >= 4 on disk only
    reads = host.disk.num_reads
    c = Request("c", FAMILIES[0][:33] + [99, 98, 97], SamplingParams(temperature=0, max_tokens=3))
    core.add_request(c)
    step_until(core, lambda: c.status is RequestStatus.LOADING)
    assert host.disk.num_reads > reads
    while c.status is RequestStatus.LOADING:
        core.wait_copies()
        core.scheduler.issue_copies(ScheduledBatch())
    assert c.status is RequestStatus.RUNNING and c.num_computed_tokens == 32
    got = device_pages(core)[core.kv.block_table(c)[:8]]
    assert torch.equal(got.view(torch.int32), prefix.view(torch.int32))
    step_until(core, lambda: c.is_finished)
    want = reference(tiny, [c.prompt_token_ids], [3])[0]
    assert c.output_token_ids == want
    core.close()


# -- preemption frees written-through pages at once; copies pin their pages ---------------------------------
def test_preempting_a_written_through_request_frees_its_device_pages_at_once(tiny):
    victim: list[str] = []
    core = make(tiny, ScriptedPolicy(lambda step, view: tuple(victim)))
    req = Request("a", FAMILIES[0][:32], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    core.add_request(req)
    step_until(core, lambda: req.num_computed_tokens == 32)  # two prompt chunks: 8 full pages
    core.scheduler.issue_copies(ScheduledBatch())  # the write-through of the last chunk's pages
    core.wait_copies()
    assert core.kv.state(req).num_offloaded_tokens == 32
    victim.append("a")
    core.scheduler.schedule()  # the preemption, and no poll after it
    assert req.status is RequestStatus.PREEMPTED
    assert core.pool.num_used == 0  # every device page free at once
    assert not core.kv.copier.busy(WRITE) and core.kv.stats.pages_evicted == 0
    core.close()


def gate(core: EngineCore) -> threading.Event:
    """Hold every copy of `core` until the returned event is set."""
    release = threading.Event()
    copier = core.kv.copier
    run_copy = copier._run
    copier._run = lambda job: (release.wait(10), run_copy(job))
    return release


def test_a_page_is_never_freed_while_a_copy_reads_it(tiny):
    core = make(tiny, offload="write-back")
    req = Request("a", FAMILIES[0][:30], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    core.add_request(req)
    step_until(core, lambda: req.num_output_tokens >= 2)
    release = gate(core)
    pages, computed = list(core.kv.block_table(req)), req.num_computed_tokens
    core.kv.preempt(req)  # write-back: every page is written now, and pinned while it is
    core.scheduler.running.remove(req)
    assert core.pool.num_used == len(pages)
    grabbed = [core.pool.allocate() for _ in range(core.pool.num_free)]  # everything allocatable
    assert not set(grabbed) & set(pages)  # none of the pages in flight is handed out
    for p in grabbed:
        core.pool.decref(p)
    release.set()
    core.wait_copies()
    assert core.pool.num_used == 0 and core.kv.state(req).num_offloaded_tokens == core.kv.state(req).num_offload_issued == computed
    core.kv.free(req)
    assert core.kv.host.pool.num_used == 0
    core.close()


def test_a_host_page_is_not_reused_while_a_load_reads_it(tiny):
    victim: list[str] = []
    core = make(tiny, ScriptedPolicy(lambda step, view: tuple(victim)), enable_prefix_caching=False)
    req = Request("a", FAMILIES[0][:30], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    core.add_request(req)
    step_until(core, lambda: req.num_output_tokens >= 2)
    victim.append("a")
    core.step()
    victim.clear()
    core.wait_copies()
    release = gate(core)
    core.step()
    assert req.status is RequestStatus.LOADING and core.kv.copier.busy(LOAD)
    host_pages = list(core.kv.state(req).host_pages)
    core.abort("a")  # mid-load: the request lets go, the copy still holds its pages
    assert all(core.kv.host.pool.ref_count(h) == 1 for h in host_pages)  # the load's pin
    assert core.kv.host.pool.num_used > 0 and core.pool.num_used > 0
    release.set()
    core.wait_copies()
    assert core.pool.num_used == 0 and core.kv.host.pool.num_used == 0
    core.close()


# -- configuration -------------------------------------------------------------------------------------------
def test_offload_settings_are_validated_and_sizes_parsed(tmp_path, monkeypatch):
    from tokenflowd.config import env_config, load_config_file

    monkeypatch.delenv("STATE_DIRECTORY", raising=False)
    with pytest.raises(ValueError, match="offload must be"):
        EngineConfig(offload="sometimes")
    with pytest.raises(ValueError, match="disk_kv_dir"):
        EngineConfig(disk_kv_memory=1 << 20)
    with pytest.raises(ValueError, match="needs a host tier"):
        EngineConfig(offload="none", disk_kv_memory=1 << 20, disk_kv_dir=str(tmp_path))
    cfg = EngineConfig.resolve(device="cpu", host_kv_memory="2GiB", disk_kv_memory="1GiB", disk_kv_dir=str(tmp_path))
    assert (cfg.host_kv_memory, cfg.disk_kv_memory, cfg.offload) == (2 << 30, 1 << 30, "write-through")
    f = tmp_path / "c.toml"
    f.write_text('[engine]\noffload = "write-back"\nhost_kv_memory = "512MiB"\n')
    assert load_config_file(str(f))["engine"] == {"offload": "write-back", "host_kv_memory": "512MiB"}
    assert env_config({"TOKENFLOWD_HOST_KV_MEMORY": "1GiB"})["engine"] == {"host_kv_memory": 1 << 30}


# -- write-through shares what is already on the host ---------------------------------------------------------
def test_write_through_writes_a_shared_prefix_once(tiny):
    """Four requests share a 256-token system prompt: its pages are copied to the host once, and
    the later requests take those host pages as their own copy (counted as shared)."""
    pb16 = page_bytes(tiny) * 4
    core = make(tiny, page_size=16, num_pages=80, max_num_batched_tokens=64, host_kv_memory=200 * pb16)
    prefix = [7 + (i * 31) % 900 for i in range(256)]
    reqs = [Request(f"s{i}", prefix + [1000 + 10 * i + k for k in range(8)],
                    SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)) for i in range(4)]

    def run(batch):
        for r in batch:
            core.add_request(r)
        step_until(core, lambda: all(r.is_finished for r in batch))
        core.scheduler.issue_copies(ScheduledBatch())
        core.wait_copies()

    run(reqs[:1])
    assert core.kv.stats.pages_written == 16  # the 256-token prefix: 16 full pages (the rest stays partial)
    run(reqs[1:])
    assert core.kv.stats.pages_written == 16  # nothing of the prefix is written again
    assert core.kv.stats.pages_shared == 3 * 16
    assert core.kv.host.pool.num_used == 0
    core.close()


# -- faults: a failed copy is never taken for a good one --------------------------------------------------------
def failing(core: EngineCore, lane: str, times: int = 1) -> list[CopyJob]:
    """Make the next `times` copies of `lane` raise; returns the jobs that failed."""
    copier = core.kv.copier
    run_copy = copier._run
    failed: list[CopyJob] = []

    def run(job):
        if job.lane == lane and len(failed) < times:
            failed.append(job)
            raise OSError("injected copy fault")
        run_copy(job)

    copier._run = run
    return failed


def preempted_under_faults(tiny, prompt: list[int], lane: str, times: int = 1
                           ) -> tuple[EngineCore, Request, list[CopyJob]]:
    """A request run to 5 tokens, its KV written through, then preempted (what the host lacks
    written as one eviction job) with the next `times` copies of `lane` made to fail."""
    victim: list[str] = []
    core = make(tiny, ScriptedPolicy(lambda step, view: tuple(victim)), enable_prefix_caching=False)
    req = Request("a", prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    core.add_request(req)
    step_until(core, lambda: req.num_output_tokens >= 5)
    core.wait_copies()
    failed = failing(core, lane, times)
    victim.append("a")
    core.step()
    victim.clear()
    return core, req, failed


@pytest.mark.parametrize("lane", [WRITE, LOAD])
def test_a_failed_copy_publishes_nothing_and_the_request_recomputes(tiny, lane):
    """An eviction whose write raises, or a resume whose load raises: the request still produces
    the greedy tokens of a run without faults (what the copy should have restored is
    recomputed), no host page of the failed copy is published, and no page leaks."""
    prompt = FAMILIES[0][:30]
    core, req, failed = preempted_under_faults(tiny, prompt, lane)
    step_until(core, lambda: req.is_finished)
    core.wait_copies()
    assert len(failed) == 1 and core.kv.stats.copies_failed == 1
    host = core.kv.host.pool
    assert all(host._key[h] is None for h in failed[0].host_pages)  # nothing of it is in the prefix cache
    assert req.output_token_ids == reference(tiny, [prompt], [24])[0]
    assert core.pool.num_used == 0 and host.num_used == 0
    core.close()


def test_a_dead_lane_ends_the_step_loop_instead_of_hanging(tiny):
    from tokenflowd.kv.copier import CopierDead

    core = make(tiny)
    core.kv.copier._queues[WRITE].put(None)  # the write lane's worker exits, as if it had died
    core.kv.copier._threads[0].join(10)
    req = Request("a", FAMILIES[0][:30], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    core.add_request(req)
    with pytest.raises(CopierDead, match="write lane"):
        for _ in range(200):
            core.step()
            core.wait_copies()


# -- what a client receives: the text stream through Engine ---------------------------------------------------
def test_random_preemption_keeps_every_clients_text_stream(tiny):
    """Eight requests of 64 tokens, half of them sharing a written-through prefix, under a random
    preempt/resume schedule (reloads and recomputes): each client's text, as Engine streams it,
    equals a run without preemption."""
    import random

    from tokenflowd.engine.offline import Engine

    def texts(engine: Engine) -> dict[str, str]:
        prompts = {f"c{i}": FAMILIES[i % 2][: 20 + i] if i < 4 else FAMILIES[2][i:] for i in range(8)}
        for rid, p in prompts.items():
            engine.add_request(rid, p, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
        got = dict.fromkeys(prompts, "")
        for _ in range(5000):
            if not engine.has_unfinished():
                break
            for out in engine.step():
                got[out.request_id] += out.text
        assert not engine.has_unfinished()
        engine.core.wait_copies()
        return got

    base = dict(model="tiny", device="cpu", dtype="float32", page_size=PAGE, max_num_batched_tokens=32, max_num_seqs=8)
    want = texts(Engine(EngineConfig.resolve(**base, num_pages=400, policy="fcfs"), tiny))
    rng = random.Random(7)
    engine = Engine(EngineConfig.resolve(**base, num_pages=96, policy="fcfs", host_kv_memory=400 * page_bytes(tiny)),
                    tiny)
    engine.core.scheduler.policy = ScriptedPolicy(
        lambda step, view: tuple(r.request_id for r in view.running if rng.random() < 0.08), reload=False)
    got = texts(engine)
    assert got == want
    kv = engine.core.kv
    assert engine.core.scheduler.num_preemptions >= 8 and kv.stats.pages_loaded > 0 and kv.stats.pages_shared > 0
    assert engine.core.pool.num_used == 0 and kv.host.pool.num_used == 0
    engine.core.close()


def test_a_request_whose_load_failed_is_not_loaded_again(tiny):
    """Every load fails: the request recomputes after the first failure instead of cycling
    LOADING -> failed -> LOADING (its host prefix is still cached), and its tokens are right."""
    prompt = FAMILIES[1][:30]
    core, req, failed = preempted_under_faults(tiny, prompt, LOAD, times=100)
    step_until(core, lambda: req.is_finished)
    assert len(failed) == 1 and req.output_token_ids == reference(tiny, [prompt], [24])[0]
    core.close()


def test_copies_that_keep_failing_end_the_engine(tiny):
    from tokenflowd.kv.copier import CopierDead
    from tokenflowd.offload.traffic import MAX_COPY_FAILURES

    core = make(tiny)
    failed = failing(core, WRITE, times=1000)
    core.add_request(Request("a", FAMILIES[2][:40], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)))
    with pytest.raises(CopierDead, match="in a row failed"):
        for _ in range(500):
            core.step()
            core.wait_copies()
    assert len(failed) >= MAX_COPY_FAILURES


def test_weighing_a_request_keeps_nothing_of_it_and_an_id_reused_starts_afresh(tiny):
    core = make(tiny)
    kv = core.kv
    shed = Request("x", FAMILIES[0][:20], SamplingParams(max_tokens=2))
    assert kv.match(shed).num_device_pages == 0 and "x" not in kv._kv  # load shedding weighs it, nothing stays
    a = Request("a", FAMILIES[0][:20], SamplingParams(temperature=0, max_tokens=2))
    core.add_request(a)
    kv.state(a).page_hashes.append(b"stale")
    core.abort("a")
    b = Request("a", FAMILIES[1][:20], SamplingParams(temperature=0, max_tokens=2))
    core.add_request(b)
    assert kv.state(b).page_hashes == []  # keyed afresh from its own tokens
    core.abort("a")
    core.close()


def test_a_loading_request_that_takes_back_its_peers_prefix_ignores_its_loads_in_flight(tiny):
    """The pool: a request whose prefix a peer held loses that peer while its own KV is loading
    from the host. It recomputes from its whole prompt; the load that ends later is not taken for
    its (a crash once: the loaded request was looked for among the loading ones)."""
    victim: list[str] = []
    core = make(tiny, ScriptedPolicy(lambda step, view: tuple(victim)), enable_prefix_caching=False)
    req = Request("a", FAMILIES[1][:30], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    req.set_foreign_prefix(8, b"peer-key")  # (no peer here: its rows attend to its own tokens only)
    core.add_request(req)
    step_until(core, lambda: req.num_output_tokens >= 3)
    victim.append("a")
    core.step()  # preempted: written to the host
    victim.clear()
    core.wait_copies()
    release = gate(core)
    core.step()  # admitted again: LOADING, its load held in flight
    assert req.status is RequestStatus.LOADING
    produced = list(req.output_token_ids)
    core.scheduler.take_foreign_prefix(req)
    assert req.status is RequestStatus.PREEMPTED and req.prefix_offset == 0 and req.num_prompt_tokens == 30
    release.set()
    step_until(core, lambda: not core.has_unfinished())
    core.wait_copies()
    check_tiers(core)
    assert req.output_token_ids[:3] == produced[:3] and req.num_output_tokens == 12
    assert core.pool.num_used == 0 and core.kv.host.pool.num_used == 0
    core.close()


def test_a_copier_with_a_staging_limit_gets_jobs_within_it_and_the_same_tokens(tiny):
    """The CUDA copier stages each job in a device block and says how many bytes a lane may hold
    (staging_limit): evictions and loads are split into jobs within it, frontiers advance job by
    job, and every request still gets the tokens of its uninterrupted run. The CPU's copier,
    given the same limit, runs that path here."""
    prompts = [FAMILIES[0][:30], FAMILIES[1][:26], FAMILIES[2][:34]]
    expected = reference(tiny, prompts, [12, 12, 12])
    core = make(tiny, ScriptedPolicy(lambda step, view: tuple(r.request_id for r in view.running)
                                     if step in (3, 12, 24) else ()), offload="write-back", enable_prefix_caching=False)
    # 2 pages: three loads fill the pool while they cross in small jobs, and the first to end has
    # no page to grow into until the policy gives one back
    limit_pages = 2
    core.kv.copier.staging_limit = limit_pages * core.kv.page_bytes
    sizes: list[int] = []
    submit = core.kv.copier.submit
    core.kv.copier.submit = lambda job: (sizes.append(len(job.device_pages)), submit(job))[1]
    try:
        got = run(core, prompts, [12, 12, 12])
    finally:
        core.close()
    assert [got[f"r{i}"] for i in range(3)] == expected
    assert core.kv.stats.pages_evicted > limit_pages and core.kv.stats.pages_loaded > limit_pages
    assert sizes and max(sizes) <= limit_pages and sizes.count(limit_pages) > 1  # split, not merely small
