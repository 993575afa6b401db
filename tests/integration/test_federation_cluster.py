"""A federated cluster on one machine: a prefill node, a decode node and the conductor, each a real
`tokenflowd` process in its own network namespace, joined by veth pairs; KV moves over Mooncake's
transfer engine (TCP) between the namespaces, and the official openai client streams through the
conductor.

- 20 greedy completions (single prompts and two-turn conversations) equal the decode node's own,
  computed alone; the second turn of a conversation hits the prefill node's prefix cache.
- Link faults: with delay and loss (tc netem) the outputs stay the same; with the prefill node's
  link down in the middle of its layer-wise transfer, the stream ends normally (the decode node
  computes the prompt once the transfer times out), the conductor routes around the dead node and
  takes it back when its link returns, and no KV page stays taken on either node.
"""
from __future__ import annotations

import os
import sys
import threading
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from daemon import Daemon, wait_for  # noqa: E402
from daemon import assert_no_pages_held as held_nothing  # noqa: E402
from federated import MODEL, Cluster  # noqa: E402
from netns import available  # noqa: E402

pytest.importorskip("mooncake.engine", reason="the federation extra (Mooncake Transfer Engine) is not installed")
openai = pytest.importorskip("openai")
_why = available()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(_why is not None, reason=_why or "")]

TIMEOUT = 4  # --kv-transfer-timeout: a transfer given up after it, its pages free 2x later
NODE_ARGS = ("--dtype", "float32", "--kv-cache-memory", "128MiB", "--kv-transfer-timeout", str(TIMEOUT),
             "--log-level", "INFO")
QUESTIONS = [
    "What is the capital of France?", "Name three primary colors.", "Why is the sky blue?",
    "Write a haiku about rain.", "What is 12 times 12?", "Give me a synonym for happy.",
    "How many legs does a spider have?", "What does a compiler do?", "Name a planet with rings.",
    "What is photosynthesis?", "Translate 'good morning' into Spanish.", "Who wrote Romeo and Juliet?",
    "What is the boiling point of water in Celsius?", "Suggest a name for a cat.",
]
CONVERSATIONS = [
    ("You are a helpful travel guide. " * 6, "Plan one day in Rome.", "And what should I eat there?"),
    ("You are a patient math tutor. " * 6, "What is a prime number?", "Is 91 one of them?"),
    ("You answer in one short paragraph. " * 6, "What is a black hole?", "Could one form from our sun?"),
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("cluster"), NODE_ARGS)
    c.client = openai.OpenAI(base_url=f"{c.url}/v1", api_key="none", timeout=120, max_retries=0)
    yield c
    c.close()


def chat(client, messages: list[dict], max_tokens: int = 24) -> tuple[str, int, int]:
    """(text, prompt tokens, cached prompt tokens) of a streamed greedy completion."""
    text, usage = [], None
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens,
                                                temperature=0, stream=True, stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    details = usage.prompt_tokens_details
    return "".join(text), usage.prompt_tokens, (details.cached_tokens or 0) if details else 0


def alone(node: Daemon, messages: list[dict], max_tokens: int = 24) -> str:
    """The decode node's own completion: no prefill node named, it computes the prompt itself."""
    r = node.http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": max_tokens,
                                                     "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def assert_no_pages_held(node: Daemon, within: float = 5 * TIMEOUT + 15) -> None:  # past timing.py's horizon
    held_nothing(node, within)


def counts(cluster) -> tuple[int, float, float]:
    """(requests placed prefill->decode, the decode node's and the prefill node's prefills that went
    well): the tests share one cluster, in any order, so each counts from where it starts."""
    return (cluster.health()["placed"].get("prefill->decode", 0),
            cluster.decode.metric("tokenflowd_federation_prefills_total", side="decode", outcome="ok"),
            cluster.prefill.metric("tokenflowd_federation_prefills_total", side="prefill", outcome="ok"))


