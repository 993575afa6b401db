"""PrfaaS's selective offload in the conductor (federation/conductor/remote_prefill.py): only prompts whose uncached
part is longer than t go to the remote prefill nodes, and t is solved again from measured egress
and queues, without processes."""
from __future__ import annotations

import math

from tokenflowd.federation.conductor.config import ConductorConfig
from tokenflowd.federation.conductor.core import Conductor
from tokenflowd.federation.conductor.placement import Placement
from tokenflowd.kv.pages import chain_page_keys

PAGE = 16


def engine(per_token: float, waiting_tokens: int = 0) -> dict:
    return {"engine": 0, "running": 0, "waiting": 0, "waiting_tokens": waiting_tokens, "step_base": 0.01,
            "step_per_token": per_token, "kv_pages_used": 0, "kv_pages_total": 4000, "kv_remote_pages": 0,
            "max_num_seqs": 64, "max_num_batched_tokens": 1024, "max_model_len": 8192}


def state(role: str, per_token: float, endpoint: str, links: dict | None = None, keys=(), waiting_tokens=0) -> dict:
    return {"role": role, "page_size": PAGE, "engines": [engine(per_token, waiting_tokens)],
            "keys": {"seq": 1, "snapshot": [k.hex() for k in keys]}, "kv_token_bytes": 1000,
            "kv_endpoints": [endpoint], "links": links or {}}


def cluster(**config) -> Conductor:
    names = ("r0", "p0", "d0", "d1")
    c = Conductor(ConductorConfig(nodes=tuple((n, f"http://{n}") for n in names), remote=("r0",), ttft_slo=1000,
                                  tbt_slo=10, rejection="off", **config), tokenizer=None)
    for name, st in (("r0", state("prefill", 1e-5, "r:0")), ("p0", state("prefill", 1e-4, "p:0")),
                     ("d0", state("decode", 1e-4, "d:0")), ("d1", state("decode", 1e-4, "d:1"))):
        c.nodes[name].apply(st)
        c.nodes[name].healthy = True
    return c


def test_only_prompts_whose_uncached_part_is_longer_than_t_go_to_the_remote_prefill_nodes():
    c = cluster(prfaas_threshold=1000)
    short, long = list(range(1, 801)), list(range(1, 3001))
    assert isinstance(p := c.place(short, set()), Placement) and p.prefill == "p0" and p.decode in ("d0", "d1")
    assert c.place(long, set()).prefill == "r0"
    # a local prefill node holding 2400 of the long prompt's tokens leaves 600 uncached: local
    keys = chain_page_keys(long, PAGE, [])[:150]
    c.nodes["p0"].apply(state("prefill", 1e-4, "p:0", keys=keys))
    assert c.place(long, set()).prefill == "p0"
    assert c.remote_prefill.offloaded == 1 and list(c.remote_prefill.lengths) == [800, 3000, 600]
    # no remote node serving: everything local
    c.nodes["r0"].healthy = False
    assert c.place(list(range(1, 5001)), set()).prefill == "p0"


def test_t_is_solved_from_measured_egress_and_a_slower_link_raises_it():
    c = cluster(prfaas_threshold=1000)
    remote, local = [c.nodes["r0"]], [c.nodes[n] for n in ("p0", "d0", "d1")]
    for n in [500] * 40 + [6000] * 40:
        c.remote_prefill.route(n, n)
    assert c.remote_prefill.update(remote, local, 0.0) == 1000, "no transfer measured yet: the operator's t stands"
    c.nodes["r0"].apply(state("prefill", 1e-5, "r:0", links={"d:0": 1e9, "d:1": 1e9}))
    wide = c.remote_prefill.update(remote, local, 0.0)
    assert 500 <= wide < 6000 and c.remote_prefill.egress == 1e9
    # the link drops to 1 MB/s: 6000-token prompts' KV (6 MB each) can no longer cross it as fast
    c.nodes["r0"].apply(state("prefill", 1e-5, "r:0", links={"d:0": 1e6, "d:1": 1e6}))
    narrow = c.remote_prefill.update(remote, local, 0.0)
    assert narrow > wide and math.isinf(narrow)


def test_a_link_that_no_longer_carries_anything_is_probed_and_its_recovery_lowers_t_again():
    c = cluster(prfaas_threshold=1000, prfaas_probe_period=60)
    remote, local = [c.nodes["r0"]], [c.nodes[n] for n in ("p0", "d0", "d1")]
    for n in [500] * 40 + [6000] * 40:
        c.remote_prefill.route(n, n)
    c.nodes["r0"].apply(state("prefill", 1e-5, "r:0", links={"d:0": 1e6}))  # a slow link: nothing goes remote
    assert math.isinf(c.remote_prefill.update(remote, local, 0.0))
    assert math.isinf(c.remote_prefill.update(remote, local, 59.0)) and c.remote_prefill.probe_floor is None
    c.remote_prefill.update(remote, local, 61.0)  # a minute with no new measurement: probe it
    assert c.remote_prefill.probe_floor == 6000
    assert c.place(list(range(1, 3001)), set()).prefill == "p0", "shorter than the recent 90th percentile"
    assert c.place(list(range(1, 6001)), set()).prefill == "r0"  # the probe
    assert c.place(list(range(1, 6002)), set()).prefill == "p0" and c.remote_prefill.probes == 1
    # its transfer measured nothing (it failed): no second probe before another minute
    for now in (66.0, 71.0, 120.0):
        c.remote_prefill.update(remote, local, now)
        assert c.remote_prefill.probe_floor is None, now
    c.remote_prefill.update(remote, local, 127.0)
    assert c.remote_prefill.probe_floor == 6000
    # the probe's transfer found the link recovered: t comes down at the next solve
    c.nodes["r0"].apply(state("prefill", 1e-5, "r:0", links={"d:0": 1e9}))
    assert c.remote_prefill.update(remote, local, 130.0) < 6000


