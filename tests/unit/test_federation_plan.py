"""`tokenflowd federation plan` (federation/plan.py): PrfaaS's model fed with what the nodes publish
in /federation/state, their measured links included, and the workload's uncached lengths."""
from __future__ import annotations

import asyncio
import json
import math
import threading

import pytest
from aiohttp import web

from tokenflowd.cli import main
from tokenflowd.federation.plan import NodeFigures, egress, plan_cluster, trace_lengths


def state(role: str, per_token: float, endpoint: str, links: dict[str, float] | None = None) -> dict:
    return {"role": role, "page_size": 16, "kv_token_bytes": 1000, "kv_endpoints": [endpoint], "links": links or {},
            "engines": [{"step_base": 0.01, "step_per_token": per_token, "max_num_batched_tokens": 1000,
                         "max_num_seqs": 64, "max_model_len": 8000, "kv_pages_total": 4000, "waiting_tokens": 0,
                         "running": 0}]}


def test_a_node_s_figures_give_its_prefill_and_decode_profiles():
    f = NodeFigures.of(state("prefill", 1e-4, "p:1"))
    profile = f.prefill_profile()
    assert profile.prefill_seconds(2500) == pytest.approx(2500 * 1e-4 + 3 * 0.01, rel=0.02)  # 3 steps of ≤ 1000
    assert profile.prefill_seconds(3000) == pytest.approx(3000 * 1e-4 + 3 * 0.01)
    assert profile.kv_size(3000) == 3_000_000
    # decode: 64 000 tokens of KV hold 32 requests of 2000 tokens; within a 20 ms step, (0.02 - 0.01) / 1e-4 = 100
    d = f.decode_profile(tbt_slo=0.02, mean_tokens=2000, output_tokens=200)
    assert (d.max_batch, d.step_seconds) == (32, pytest.approx(0.01 + 32e-4))
    assert f.decode_profile(tbt_slo=0.0105, mean_tokens=2000, output_tokens=200).max_batch == 5
    with pytest.raises(ValueError, match="kv_token_bytes"):
        NodeFigures.of({**state("prefill", 1e-4, "p:1"), "kv_token_bytes": 0})
    # a decode node that has only run batches of one: every step costs the same, seats and KV bound the batch
    flat = NodeFigures.of(state("decode", 0.0, "d:1")).decode_profile(tbt_slo=0.02, mean_tokens=100, output_tokens=10)
    assert (flat.max_batch, flat.step_seconds) == (64, 0.01)
    with pytest.raises(ValueError, match="step-time model"):
        NodeFigures.of({**state("decode", 0.0, "d:1"), "engines": [{**state("decode", 0.0, "d:1")["engines"][0],
                                                                     "step_base": 0.0}]})


def test_the_trace_s_lengths_are_what_earlier_requests_did_not_already_cache():
    lines = [json.dumps({"input_length": 1500, "output_length": 10, "hash_ids": [1, 2, 3]}),
             json.dumps({"input_length": 1300, "output_length": 30, "hash_ids": [1, 2, 4]}),  # 1024 cached
             ""]
    lengths, mean_tokens, mean_output = trace_lengths(lines)
    assert lengths.sorted == [276.0, 1500.0] and mean_tokens == 1420 and mean_output == 20


def test_egress_is_what_the_remote_nodes_measured_to_the_local_ones():
    local = [state("decode", 1e-4, "d:1"), state("prefill", 1e-4, "p:1")]
    remote = [state("prefill", 1e-5, "r:1", {"d:1": 100.0, "p:1": 300.0, "elsewhere:1": 5000.0}),
              state("prefill", 1e-5, "r:2")]  # nothing measured yet
    assert egress(remote, local) == 200.0
    # a node that says what its writes to every peer achieved together: that figure (writes to two
    # decode nodes at once share its link, so each peer's alone is a part of it)
    both = {**state("prefill", 1e-5, "r:1", {"d:1": 100.0, "p:1": 100.0}), "egress": 190.0}
    assert egress([both], local) == 190.0
    assert egress([{**state("prefill", 1e-5, "r:1", {"elsewhere:1": 100.0}), "egress": 190.0}], local) == 0.0


