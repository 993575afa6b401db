"""A prefill node pulls a longer prefix from another prefill node before it computes a prompt
(Mooncake's Algorithm 1, its transfer branch), on real daemons over loopback: prefill nodes A and B
and a decode node D on the embedded model, KV over Mooncake's transfer engine (TCP on 127.0.0.1).
The conductor's part is to name the nodes; here the tests name them in the headers it would add.

- A holds a long prompt; asked through D to prefill it with A named as the prefix's holder, B pulls
  A's whole pages of it (/federation/give), publishes them, and its prefill hits them: the same
  greedy tokens as A's, with the pulled pages counted as cached. The copy stays in B's cache.
- A source that is not listening, or that never answers, costs the prompt its pull and nothing
  else: B computes it and the tokens are the same; a client that goes meanwhile calls the order
  off. No KV page stays taken on any node.
- A node of role both, which has no transfer engine, refuses to give (409).
- Prefill and decode trade roles (POST /federation/role, PrfaaS's long-term re-planning): D, with
  streams under way, refuses to become a prefill node until they have ended (409 draining); none
  is cut short. B becomes a decode node and serves a request A prefills, with the tokens D gives.
  No KV page stays taken.
"""
from __future__ import annotations

import json
import os
import socket
import sys

import httpx
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from daemon import Daemon, free_port, wait_for  # noqa: E402
from daemon import assert_no_pages_held as held_nothing  # noqa: E402

pytest.importorskip("mooncake.engine", reason="the federation extra (Mooncake Transfer Engine) is not installed")
pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
PAGE = 16
TIMEOUT = 2  # --kv-transfer-timeout: a store never reported or failed frees its pages 4x + 1x + 5 s later
NODE_ARGS = ("--dtype", "float32", "--kv-cache-memory", "64MiB", "--kv-transfer-timeout", str(TIMEOUT))
PREFILL, PREFIX = "X-Tokenflowd-Prefill-Node", "X-Tokenflowd-Prefix-Node"
NODE_KEY, USER_KEY = "sk-node-test", "sk-user-test"
AS_NODE = {"Authorization": f"Bearer {NODE_KEY}"}