def test_greedy_output_through_the_cluster_equals_one_nodes_and_a_second_turn_hits_the_prefill_cache(cluster):
    client = cluster.client
    cluster.wait(lambda h: h["nodes"]["prefill"]["serving"] and h["nodes"]["decode"]["serving"], 60)
    before = counts(cluster)
    asked: list[tuple[list[dict], str]] = []
    for q in QUESTIONS:
        messages = [{"role": "user", "content": q}]
        asked.append((messages, chat(client, messages)[0]))
    prompt_pages = hits = 0
    for system, first, second in CONVERSATIONS:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": first}]
        returned = cluster.decode.metric("tokenflowd_federation_prefills_total", side="return", outcome="ok")
        reply, prompt_tokens, _ = chat(client, messages)
        asked.append((list(messages), reply))
        wait_for(lambda: cluster.decode.metric("tokenflowd_federation_prefills_total", side="return",
                                               outcome="ok") > returned, 30)  # the reader's pause covers it
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": second}]
        reply2, _, cached = chat(client, messages)
        asked.append((messages, reply2))
        # the first turn's prompt is in the prefill node's cache, whole pages of it at least
        assert cached >= prompt_tokens // 16 * 16 >= 48, (cached, prompt_tokens)
        prompt_pages += prompt_tokens // 16 * 16
        hits += cached
    # and so is the reply, which the decode node gave back (MemServe): turns hit beyond their prompts
    assert hits > prompt_pages, (hits, prompt_pages)
    assert len(asked) == 20
    after = counts(cluster)
    assert [a - b for a, b in zip(after, before)] == [20, 20, 20], (before, after, cluster.health())
    for messages, text in asked:
        assert text == alone(cluster.decode, messages), messages
    assert_no_pages_held(cluster.prefill)
    assert_no_pages_held(cluster.decode)


def test_delay_and_loss_on_the_prefill_link_change_no_output(cluster):
    if not cluster.net.has_netem():
        pytest.skip("this kernel has no netem qdisc (tc qdisc ... netem: unknown qdisc)")
    messages = [{"role": "user", "content": "Name the largest ocean on Earth."}]
    want = alone(cluster.decode, messages)
    cluster.net.netem("prefill", "delay", "20ms", "loss", "2%")
    try:
        for _ in range(3):
            assert chat(cluster.client, messages)[0] == want
    finally:
        cluster.net.netem("prefill")
    assert_no_pages_held(cluster.prefill)
    assert_no_pages_held(cluster.decode)


def test_a_link_down_mid_transfer_hangs_no_stream_leaks_no_page_and_the_conductor_routes_around_it(cluster):
    client, net = cluster.client, cluster.net
    messages = [{"role": "user", "content": "Name the largest ocean on Earth."}]
    want = alone(cluster.decode, messages)

    # a long prompt, so that the prefill node is still streaming layers when its link goes down
    long = [{"role": "user", "content": "Summarize this: " + "the quick brown fox jumps over the lazy dog. " * 250}]
    want_long = alone(cluster.decode, long, max_tokens=8)
    failed_before = cluster.decode.metric("tokenflowd_federation_prefills_total", side="decode", outcome="failed")
    result: dict = {}

    def ask() -> None:
        try:
            result["text"] = chat(client, long, max_tokens=8)[0]
        except Exception as e:  # noqa: BLE001 - the assertion below says what it was
            result["error"] = e

    asker = threading.Thread(target=ask)
    asker.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the prefill node is computing it
        state = cluster.prefill.http.get("/federation/state").json()
        if any(e["running"] or e["waiting"] for e in state["engines"]):
            break
        time.sleep(0.02)
    net.link("prefill", False)
    try:
        asker.join(120)
        assert not asker.is_alive(), "the stream hung"
        assert result.get("text") == want_long, result
        assert cluster.decode.metric("tokenflowd_federation_prefills_total", side="decode", outcome="failed") == failed_before + 1
        h = cluster.wait(lambda h: not h["nodes"]["prefill"]["healthy"], 10)
        routed = h["placed"].get("decode->decode", 0)
        assert chat(client, messages)[0] == want  # the decode node serves it whole
        assert cluster.health()["placed"].get("decode->decode", 0) == routed + 1
    finally:
        net.link("prefill", True)
    h = cluster.wait(lambda h: h["nodes"]["prefill"]["serving"], 30)
    before = h["placed"].get("prefill->decode", 0)
    assert chat(client, messages)[0] == want
    assert cluster.health()["placed"].get("prefill->decode", 0) == before + 1
    assert_no_pages_held(cluster.prefill)
    assert_no_pages_held(cluster.decode)