def test_an_operators_t_above_every_prompt_is_probed_below_so_the_link_gets_measured():
    c = cluster(prfaas_threshold=100_000, prfaas_probe_period=60)
    remote, local = [c.nodes["r0"]], [c.nodes[n] for n in ("p0", "d0", "d1")]
    for n in [500] * 40 + [6000] * 40:
        assert not c.remote_prefill.route(n, n)
    assert c.remote_prefill.update(remote, local, 0.0) == 100_000 and c.remote_prefill.probe_floor is None
    assert c.remote_prefill.update(remote, local, 61.0) == 100_000 and c.remote_prefill.probe_floor  # nothing measured in a minute
    assert c.place(list(range(1, 6001)), set()).prefill == "r0" and c.remote_prefill.probes == 1
    c.nodes["r0"].apply(state("prefill", 1e-5, "r:0", links={"d:0": 1e9}))  # what the probe measured
    assert c.remote_prefill.update(remote, local, 62.0) < 6000


def test_a_surging_remote_queue_raises_t_until_it_eases():
    c = cluster(prfaas_threshold=1000, prfaas_queue_seconds=1.0)
    remote, local = [c.nodes["r0"]], [c.nodes[n] for n in ("p0", "d0", "d1")]
    for n in [500] * 40 + [6000] * 40:
        c.remote_prefill.route(n, n)
    links = {"d:0": 1e9}
    c.nodes["r0"].apply(state("prefill", 1e-5, "r:0", links=links))
    calm = c.remote_prefill.update(remote, local, 0.0)
    c.nodes["r0"].apply(state("prefill", 1e-5, "r:0", links=links, waiting_tokens=500_000))  # ~5 s queued
    surged = c.remote_prefill.update(remote, local, 0.0)
    assert surged == 1.25 * calm
    assert c.remote_prefill.update(remote, local, 0.0) == 1.25 * surged
    c.nodes["r0"].apply(state("prefill", 1e-5, "r:0", links=links))
    assert c.remote_prefill.update(remote, local, 0.0) == calm


def test_the_long_term_split_converts_a_node_of_the_surplus_role_when_it_pays():
    names = ("p0", "p1", "p2", "d0")
    c = Conductor(ConductorConfig(nodes=tuple((n, f"http://{n}") for n in names), ttft_slo=1000, tbt_slo=10,
                                  rejection="off"), tokenizer=None)
    for name in names:  # three prefill nodes and one decode node, for short prompts and long replies
        st = state("prefill" if name.startswith("p") else "decode", 1e-4, f"{name}:0")
        st["engines"][0]["running"] = {"p0": 3, "p1": 0, "p2": 5}.get(name, 0)
        c.nodes[name].apply(st)
        c.nodes[name].healthy = True
    local = list(c.nodes.values())
    assert c.remote_prefill.split([], local, gain=0.1) is None, "too few requests seen"
    for _ in range(40):  # no remote node: the lengths are recorded all the same, and none offloaded
        c.place(list(range(1, 301)), set())
    assert list(c.remote_prefill.lengths) == [300] * 40 and c.remote_prefill.offloaded == 0
    assert c.remote_prefill.split([], local, gain=0.1) == ("p1", "decode")  # the least busy prefill node
    assert c.remote_prefill.split([], local, gain=100.0) is None, "not worth a conversion"
    # while it converts, it takes no new work
    c.converting["p1"] = ("decode", 0.0)
    assert all(c.place(list(range(1, 301)), set()).prefill != "p1" for _ in range(3))


def test_the_conductor_asks_a_draining_node_again_until_it_takes_its_new_role():
    import asyncio

    import aiohttp
    from aiohttp import web

    answers = [(409, {"error": {"code": "draining", "message": "1 decode request(s) under way"}}),
               (200, {"role": "prefill", "changed": True})]
    asked = []

    async def set_role(request: web.Request) -> web.Response:
        asked.append((await request.json(), request.headers.get("Authorization")))
        status, body = answers.pop(0)
        return web.json_response(body, status=status)

    async def run() -> Conductor:
        app = web.Application()
        app.router.add_post("/federation/role", set_role)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        c = Conductor(ConductorConfig(nodes=(("d0", url),), api_key="sk-node"), tokenizer=None)
        c.session = aiohttp.ClientSession()
        try:
            c.converting["d0"] = ("prefill", 0.0)
            await c._convert(c.nodes["d0"], "prefill", 0.0, now=1.0)
            assert c.converting == {"d0": ("prefill", 0.0)}, "draining: it stays out of placement"
            await c._convert(c.nodes["d0"], "prefill", 0.0, now=2.0)
            assert c.converting == {} and c.nodes["d0"].role == "prefill"
            # a node that drains for too long is left in its old role, back in placement
            c.converting["d0"] = ("decode", 0.0)
            answers.append((409, {"error": {"code": "draining", "message": "busy"}}))
            await c._convert(c.nodes["d0"], "decode", 0.0, now=1e6)
            assert c.converting == {}
        finally:
            await c.session.close()
            await runner.cleanup()
        return c

    asyncio.run(run())
    assert asked[0] == ({"role": "prefill"}, "Bearer sk-node") and len(asked) == 3
