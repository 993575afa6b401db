"""The conductor's view of its nodes and its choices (federation/conductor/service.py), and the node's key log
it follows (daemon/api/federation.py), without processes: what a node's /federation/state says, which
(prefill, decode) pair a request gets, and how nodes that are gone leave placement."""
from __future__ import annotations

import pytest

from tokenflowd.daemon.api.federation import KeyLog
from tokenflowd.cli import federation_missing
from tokenflowd.federation.conductor.config import ConductorConfig
from tokenflowd.federation.conductor.core import Conductor
from tokenflowd.federation.conductor.nodes import NodeView
from tokenflowd.federation.conductor.placement import Placement, Rejection
from tokenflowd.kv.pages import chain_page_keys
from tokenflowd.daemon.prefix_index import PrefixIndex

PAGE = 16


def engine(waiting_tokens: int = 0, running: int = 0, per_token: float = 1e-3, base: float = 0.01) -> dict:
    return {"engine": 0, "running": running, "waiting": 0, "waiting_tokens": waiting_tokens, "step_base": base,
            "step_per_token": per_token, "kv_pages_used": 0, "kv_pages_total": 100, "kv_remote_pages": 0,
            "max_num_seqs": 8, "max_num_batched_tokens": 512, "max_model_len": 4096}


def state(role: str, keys: list[bytes] = (), kv: dict | None = None, **load) -> dict:
    """`kv`: what a prefill or decode node says of its transfer engines (kv_token_bytes,
    kv_endpoints, links: bytes/s its writes achieved to each peer endpoint)."""
    return {"role": role, "page_size": PAGE, "engines": [engine(**load)],
            "keys": {"seq": 1, "snapshot": [k.hex() for k in keys]}, **(kv or {})}


def conductor(**config) -> Conductor:
    names = config.pop("names", ("p1", "d1"))
    config = {"ttft_slo": 100, "tbt_slo": 10, "rejection": "off", **config}
    return Conductor(ConductorConfig(nodes=tuple((n, f"http://{n}") for n in names), **config), tokenizer=None)


def serve(c: Conductor, name: str, st: dict) -> NodeView:
    node = c.nodes[name]
    node.apply(st)
    node.healthy = True
    return node


PROMPT = list(range(200))


def test_the_key_log_gives_changes_since_a_number_and_the_whole_set_when_they_are_gone():
    index = PrefixIndex()
    log = KeyLog(index, keep=3)
    assert log.since(-1) == {"seq": 0, "snapshot": []}
    index.update(0, [b"a", b"b"], [])
    log.record([b"a", b"b"], [])
    assert log.since(0) == {"seq": 2, "changes": [["61", True], ["62", True]]}
    index.update(1, [b"a"], [])
    log.record([b"a"], [])
    index.update(0, [], [b"a"])  # engine 1 still holds it: the node does
    log.record([], [b"a"])
    assert log.since(2) == {"seq": 3, "changes": [["61", True]]}
    index.update(1, [], [b"a"])
    log.record([], [b"a"])
    assert log.since(3) == {"seq": 4, "changes": [["61", False]]}
    assert sorted(log.since(0)["snapshot"]) == ["62"]  # changes after 0 are no longer kept
    log.record(None, None)  # the index was rebuilt
    assert "snapshot" in log.since(4)


def test_a_node_view_follows_snapshots_and_changes_and_counts_its_leading_prefix():
    keys = chain_page_keys(PROMPT, PAGE, [])
    node = NodeView("p1", "http://p1")
    node.apply(state("prefill", keys[:3]))
    assert node.prefix_tokens(keys) == 3 * PAGE
    node.apply({**state("prefill"), "keys": {"seq": 2, "changes": [[keys[1].hex(), False], [keys[5].hex(), True]]}})
    assert node.prefix_tokens(keys) == PAGE and node.seq == 2