@pytest.fixture(scope="module")
def sources():
    """Two sources D lists as peers: one gone (nobody listens on its port) and one that takes
    connections and never answers (a pull from it ends at the transfer timeout)."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        yield f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{silent.getsockname()[1]}"
    finally:
        silent.close()


@pytest.fixture(scope="module")
def nodes(tmp_path_factory, sources):
    tmp = tmp_path_factory.mktemp("pull")
    auth = tmp / "auth.toml"  # a keyed cluster: the nodes call each other with the node key alone
    auth.write_text(f'[auth.keys."{NODE_KEY}"]\nrole = "node"\n[auth.keys."{USER_KEY}"]\n')
    args = (*NODE_ARGS, "--config", str(auth))
    env = {"TOKENFLOWD_NODE_KEY": NODE_KEY}
    started = []
    try:
        started.append(Daemon("--role", "prefill", *args, env=env, wait=False, log_path=str(tmp / "a.log")))
        # B pulls from the nodes it lists, and may become a decode node (the role test)
        started.append(Daemon("--role", "prefill", "--federation-peers", ",".join([started[0].base_url, *sources]),
                              *args, env=env, wait=False, log_path=str(tmp / "b.log")))
        peers = ",".join([n.base_url for n in started] + list(sources))
        started.append(Daemon("--role", "decode", "--federation-peers", peers, *args, env=env, wait=False,
                              log_path=str(tmp / "d.log")))
        for node in started:
            node.http.headers["Authorization"] = f"Bearer {USER_KEY}"  # a client's key
            node.wait_healthy(240)
        yield started
    finally:
        for node in started:
            node.stop()


def chat(node: Daemon, system: str, headers: dict[str, str] | None = None) -> tuple[str, int, int]:
    """(text, prompt tokens, cached prompt tokens) of a greedy completion served by `node`."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Say something kind."}]
    r = node.http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 16,
                                                     "temperature": 0}, headers=headers or {})
    assert r.status_code == 200, r.text
    body = r.json()
    usage = body["usage"]
    return (body["choices"][0]["message"]["content"], usage["prompt_tokens"],
            (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def pulls(node: Daemon, outcome: str) -> float:
    return node.metric("tokenflowd_federation_prefills_total", side="pull", outcome=outcome)


def assert_no_pages_held(node: Daemon, within: float = 6 * TIMEOUT + 15) -> None:  # past timing.py's horizon
    held_nothing(node, within)


def test_a_prefill_node_pulls_the_prefix_another_holds_hits_it_and_keeps_it(nodes):
    a, b, d = nodes
    system = "You are a patient guide to the birds of the northern forests, and you answer briefly. " * 5
    want, prompt_tokens, _ = chat(d, system, {PREFILL: a.base_url})  # A computes it: its cache holds it
    whole = (prompt_tokens - 1) // PAGE * PAGE  # the pages a prefill can hit (its last token is computed)
    assert whole >= 6 * PAGE
    # a conductor orders a pull once the source's state shows the pages: so does this test
    wait_for(lambda: len(a.http.get("/federation/state", headers=AS_NODE).json()["keys"]["snapshot"])
             >= whole // PAGE, 10)
    ok, failed = pulls(b, "ok"), pulls(b, "failed")
    prefilled = b.metric("tokenflowd_federation_prefills_total", side="prefill", outcome="ok")
    text, _, cached = chat(d, system, {PREFILL: b.base_url, PREFIX: a.base_url})
    assert text == want
    assert cached >= whole, (cached, whole)  # B held none of it: every page it hit came from A
    assert (pulls(b, "ok"), pulls(b, "failed")) == (ok + 1, failed)
    assert b.metric("tokenflowd_federation_prefills_total", side="prefill", outcome="ok") == prefilled + 1
    # the copy stayed: B alone hits it
    text, _, cached = chat(b, system)
    assert text == want and cached >= whole
    # what a conductor prices the next fetch with: a token's KV, and the link A's give to B measured
    assert a.http.get("/federation/state").status_code == 403  # a client's key is not a node's
    state_a = a.http.get("/federation/state", headers=AS_NODE).json()
    assert state_a["kv_token_bytes"] == 2 * 30 * 3 * 64 * 4  # K and V, layers, KV heads, head_dim, float32
    endpoint_b, = b.http.get("/federation/state", headers=AS_NODE).json()["kv_endpoints"]
    wait_for(lambda: endpoint_b in a.http.get("/federation/state", headers=AS_NODE).json()["links"], 10)
    assert a.http.get("/federation/state", headers=AS_NODE).json()["links"][endpoint_b] > 0
    for node in nodes:
        assert_no_pages_held(node)


def test_a_pull_from_a_source_that_is_gone_or_silent_falls_back_to_computing_the_prompt_or_is_called_off(
        nodes, sources):
    _, b, d = nodes
    gone, silent = sources
    for size, source in (("small", gone), ("large", silent)):
        # a prompt of its own for each: B computes it, and it must not hit there the next time
        system = f"You are a terse assistant for a {size} library that lends tools as well as books. " * 5
        want, _, _ = chat(d, system)  # D alone
        ok, failed = pulls(b, "ok"), pulls(b, "failed")
        prefilled = d.metric("tokenflowd_federation_prefills_total", side="decode", outcome="ok")
        text, _, _ = chat(d, system, {PREFILL: b.base_url, PREFIX: source})
        assert text == want, source
        assert (pulls(b, "ok"), pulls(b, "failed")) == (ok, failed + 1), source
        # B still prefilled it for D: its heartbeats went on while it pulled
        assert d.metric("tokenflowd_federation_prefills_total", side="decode", outcome="ok") == prefilled + 1
    # a client that goes while B pulls calls the order off: B computes nothing for it
    prefilled = [b.metric("tokenflowd_federation_prefills_total", side="prefill", outcome=outcome)
                 for outcome in ("ok", "failed")]
    failed = pulls(b, "failed")
    messages = [{"role": "user", "content": "Name three rivers of Europe and where they meet the sea. " * 4}]
    with pytest.raises(httpx.TimeoutException):
        d.http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 8},
                    headers={PREFILL: b.base_url, PREFIX: silent},
                    timeout=0.5)
    wait_for(lambda: pulls(b, "failed") == failed + 1, 10)
    wait_for(lambda: b.metric("tokenflowd_federation_prefills_total", side="prefill", outcome="failed")
             == prefilled[1] + 1, 10)
    assert b.metric("tokenflowd_federation_prefills_total", side="prefill", outcome="ok") == prefilled[0]
    for node in nodes:
        assert_no_pages_held(node)


def test_a_prefix_node_that_is_not_a_url_is_refused_and_one_without_a_prefill_node_is_ignored(nodes):
    _, b, d = nodes
    r = d.http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                                  "max_tokens": 2}, headers={PREFILL: b.base_url, PREFIX: "b:8000"})
    assert r.status_code == 400 and PREFIX in r.text
    # a source not in D's --federation-peers: the pull is dropped, the request served (B computes it)
    pulled = pulls(b, "ok") + pulls(b, "failed")
    assert chat(d, "Hi there.", {PREFILL: b.base_url, PREFIX: "http://127.0.0.1:1"})[0] == chat(d, "Hi there.")[0]
    assert pulls(b, "ok") + pulls(b, "failed") == pulled
    pulled = pulls(b, "ok") + pulls(b, "failed")
    prefilled = d.metric("tokenflowd_federation_prefills_total", side="decode", outcome="ok")
    assert chat(d, "Hello.", {PREFIX: b.base_url})[0] == chat(d, "Hello.")[0]  # D computes it itself
    assert pulls(b, "ok") + pulls(b, "failed") == pulled
    assert d.metric("tokenflowd_federation_prefills_total", side="decode", outcome="ok") == prefilled