def test_the_plan_offloads_long_prompts_to_fast_remote_nodes_and_refuses_unmeasured_links():
    states = {"r0": state("prefill", 1e-5, "r:0", {"d:0": 1e9}), "p0": state("prefill", 1e-4, "p:0"),
              "d0": state("decode", 1e-4, "d:0"), "d1": state("decode", 1e-4, "d:1")}
    lengths, mean, out = trace_lengths(json.dumps({"input_length": n, "output_length": 100})
                                       for n in [500] * 50 + [6000] * 50)
    live = plan_cluster(states, ["r0"], lengths, mean, out, tbt_slo=0.1)
    assert live.remote == ("r0",) and set(live.local) == {"p0", "d0", "d1"}
    assert 500 <= live.plan.threshold < 6000 and live.plan.offloaded == 0.5
    assert live.cluster.egress == 1e9
    unmeasured = {**states, "r0": state("prefill", 1e-5, "r:0")}
    with pytest.raises(ValueError, match="measured"):
        plan_cluster(unmeasured, ["r0"], lengths, mean, out, tbt_slo=0.1)
    with pytest.raises(ValueError, match="not a prefill node"):
        plan_cluster(states, ["d0"], lengths, mean, out, tbt_slo=0.1)
    alone = plan_cluster(states, [], lengths, mean, out, tbt_slo=0.1)  # no PrfaaS: homogeneous PD
    assert alone.plan.threshold == math.inf and alone.plan.offloaded == 0


def test_the_local_prefill_profile_is_the_prefill_nodes_and_the_decode_profile_the_decode_nodes():
    # a decode node's step-time model is fitted on decode steps: a poor guide to its prefill speed
    states = {"r0": state("prefill", 1e-4, "r:0", {"d:0": 1e9}), "p0": state("prefill", 1e-4, "p:0"),
              "d0": state("decode", 1e-3, "d:0")}
    lengths, mean, out = trace_lengths(json.dumps({"input_length": n, "output_length": 10})
                                       for n in [500] * 50 + [600] * 50)
    live = plan_cluster(states, ["r0"], lengths, mean, out, tbt_slo=10.0, n_prefill=1)
    assert live.cluster.local_prefill.prefill_seconds(1000) == pytest.approx(1000 * 1e-4 + 0.01)
    assert live.cluster.decode.step_seconds == pytest.approx(0.01 + live.cluster.decode.max_batch * 1e-3)
    # equal prefill nodes split the work: the long prompts remote, the short ones local
    assert 500 <= live.plan.threshold < 600 and live.plan.offloaded == 0.5


def test_the_plan_command_asks_the_nodes_and_prints_the_plan(tmp_path, capsys):
    states = {"r0": state("prefill", 1e-5, "r:0", {"d:0": 1e9}), "p0": state("prefill", 1e-4, "p:0"),
              "d0": state("decode", 1e-4, "d:0")}
    seen_keys = []
    loop = asyncio.new_event_loop()
    runners, urls = [], {}

    async def start() -> None:
        for name, body in states.items():
            async def handler(request: web.Request, body=body) -> web.Response:
                seen_keys.append(request.headers.get("Authorization"))
                return web.json_response(body)
            app = web.Application()
            app.router.add_get("/federation/state", handler)
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            runners.append(runner)
            urls[name] = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    loop.run_until_complete(start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        config = tmp_path / "cluster.toml"
        config.write_text('[conductor]\napi_key = "sk-node"\n' + "".join(
            f'[[nodes]]\nname = "{n}"\nurl = "{u}"\n' + ("remote = true\n" if n == "r0" else "")
            for n, u in urls.items()) + '[[nodes]]\nname = "gone"\nurl = "http://127.0.0.1:1"\n')
        trace = tmp_path / "trace.jsonl"
        trace.write_text("".join(json.dumps({"input_length": n, "output_length": 100}) + "\n"
                                 for n in [500] * 50 + [6000] * 50))
        assert main(["federation", "plan", "--config", str(config), "--trace", str(trace), "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["remote"] == ["r0"] and doc["unreachable"] == ["gone"] and 500 <= doc["threshold"] < 6000
        assert main(["federation", "plan", "--config", str(config), "--trace", str(trace)]) == 0
        assert "threshold t: 500 tokens" in capsys.readouterr().out
        assert set(seen_keys) == {"Bearer sk-node"}
    finally:
        async def stop() -> None:
            for runner in runners:
                await runner.cleanup()
        asyncio.run_coroutine_threadsafe(stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