def test_a_request_goes_to_the_prefill_node_holding_its_prefix_and_the_least_loaded_decode_node():
    c = conductor(names=("p1", "p2", "d1", "d2"))
    keys = chain_page_keys(PROMPT, PAGE, [])
    serve(c, "p1", state("prefill"))
    serve(c, "p2", state("prefill", keys[:10]))
    serve(c, "d1", state("decode", running=6))
    serve(c, "d2", state("decode", running=1))
    choice = c.place(PROMPT, set())
    assert isinstance(choice, Placement) and (choice.prefill, choice.decode) == ("p2", "d2")
    serve(c, "p2", state("prefill", keys[:10], waiting_tokens=100_000))  # its queue outweighs its cache
    assert c.place(PROMPT, set()).prefill == "p1"


KV_TOKEN = 50_000  # bytes of a token's KV, all layers


def kv(endpoint: str, **links: float) -> dict:
    return {"kv_token_bytes": KV_TOKEN, "kv_endpoints": [endpoint], "links": dict(links)}


def test_an_idle_prefill_node_fetches_the_long_prefix_a_busy_one_holds_at_the_measured_bandwidth():
    c = conductor(names=("p1", "p2", "d1"))
    keys = chain_page_keys(PROMPT, PAGE, [])
    serve(c, "p1", state("prefill", keys, kv=kv("p1:1", **{"p2:1": 1e9, "d1:1": 1e8}), waiting_tokens=50_000))
    serve(c, "p2", state("prefill", kv=kv("p2:1")))
    serve(c, "d1", state("decode", kv=kv("d1:1")))
    assert c.bandwidth("p1", "p2") == 1e9  # measured between the two: the egress to d1 does not count
    choice = c.place(PROMPT, set())
    assert (choice.prefill, choice.fetch_from, choice.fetch_tokens) == ("p2", "p1", 12 * PAGE)
    # 192 tokens at 50 kB each over 1 GB/s, then the 8 tokens p2 lacks still: 1 step
    assert choice.ttft_seconds == pytest.approx(12 * PAGE * KV_TOKEN / 1e9 + 0.01 + 8e-3)


def test_without_a_link_measured_between_two_nodes_the_sources_egress_then_the_nominal_link_stands_in():
    c = conductor(names=("p1", "p2", "d1"), link_gbps=8)
    serve(c, "p1", state("prefill", kv=kv("p1:1", **{"d1:1": 2e8, "d2:1": 4e8})))
    serve(c, "p2", state("prefill", kv=kv("p2:1")))
    assert c.bandwidth("p1", "p2") == pytest.approx(3e8)  # p1's mean egress
    assert c.bandwidth("p2", "p1") == pytest.approx(1e9)  # nothing measured by p2: 8 Gb/s


def test_no_fetch_without_a_link_or_when_the_gain_is_below_the_balancing_threshold():
    keys = chain_page_keys(PROMPT, PAGE, [])
    c = conductor(names=("p1", "p2", "d1"), link_gbps=0)  # no nominal link: only measured ones count
    serve(c, "p1", state("prefill", keys, kv=kv("p1:1"), waiting_tokens=50_000))
    serve(c, "p2", state("prefill", kv=kv("p2:1")))
    serve(c, "d1", state("decode", kv=kv("d1:1")))
    choice = c.place(PROMPT, set())
    assert (choice.prefill, choice.fetch_from, choice.fetch_tokens) == ("p2", None, 0)
    # a node that does not say how large a token's KV is cannot be priced: no fetch either
    c = conductor(names=("p1", "p2", "d1"))
    serve(c, "p1", state("prefill", keys, waiting_tokens=50_000))
    serve(c, "p2", state("prefill"))
    serve(c, "d1", state("decode"))
    assert c.place(PROMPT, set()).fetch_from is None
    # p2 holds 10 of the 12 pages: 12/10 < 1.5, so it computes the 2 it lacks rather than fetch them
    c = conductor(names=("p1", "p2", "d1"))
    serve(c, "p1", state("prefill", keys, kv=kv("p1:1", **{"p2:1": 1e9}), waiting_tokens=50_000))
    serve(c, "p2", state("prefill", keys[:10], kv=kv("p2:1")))
    serve(c, "d1", state("decode", kv=kv("d1:1")))
    choice = c.place(PROMPT, set())
    assert (choice.prefill, choice.fetch_from) == ("p2", None)


