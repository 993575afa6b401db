"""A decode node takes KV only from the prefill nodes of its --federation-peers: a request whose
X-Tokenflowd-Prefill-Node names another URL gets 403 before anything is reserved or sent, and the
URL named never hears from the node; a listed node, however its URL is spelled, is asked.

The real daemon on the embedded model, on this machine (no network namespaces); the prefill nodes
are stand-ins that note what they are sent and answer an order with a failure, so the decode node
computes the prompt itself (test_federation_cluster.py has real prefill nodes)."""
from __future__ import annotations

import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from daemon import Daemon  # noqa: E402

pytest.importorskip("mooncake.engine", reason="the federation extra (Mooncake Transfer Engine) is not installed")

MODEL = "smollm2-135m"
HEADER = "X-Tokenflowd-Prefill-Node"


class StandIn:
    """A prefill node that notes each call (path, body) and fails each order: nothing is written."""

    def __init__(self) -> None:
        calls = self.calls = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                calls.append((self.path, json.loads(body) if body else None))
                status, answer = (200, {"ok": False, "error": "a stand-in"}) if self.path == "/federation/prefill" \
                    else (409, {"error": {"message": "a stand-in keeps nothing"}})
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    listed, other = StandIn(), StandIn()
    log = tmp_path_factory.mktemp("peers") / "decode.log"
    # the list spells its URL otherwise than the headers below: the node compares one spelling
    decode = Daemon("--role", "decode", "--federation-peers", f"HTTP://127.0.0.1:{listed.port}/", "--dtype", "float32",
                    "--kv-cache-memory", "128MiB", "--kv-transfer-timeout", "4", log_path=str(log))
    yield decode, listed, other
    decode.stop()
    listed.close()
    other.close()


def complete(decode: Daemon, prefill_node: str):
    return decode.http.post("/v1/completions", headers={HEADER: prefill_node},
                            json={"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4,
                                  "temperature": 0})


@pytest.mark.parametrize("named", ["http://127.0.0.1:{other}", "http://localhost:{listed}",
                                   "https://127.0.0.1:{listed}", "http://127.0.0.1:{listed}/elsewhere",
                                   "http://127.0.0.1:{listed}@127.0.0.1:{other}"])
def test_a_prefill_node_not_listed_is_refused_and_hears_nothing(nodes, named):
    decode, listed, other = nodes
    listed.calls.clear()  # the stand-ins serve every test of the module, in any order
    other.calls.clear()
    before = decode.metric("tokenflowd_federation_prefills_total", side="decode")
    r = complete(decode, named.format(listed=listed.port, other=other.port))
    assert r.status_code in (400, 403), r.text
    error = r.json()["error"]
    assert error["param"] == HEADER
    if r.status_code == 403:
        assert error["code"] == "unlisted_peer" and "--federation-peers" in error["message"], error
    # (a reply's KV given back after an earlier test's request may still reach the listed node)
    assert other.calls == [] and [path for path, _ in listed.calls if path != "/federation/keep"] == []
    assert decode.metric("tokenflowd_federation_prefills_total", side="decode") == before
    assert decode.wait_idle() == (0, 0)
    assert decode.metric("tokenflowd_kv_remote_pages") == 0


def test_a_listed_prefill_node_is_asked_however_its_url_is_spelled(nodes):
    decode, listed, other = nodes
    listed.calls.clear()
    other.calls.clear()
    want = decode.http.post("/v1/completions", json={"model": MODEL, "prompt": "The capital of France is",
                                                     "max_tokens": 4, "temperature": 0}).json()["choices"][0]["text"]
    r = complete(decode, f"http://127.0.0.1:{listed.port}")
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == want  # its order failed: the decode node computed the prompt
    orders = [body for path, body in listed.calls if path == "/federation/prefill"]
    assert len(orders) == 1 and orders[0]["target"] is not None and orders[0]["prompt_token_ids"]
    assert other.calls == []
    assert decode.wait_idle() == (0, 0)
