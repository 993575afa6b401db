"""The conductor's proxy against stand-in nodes (small aiohttp apps on loopback): the decode node's
SSE bytes reach the client unchanged with the prefill node named in a header; a decode node that
refuses connections leaves placement and the request is placed again; a stream that breaks midway
ends with an SSE error event; early rejection answers 429 with Retry-After before any node sees
the request; GET /v1/requests merges the nodes' lists and names those that did not answer."""
from __future__ import annotations

import asyncio
import contextlib

import aiohttp
from aiohttp import web

from tokenflowd.federation.conductor.service import build_conductor_app
from tokenflowd.federation.conductor.config import ConductorConfig
from tokenflowd.federation.conductor.core import Conductor
from tokenflowd.kv.pages import chain_page_keys

SSE = [b'data: {"choices": [{"text": "a"}]}\n\n', b'data: {"choices": [{"text": "b"}]}\n\n', b"data: [DONE]\n\n"]


class Tokenizer:
    def encode(self, text: str) -> list[int]:
        return [ord(c) % 100 for c in text]


def node_app(role: str, seen: list, break_after: int | None = None, waiting_tokens: int = 0,
             **published) -> web.Application:
    """`published`: more of the node's /federation/state (its prefix keys, its transfer engines)."""
    async def state(request: web.Request) -> web.Response:
        engine = {"engine": 0, "running": 0, "waiting": 0, "waiting_tokens": waiting_tokens, "step_base": 0.01,
                  "step_per_token": 1e-4, "kv_pages_used": 0, "kv_pages_total": 10, "kv_remote_pages": 0,
                  "max_num_seqs": 2, "max_num_batched_tokens": 64, "max_model_len": 512}
        return web.json_response({"role": role, "page_size": 16, "engines": [engine],
                                  "keys": {"seq": 0, "snapshot": []}, **published})

    async def completions(request: web.Request) -> web.StreamResponse:
        seen.append((dict(request.headers), await request.read()))
        r = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await r.prepare(request)
        for i, chunk in enumerate(SSE):
            if break_after is not None and i == break_after:
                request.transport.close()  # the node dies mid-stream
                return r
            await r.write(chunk)
        await r.write_eof()
        return r

    app = web.Application()
    app.router.add_get("/federation/state", state)
    app.router.add_post("/v1/completions", completions)
    return app


async def serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}"


async def cluster(nodes: list[tuple[str, str]], wait: float = 5.0, **config):
    c = Conductor(ConductorConfig(nodes=tuple(nodes), poll_interval=0.05, ttft_slo=100, tbt_slo=100, **config),
                  Tokenizer())
    runner, url = await serve(build_conductor_app(c))
    deadline = asyncio.get_running_loop().time() + wait
    while not all(n.serving for n in c.nodes.values()) and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.02)
    return c, runner, url


def run(coro):
    return asyncio.run(coro)


async def post(url: str, prompt: str = "hello") -> tuple[int, dict, bytes]:
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{url}/v1/completions", json={"model": "m", "prompt": prompt, "stream": True},
                          headers={"Authorization": "Bearer k", "X-Reading-Rate": "5"}) as r:
            return r.status, dict(r.headers), await r.read()


def test_the_decode_nodes_stream_reaches_the_client_unchanged_with_the_prefill_node_named():
    async def main():
        seen_p, seen_d = [], []
        (rp, up), (rd, ud) = await serve(node_app("prefill", seen_p)), await serve(node_app("decode", seen_d))
        c, rc, url = await cluster([("p", up), ("d", ud)])
        try:
            status, headers, body = await post(url)
        finally:
            for r in (rc, rp, rd):
                await r.cleanup()
        assert status == 200 and body == b"".join(SSE) and headers["Content-Type"] == "text/event-stream"
        assert not seen_p and len(seen_d) == 1
        sent_headers, sent_body = seen_d[0]
        assert sent_headers["X-Tokenflowd-Prefill-Node"] == up
        assert sent_headers["Authorization"] == "Bearer k" and sent_headers["X-Reading-Rate"] == "5"
        assert b'"prompt": "hello"' in sent_body or b'"prompt":"hello"' in sent_body
        assert c.placed == {"p->d": 1}
    run(main())


def test_a_prefill_node_placed_to_fetch_a_longer_prefix_is_named_with_the_node_that_holds_it():
    prompt = "the same long system prompt, " * 8
    keys = [k.hex() for k in chain_page_keys(Tokenizer().encode(prompt), 16, [])]

    def kv(endpoint: str, **links: float) -> dict:
        return {"kv_token_bytes": 10_000, "kv_endpoints": [endpoint], "links": links}

    async def main():
        seen_d = []
        # "busy" holds the whole prompt but has a long queue; "idle" holds none of it
        (rb, ub), (ri, ui), (rd, ud) = (
            await serve(node_app("prefill", [], waiting_tokens=200_000, keys={"seq": 1, "snapshot": keys},
                                 **kv("busy:1", **{"idle:1": 1e9}))),
            await serve(node_app("prefill", [], **kv("idle:1"))),
            await serve(node_app("decode", seen_d, **kv("d:1"))))
        c, rc, url = await cluster([("busy", ub), ("idle", ui), ("d", ud)])
        try:
            status, _, _ = await post(url, prompt)
            _, _, _ = await post(url)  # "hello": no node holds any of it, so nothing is fetched
        finally:
            for r in (rc, rb, ri, rd):
                await r.cleanup()
        assert status == 200 and len(seen_d) == 2
        assert seen_d[0][0]["X-Tokenflowd-Prefill-Node"] == ui
        assert seen_d[0][0]["X-Tokenflowd-Prefix-Node"] == ub
        assert "X-Tokenflowd-Prefix-Node" not in seen_d[1][0]
        assert c.counts["fetched"] == 1 and c.placed == {"idle->d": 2}
    run(main())