def test_nodes_that_are_gone_leave_placement_and_a_lone_side_serves_requests_whole():
    c = conductor()
    p1, d1 = serve(c, "p1", state("prefill")), serve(c, "d1", state("decode"))
    assert (c.place(PROMPT, set()).prefill, c.place(PROMPT, set()).decode) == ("p1", "d1")
    p1.healthy = False
    choice = c.place(PROMPT, set())
    assert (choice.prefill, choice.decode) == ("d1", "d1")
    assert isinstance(c.place(PROMPT, {"d1"}), Rejection)  # excluded after a refused connection
    d1.healthy = False
    p1.healthy = True
    assert (c.place(PROMPT, set()).prefill, c.place(PROMPT, set()).decode) == ("p1", "p1")


def test_colocated_nodes_are_their_own_pairs_and_the_least_ttft_wins():
    c = conductor(names=("a", "b"))
    serve(c, "a", state("both", waiting_tokens=5_000))
    serve(c, "b", state("both"))
    choice = c.place(PROMPT, set())
    assert (choice.prefill, choice.decode) == ("b", "b")


def test_a_prediction_over_the_slo_is_a_rejection():
    c = conductor()
    serve(c, "p1", state("prefill", waiting_tokens=10**6))
    serve(c, "d1", state("decode"))
    choice = c.place(PROMPT, set())
    assert isinstance(choice, Rejection) and choice.reason == "ttft"


def test_a_slow_reader_takes_a_decode_node_a_fast_one_may_not():
    c = conductor()  # tbt_slo 10 s
    serve(c, "p1", state("prefill"))
    serve(c, "d1", state("decode", running=7, per_token=2.0))  # 16 s between tokens
    assert isinstance(c.place(PROMPT, set()), Rejection)
    assert isinstance(c.place(PROMPT, set(), reading_rate=1 / 20), Placement)  # one token every 20 s


def test_early_rejection_refuses_when_the_decode_pool_is_full_by_then():
    c = conductor(rejection="current")
    serve(c, "p1", state("prefill"))
    serve(c, "d1", state("decode"))  # 8 seats
    choice = c.place(PROMPT, set())
    for i in range(8):
        assert c.admit(choice, 0.0)
        c.load.accepted(f"r{i}", 0.0)
        c.load.started(f"r{i}", 0.0)
    assert not c.admit(choice, 0.0)


def test_the_conductor_config_names_what_is_wrong(tmp_path):
    bad = tmp_path / "c.toml"
    bad.write_text("[conductor]\nport = 1\n")
    with pytest.raises(ValueError, match="nodes"):
        ConductorConfig.load(str(bad))
    bad.write_text('[conductor]\nspeed = 1\n[[nodes]]\nname = "a"\nurl = "http://a"\n')
    with pytest.raises(ValueError, match="speed"):
        ConductorConfig.load(str(bad))
    good = tmp_path / "g.toml"
    good.write_text('[conductor]\nrejection = "predicted"\n[[nodes]]\nname = "a"\nurl = "http://a/"\n')
    assert ConductorConfig.load(str(good)).nodes == (("a", "http://a"),)


def test_a_prefill_or_decode_role_without_the_federation_extra_says_how_to_install_it(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    why = federation_missing("prefill")
    assert "pip install 'tokenflowd[federation]'" in why and "libibverbs1" in why
    assert federation_missing("both") is None


def test_a_prefill_or_decode_node_runs_one_front_process(capsys):
    from tokenflowd.cli import main
    from tokenflowd.config import EngineConfig, ServerConfig
    from tokenflowd.daemon.serve import api_servers

    assert api_servers(ServerConfig(), EngineConfig(role="prefill", device="cuda")) == 1
    code = main(["serve", "--role", "prefill", "--api-servers", "2", "--port", "8123"])
    assert code == 2 and "one API server process" in capsys.readouterr().err