def test_give_refuses_what_it_cannot_give_with_a_reason():
    both = Daemon(null_engine=True)  # role both: its engines have no transfer engine
    try:
        target = {"endpoint": "127.0.0.1:1", "bases": [0], "shape": [2, 1, 4, 16, 8], "itemsize": 4, "page_axis": 2,
                  "pages": [0]}
        r = both.http.post("/federation/give", json={"store_id": "s", "token_ids": list(range(1, 40)), "held": 0,
                                                     "target": target})
        assert r.status_code == 409 and "transfer engine" in r.json()["error"]["message"]
        r = both.http.post("/federation/give", json={"store_id": "s", "token_ids": [1, 2]})
        assert r.status_code == 400 and "give order" in r.json()["error"]["message"]
    finally:
        both.stop()


def role(node: Daemon, new: str) -> httpx.Response:
    return node.http.post("/federation/role", json={"role": new}, headers=AS_NODE)


def test_prefill_and_decode_trade_roles_once_drained_and_no_stream_is_cut_short(nodes):
    import concurrent.futures

    a, b, d = nodes
    system = "You are a keeper of lighthouses and you describe the sea at night in plain words. " * 3
    want, _, _ = chat(d, system)  # D alone

    def stream(i: int) -> tuple[str | None, int]:
        messages = [{"role": "user", "content": f"Tell story number {i} about a small boat."}]
        with d.http.stream("POST", "/v1/chat/completions", headers={PREFILL: a.base_url},
                           json={"model": MODEL, "messages": messages, "max_tokens": 96, "stream": True,
                                 "ignore_eos": True,  # greedy under batching may end early: judge the stream
                                 "reading_rate": 24, "stream_options": {"include_usage": True}}) as r:
            assert r.status_code == 200, r.read()
            finish, tokens = None, 0
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
                    for choice in chunk.get("choices", []):
                        finish = choice.get("finish_reason") or finish
            return finish, tokens

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        streams = [pool.submit(stream, i) for i in range(4)]
        wait_for(lambda: d.metric("tokenflowd_requests_running") >= 1, 30)
        refused = role(d, "prefill")
        assert refused.status_code == 409 and refused.json()["error"]["code"] == "draining"
        results = [f.result(120) for f in streams]
    assert results == [("length", 96)] * 4, results  # every stream ran to its end
    try:
        r = role(d, "prefill")
        assert r.status_code == 200 and r.json() == {"role": "prefill", "changed": True}
        assert d.http.get("/federation/state", headers=AS_NODE).json()["role"] == "prefill"
        # B, a prefill node, becomes a decode node: A prefills for it, and its tokens are D's
        assert role(b, "decode").json() == {"role": "decode", "changed": True}
        text, _, _ = chat(b, system, {PREFILL: a.base_url})
        assert text == want
        assert b.metric("tokenflowd_federation_prefills_total", side="decode", outcome="ok") >= 1
        assert role(a, "decode").status_code == 409  # A has no --federation-peers: it cannot take KV
    finally:
        assert role(b, "prefill").status_code == 200 and role(d, "decode").status_code == 200
    for node in nodes:
        assert_no_pages_held(node)