def test_a_decode_node_that_refuses_connections_leaves_placement_and_the_request_is_placed_again():
    async def main():
        seen = []
        (rp, up), (rd, ud) = await serve(node_app("prefill", seen)), await serve(node_app("decode", []))
        c, rc, url = await cluster([("p", up), ("d", ud)])
        try:
            await rd.cleanup()  # the decode node is gone, and the conductor has not polled it since
            c.nodes["d"].healthy = True
            status, _, body = await post(url)
        finally:
            for r in (rc, rp):
                await r.cleanup()
        assert status == 200 and body == b"".join(SSE)
        assert not c.nodes["d"].healthy and c.counts["replaced"] == 1
        assert c.placed == {"p->d": 1, "p->p": 1} and len(seen) == 1  # the prefill node served it whole
    run(main())


def test_a_stream_that_breaks_midway_ends_with_an_error_event():
    async def main():
        (rp, up), (rd, ud) = await serve(node_app("prefill", [])), await serve(node_app("decode", [], break_after=1))
        c, rc, url = await cluster([("p", up), ("d", ud)])
        try:
            status, _, body = await post(url)
        finally:
            for r in (rc, rp, rd):
                await r.cleanup()
        assert status == 200 and body.startswith(SSE[0]) and b'"error"' in body and c.counts["failed"] == 1
        assert not c.load._decoding and not c.load._pending  # its decode is over, for the rejection's count
    run(main())


def test_early_rejection_answers_429_with_retry_after_before_any_node_sees_the_request():
    async def main():
        seen = []
        (rp, up), (rd, ud) = await serve(node_app("prefill", [])), await serve(node_app("decode", seen))
        c, rc, url = await cluster([("p", up), ("d", ud)], rejection="current")
        try:
            for i in range(2):  # the decode node's two seats are taken
                c.load.accepted(f"r{i}", 0.0)
                c.load.started(f"r{i}", 0.0)
            status, headers, _ = await post(url)
        finally:
            for r in (rc, rp, rd):
                await r.cleanup()
        assert status == 429 and int(headers["Retry-After"]) >= 1 and not seen and c.counts["rejected"] == 1
    run(main())


def test_no_node_serving_is_503():
    async def main():
        c, rc, url = await cluster([("d", "http://127.0.0.1:9")], wait=0.3)
        try:
            status, _, _ = await post(url)
        finally:
            with contextlib.suppress(Exception):
                await rc.cleanup()
        assert status == 503
    run(main())


def listing_app(role: str, ids: list[str], seen: list, status: int = 200) -> web.Application:
    """A stand-in node that lists `ids` as its requests under way to the key "k", refuses others
    (401), or answers `status`."""
    async def request_list(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization"))
        if request.headers.get("Authorization") != "Bearer k":
            return web.json_response({"error": {"message": "bad key", "code": "invalid_api_key"}}, status=401)
        if status != 200:
            return web.json_response({"error": {"message": "broken"}}, status=status)
        return web.json_response({"object": "list", "data": [{"request_id": i, "state": "running"} for i in ids]})

    app = node_app(role, [])
    app.router.add_get("/v1/requests", request_list)
    return app


async def get(url: str, key: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{url}/v1/requests", headers={"Authorization": f"Bearer {key}"}) as r:
            return r.status, await r.json()


def test_the_request_list_merges_every_nodes_and_names_those_that_did_not_answer():
    async def main():
        seen: list = []
        (rp, up), (rd, ud), (rb, ub) = (await serve(listing_app("prefill", ["prefill-a"], seen)),
                                        await serve(listing_app("decode", ["a", "b"], seen)),
                                        await serve(listing_app("decode", ["c"], seen, status=500)))
        c, rc, url = await cluster([("p", up), ("gone", "http://127.0.0.1:9"), ("d", ud), ("broken", ub)], wait=0)
        try:
            for _ in range(250):
                if all(c.nodes[n].serving for n in ("p", "d", "broken")):
                    break
                await asyncio.sleep(0.02)
            status, body = await get(url, "k")
            seen_with_key = list(seen)
            refused, refusal = await get(url, "wrong")
        finally:
            for r in (rc, rp, rd, rb):
                await r.cleanup()
        assert status == 200, body
        # the prefill node's order for "a" is not listed twice: "a" is the decode node's
        assert body["object"] == "list" and [r["request_id"] for r in body["data"]] == ["a", "b"]
        assert body["unreachable"] == ["gone", "broken"]
        assert seen_with_key == ["Bearer k"] * 3  # the client's key, to each node that serves
        assert refused == 401 and refusal["error"]["code"] == "invalid_api_key"
    run(main())


def test_the_request_list_with_no_node_answering_is_502():
    async def main():
        c, rc, url = await cluster([("d", "http://127.0.0.1:9")], wait=0.3)
        try:
            status, body = await get(url, "k")
        finally:
            await rc.cleanup()
        assert status == 502 and "d" in body["error"]["message"]
    run(main())
