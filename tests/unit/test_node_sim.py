"""The node simulator (sim/node.py): N engines on one virtual timeline, routed by the daemon's
router, with the pool (requests read prefix pages where engines hold them) or without."""
from __future__ import annotations

from tokenflowd.cli import main
from tokenflowd.sim.cost import cost_model
from tokenflowd.sim.node import NodeConfig, simulate_node
from tokenflowd.sim.workload import WorkloadRequest


def workload() -> list[WorkloadRequest]:
    """A 1-block (512-token, 32-page) shared prefix computed once, then a burst of 64 readers of it,
    each with a block of its own: more than the router's score lets one engine take."""
    first = [WorkloadRequest("first", 0.0, 1024, 8, 20.0, (1, 100))]
    burst = [WorkloadRequest(f"r{i}", 1.0, 1024, 64, 20.0, (1, 200 + i)) for i in range(64)]
    return first + burst


def test_the_pool_computes_a_shared_prefix_once_where_routing_computes_it_on_each_engine_it_uses():
    cost = cost_model("a100-llama2-7b")
    results = simulate_node(cost, workload(), config=NodeConfig(engines=4, segment_pages=8))
    routing = results["routing"].summary()
    assert routing["requests_served"] == 65 and routing["peer_tokens"] == 0
    for mode in ("pool", "pool-local"):
        pool = results[mode].summary()
        assert pool["requests_served"] == 65
        assert pool["peer_tokens"] >= 512, "requests on other engines read the prefix where it is"
        # The prefix is computed once with the pool; routing spreads the burst by load and computes
        # it again on every other engine it sends readers to.
        assert pool["computed_tokens"] < routing["computed_tokens"]
        assert pool["hit_rate"] >= routing["hit_rate"]
        assert results[mode].busy_seconds.count(0.0) <= results["routing"].busy_seconds.count(0.0)
    # Placement: the shared prefix's segments (and each reader's own) went to their homes.
    assert results["pool"].put_pages > 0 and results["pool-local"].put_pages == 0


def test_sim_node_command_prints_both_modes(tmp_path, capsys):
    out = tmp_path / "node.json"
    assert main(["sim-node", "--engines", "2", "--num-prompts", "40", "--max-prompt-len", "4096",
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "routing" in text and "pool" in text and out.exists()
