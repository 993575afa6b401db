"""The load generator (loadgen/) on CPU: metrics on hand-built timelines, seeded workloads, BurstGPT
CSV replay, the reader client against a small in-test SSE server (timeout, abandon, reconciliation
with usage, errors), compare mode and the command line."""
from __future__ import annotations

import asyncio
import json
import math
import threading

import msgspec
import pytest
from aiohttp import web

from loadgen.cli import main, parse_args
from loadgen.measure import workload_from_args
from loadgen.client import ClientConfig, RequestRecord, run_blocking
from loadgen.report import SLO, record_dict, summary
from loadgen.workload import (BodyFormat, LoadRequest, LoadWorkload, abandon_points, build_requests, load_requests,
                              read_burstgpt)
from tokenflowd.sim.workload import (BLOCK_TOKENS, DEFAULT_TRACE, WorkloadRequest, WorkloadSpec, build_workload,
                                     parse_lengths, parse_reading_rates)


def rec(arrival: float, rate: float, times: list[float], outcome: str = "completed", rid: str = "r") -> RequestRecord:
    r = RequestRecord(rid, arrival, rate, 8, len(times), arrival=arrival, token_times=list(times))
    r.outcome = outcome
    return r


# -- (1) metrics on hand-built timelines --------------------------------------------------------
def test_stall_accounting_by_hand():
    # 1 token/s. Token 1 at 0; token 2 at 0.5 (0.5 unread); the reader runs dry at 2 and waits
    # until token 3 at 3 (stall 1: 1 s); token 4 at 3.2 lands on 0.8 unread; the 1.8 left are read
    # by 5 and the reader waits until token 5 at 6 (stall 2: 1 s).
    d = record_dict(rec(0.0, 1.0, [0.0, 0.5, 3.0, 3.2, 6.0]))
    assert d["num_stalls"] == 2
    assert d["rebuffer"] == pytest.approx(2.0)
    assert d["ttft"] == 0.0
    # effective weights, output 5: full up to 0.5 buffered, 0 at 1.0: 1, 1, 1, 1 − 2·(0.8 − 0.5), 1
    assert d["effective_tokens"] == pytest.approx(4.4)


def test_effective_throughput_weights_of_a_flood():
    # 10 tokens in one event at t = 1 (rate 1): token j lands on j − 1 unread; output 10 → full
    # weight up to 1 buffered, none from 2: weights 1, 1, 0, … → 2 effective tokens over T = 1 s.
    s = summary([rec(0.0, 1.0, [1.0] * 10)], SLO(), duration=1.0)
    assert s["span"] == 1.0
    assert s["throughput"] == 10.0
    assert s["effective_throughput"] == pytest.approx(2.0)
    assert s["num_stalls"] == 0 and s["itl_mean"] == 0.0


def three_requests() -> list[RequestRecord]:
    a = rec(0.0, 2.0, [1.0, 1.5, 2.0, 5.0], rid="a")  # TTFT 1, one 2.5 s stall, effective 4
    b = rec(1.0, 4.0, [3.0, 3.25, 3.5], rid="b")  # TTFT 2, read as it comes
    c = rec(0.0, 1.0, [], outcome="error", rid="c")  # never served
    return [a, b, c]


def test_summary_qos_itl_and_outcomes_by_hand():
    s = summary(three_requests(), SLO(), duration=5.5)
    assert s["requests"] == 3 and s["requests_served"] == 2
    assert s["completed"] == 2 and s["errors"] == 1 and s["aborted"] == 0 and s["abandoned"] == 0
    assert s["span"] == 5.0 and s["duration"] == 5.5
    assert s["output_tokens"] == 7 and s["throughput"] == pytest.approx(7 / 5)
    assert s["ttft_mean"] == pytest.approx(1.5)
    assert s["ttft_p50"] == pytest.approx(1.5) and s["ttft_p90"] == pytest.approx(1.9)
    assert s["rebuffer_total"] == pytest.approx(2.5) and s["rebuffer_mean"] == pytest.approx(2.5 / 3)
    assert s["num_stalls"] == 1
    # gaps 0.5, 0.5, 3 and 0.25, 0.25: mean 0.9; p99 at rank 3.96 of [.25 .25 .5 .5 3]
    assert s["itl_mean"] == pytest.approx(0.9)
    assert s["itl_p99"] == pytest.approx(0.5 + 0.96 * 2.5)
    # eq. 2 with λ = μ = each reader's rate; c waited to the run's end (5 s) for nothing
    assert s["qos"] == pytest.approx(((4 - 2 * 1 - 2 * 2.5) + (3 - 4 * 2) + (0 - 1 * 5)) / 5)


def test_slo_attainment_and_goodput_by_hand():
    reqs = three_requests()
    s = summary(reqs, SLO(ttft=2.0, rebuffer=1.0), duration=5.0)
    assert s["slo_attainment"] == pytest.approx(1 / 3)  # b only: a stalled 2.5 s, c got nothing
    assert s["goodput"] == pytest.approx(1 / 5)
    s = summary(reqs, SLO(ttft=1.5), duration=5.0)
    assert s["slo_attainment"] == pytest.approx(1 / 3)  # a only: b's TTFT is 2 s
    s = summary(reqs, SLO(), duration=5.0)
    assert s["slo_attainment"] == pytest.approx(2 / 3) and s["goodput"] == pytest.approx(2 / 5)
    # an abandoned request meets the SLO but is no goodput; a timeout meets nothing
    reqs[1].outcome = "abandoned"
    reqs[0].outcome = "timeout"
    s = summary(reqs, SLO(), duration=5.0)
    assert s["slo_attainment"] == pytest.approx(1 / 3) and s["goodput"] == 0.0
    assert s["abandoned"] == 1 and s["aborted"] == 1


# -- (2) seeded workloads -----------------------------------------------------------------------
def test_same_seed_same_prompts_lengths_and_arrivals():
    w = LoadWorkload(num_prompts=30, request_rate=4.0, burstiness=0.5, lengths=parse_lengths("sharegpt"),
                     reading_rates=parse_reading_rates("15:0.4,20:0.6"), seed=7, abandon_fraction=0.2)
    fmt = BodyFormat(model="m")
    one, two = load_requests(w, fmt), load_requests(w, fmt)
    assert [x.request for x in one] == [x.request for x in two]
    assert [x.body for x in one] == [x.body for x in two]
    assert [x.abandon_after for x in one] == [x.abandon_after for x in two]
    arrivals = [x.request.arrival_time for x in one]
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals) and len(set(arrivals)) == 30
    body = msgspec.json.decode(one[3].body)
    assert len(body["prompt"]) == one[3].request.prompt_len and body["max_tokens"] == one[3].request.output_len
    assert body["ignore_eos"] is True and body["stream_options"]["include_usage"] is True
    assert body["reading_rate"] == one[3].request.reading_rate
    other = load_requests(LoadWorkload(num_prompts=30, request_rate=4.0, burstiness=0.5,
                                       lengths=parse_lengths("sharegpt"), seed=8), fmt)
    assert [x.request.arrival_time for x in other] != arrivals
    assert [x.request.output_len for x in other] != [x.request.output_len for x in one]
    assert [x.body for x in other] != [x.body for x in one]


def test_random_dataset_is_the_simulators_workload():
    w = LoadWorkload(num_prompts=25, request_rate=2.0, seed=3)
    assert build_requests(w) == build_workload(WorkloadSpec.parse("poisson:2", num_requests=25, seed=3))


def test_burst_pattern_and_abandon_points():
    w = LoadWorkload(num_prompts=7, burst_size=3, burst_period=2.5, lengths=parse_lengths("fixed:4:10"),
                     abandon_fraction=0.5, seed=1)
    assert [r.arrival_time for r in build_requests(w)] == [0, 0, 0, 2.5, 2.5, 2.5, 5.0]
    stops = abandon_points(w, [10] * 7)
    chosen = [s for s in stops if s is not None]
    assert len(chosen) == 4 and all(1 <= s <= 9 for s in chosen)  # round(0.5 · 7), never all 10 tokens
    with pytest.raises(ValueError, match="--burst-period"):
        LoadWorkload(num_prompts=7, burst_size=3)
    with pytest.raises(ValueError, match="drop one"):
        LoadWorkload(num_prompts=7, burst_size=3, burst_period=1.0, request_rate=2.0)


@pytest.mark.skipif(not DEFAULT_TRACE.is_file(), reason="the shared Mooncake trace is not here")
def test_mooncake_prompts_share_the_traces_prefix_blocks():
    w = LoadWorkload(dataset="mooncake", num_prompts=3, max_prompt_len=1024, time_scale=0.5)
    loads = load_requests(w, BodyFormat(model="m", vocab_size=1000))
    prompts = [msgspec.json.decode(x.body)["prompt"] for x in loads]
    assert [len(p) for p in prompts] == [1024, 1024, 1024]
    assert [x.request.hash_ids for x in loads] == [(0, 1), (0, 14), (0, 28)]  # the trace's first rows
    assert prompts[0][:BLOCK_TOKENS] == prompts[1][:BLOCK_TOKENS] == prompts[2][:BLOCK_TOKENS]
    assert prompts[0][BLOCK_TOKENS:] != prompts[1][BLOCK_TOKENS:]
    assert [x.request.output_len for x in loads] == [500, 490, 794]


# -- (3) BurstGPT CSV ---------------------------------------------------------------------------
BURSTGPT_CSV = """Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type
5,ChatGPT,300,120,420,Conversation log
1,GPT-4,1200,80,1280,Conversation log
3,ChatGPT,50,0,50,Conversation log
9,ChatGPT,0,7,7,API log
"""


def test_burstgpt_csv_replay(tmp_path):
    path = tmp_path / "burst.csv"
    path.write_text(BURSTGPT_CSV)
    assert read_burstgpt(path, None) == [(1.0, 1200, 80), (5.0, 300, 120), (9.0, 1, 7)]  # sorted, failed row out
    w = LoadWorkload(dataset="burstgpt", dataset_path=str(path), num_prompts=10, time_scale=0.5,
                     max_prompt_len=1000, reading_rates=parse_reading_rates("10:0.5,30:0.5"), seed=2)
    reqs = build_requests(w)
    assert [(r.arrival_time, r.prompt_len, r.output_len) for r in reqs] == [(0.0, 1000, 80), (2.0, 300, 120),
                                                                             (4.0, 1, 7)]
    assert [len(r.hash_ids) for r in reqs] == [2, 1, 1] and len({h for r in reqs for h in r.hash_ids}) == 4
    assert sorted(r.reading_rate for r in reqs) in ([10.0, 10.0, 30.0], [10.0, 30.0, 30.0])
    # a request rate replaces the timestamps
    assert [r.arrival_time for r in build_requests(LoadWorkload(dataset="burstgpt", dataset_path=str(path),
                                                                request_rate=math.inf))] == [0.0, 0.0, 0.0]
    bad = tmp_path / "bad.csv"
    bad.write_text("time,tokens\n1,2\n")
    with pytest.raises(ValueError, match="not a BurstGPT CSV"):
        read_burstgpt(bad, None)


# -- (4) the reader client against an in-test SSE server ----------------------------------------
class FakeServer:
    """An OpenAI-style SSE server in a thread. The body's `model` picks the behaviour:
    ok (one token per event), pairs (two tokens per event, usage says so), blank (every other
    token's event has empty text, as tokenflowd sends for a special token), stall (3 tokens, then
    silence), fail (HTTP 500). Tokens go out every `gap` s; bodies received are kept."""

    def __init__(self, gap: float = 0.005) -> None:
        self.gap = gap
        self.bodies: list[dict] = []
        self.sent: dict[int, int] = {}  # request number -> tokens written before it ended
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        self.thread = threading.Thread(target=self._serve, args=(started,), daemon=True)
        self.thread.start()
        assert started.wait(10)

    def _serve(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_post("/v1/completions", self.handle)
        app.router.add_post("/v1/chat/completions", self.handle)
        app.router.add_get("/v1/models", self.models)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.base_url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        started.set()
        self.loop.run_forever()

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "ok"}]})

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        n = len(self.bodies)
        self.bodies.append(body)
        self.sent[n] = 0
        mode, chat = body["model"], request.path.endswith("chat/completions")
        if mode == "fail":
            return web.json_response({"error": {"message": "no"}}, status=500)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        def event(text: str | None, finish: str | None = None, usage: int | None = None, role: bool = False) -> bytes:
            delta = {"content": text, **({"role": "assistant"} if role else {})}
            choice = {"index": 0, "delta": delta} if chat else {"index": 0, "text": text or ""}
            choice["finish_reason"] = finish
            doc = {"choices": [choice] if usage is None else [],
                   "usage": None if usage is None else {"completion_tokens": usage}}
            return b"data: " + json.dumps(doc).encode() + b"\n\n"

        per_event = 2 if mode == "pairs" else 1
        total = body["max_tokens"]
        try:
            if chat:
                await resp.write(event("", role=True))  # the role chunk: no token
            for k in range(0, total, per_event):
                while mode == "stall" and k == 3 and not request.transport.is_closing():
                    await asyncio.sleep(0.02)  # silence until the client gives up
                blank = mode == "blank" and k % 2 == 1
                await resp.write(event("" if blank else " tok" * min(per_event, total - k)))
                self.sent[n] += min(per_event, total - k)
                await asyncio.sleep(self.gap)
            await resp.write(event(None, "length"))
            await resp.write(event(None, usage=total))
            await resp.write(b"data: [DONE]\n\n")
        except (ConnectionError, AttributeError):  # the client left (transport closing, or gone: None)
            pass
        return resp

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def server():
    s = FakeServer()
    yield s
    s.close()


def load(i: int, model: str, output_len: int, abandon_after: int | None = None, arrival: float = 0.0) -> LoadRequest:
    req = WorkloadRequest(f"r{i}", arrival, 4, output_len, 20.0, (i,))
    body = {"model": model, "prompt": [1, 2, 3, 4], "max_tokens": output_len, "stream": True}
    return LoadRequest(req, msgspec.json.encode(body), abandon_after)


def test_client_outcomes_timeout_abandon_reconcile_and_error(server):
    loads = [load(0, "ok", 20), load(1, "ok", 20, abandon_after=5), load(2, "stall", 10),
             load(3, "pairs", 9), load(4, "fail", 5), load(5, "ok", 3, arrival=0.2), load(6, "blank", 8)]
    start = len(server.bodies)
    result = run_blocking(loads, ClientConfig(server.base_url + "/v1/completions", timeout=0.5))
    ok, abandoned, stalled, pairs, failed, late, blank = result.records
    # empty-text events are tokens (each has its own time), the finish event is none
    assert blank.outcome == "completed" and blank.num_events == 8 == len(set(blank.token_times))
    assert ok.outcome == "completed" and len(ok.token_times) == 20 == ok.num_events == ok.usage_tokens
    assert ok.finish_reason == "length" and ok.token_times == sorted(ok.token_times) and ok.ttft > 0
    assert abandoned.outcome == "abandoned" and len(abandoned.token_times) == 5
    assert stalled.outcome == "timeout" and len(stalled.token_times) == 3 and "0.5 s" in stalled.error
    # 9 tokens in 5 events: the missing 4 get the last event's time
    assert pairs.outcome == "completed" and pairs.num_events == 5 and pairs.usage_tokens == 9
    assert len(pairs.token_times) == 9 and pairs.token_times[-4:] == [pairs.token_times[4]] * 4
    assert failed.outcome == "error" and failed.error.startswith("HTTP 500") and failed.token_times == []
    assert late.arrival >= 0.2 and late.outcome == "completed"
    assert result.duration >= 0.5
    # the abandoning client closed its connection: the server stopped short of 20 tokens
    twenty = [server.sent[i] for i in range(start, len(server.bodies)) if server.bodies[i]["max_tokens"] == 20]
    assert len(twenty) == 2 and min(twenty) < 20 and max(twenty) == 20


def test_max_concurrency_serializes_streams(server):
    loads = [load(i, "ok", 4) for i in range(4)]
    result = run_blocking(loads, ClientConfig(server.base_url + "/v1/completions", max_concurrency=1))
    recs = result.records
    assert all(r.outcome == "completed" for r in recs)
    for prev, nxt in zip(recs, recs[1:]):
        assert nxt.arrival >= prev.token_times[-1]  # one stream open at a time


def test_chat_endpoint_counts_delta_content(server, tmp_path):
    out = tmp_path / "chat.json"
    start = len(server.bodies)
    rc = main(["--base-url", server.base_url, "--endpoint", "/v1/chat/completions", "--num-prompts", "3",
               "--lengths", "fixed:40:6", "--quiet", "--out", str(out), "--no-reading-rate-field"])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert [len(r["token_times"]) for r in doc["requests"]] == [6, 6, 6]  # the role chunk is no token
    bodies = server.bodies[start:]
    assert all("reading_rate" not in b and len(b["messages"][0]["content"].split()) == 40 for b in bodies)
    assert all(b["model"] == "ok" for b in bodies)  # from GET /v1/models


def test_compare_runs_the_same_workload_twice(server, tmp_path):
    out, plots = tmp_path / "cmp.json", tmp_path / "plots"
    start = len(server.bodies)
    rc = main(["compare", "--base-url", server.base_url, "--base-url-b", server.base_url, "--model", "ok",
               "--label-a", "fcfs", "--label-b", "tokenflow", "--num-prompts", "6", "--lengths", "fixed:8:5",
               "--reading-rate", "15:0.5,30:0.5", "--request-rate", "50", "--seed", "4", "--quiet",
               "--out", str(out), "--plot-dir", str(plots)])
    assert rc == 0
    doc = json.loads(out.read_text())
    a, b = doc["runs"]["fcfs"], doc["runs"]["tokenflow"]
    key = [(r["id"], r["scheduled"], r["prompt_len"], r["output_len"], r["reading_rate"]) for r in a["requests"]]
    assert key == [(r["id"], r["scheduled"], r["prompt_len"], r["output_len"], r["reading_rate"])
                   for r in b["requests"]]
    assert sorted(r["reading_rate"] for r in a["requests"]) == [15.0] * 3 + [30.0] * 3
    assert a["summary"]["output_tokens"] == b["summary"]["output_tokens"] == 30
    assert doc["ratios"]["output_tokens"] == 1.0 and doc["ratios"]["requests"] == 1.0
    bodies = [json.dumps(b, sort_keys=True) for b in server.bodies[start:]]
    assert len(bodies) == 12 and sorted(bodies[:6]) == sorted(bodies[6:])  # the same bodies, A then B
    for p in (plots / "ttft_cdf.png", plots / "fcfs" / "timelines.png", plots / "tokenflow" / "buffer.png"):
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- (5) the command line -----------------------------------------------------------------------
def test_cli_parses_rate_mix_and_inf():
    a = parse_args(["--reading-rate", "15:0.4,20:0.6", "--request-rate", "inf", "--num-prompts", "20"])
    assert a.command == "run"
    w = workload_from_args(a)
    assert w.reading_rates == ((15.0, 0.4), (20.0, 0.6)) and w.request_rate == math.inf
    reqs = build_requests(w)
    assert [r.arrival_time for r in reqs] == [0.0] * 20
    assert sorted(r.reading_rate for r in reqs) == [15.0] * 8 + [20.0] * 12
    a = parse_args(["--burst-size", "50"])
    assert workload_from_args(a).num_prompts == 50  # one burst of --burst-size
    a = parse_args(["compare", "--base-url-b", "http://127.0.0.1:1", "--max-concurrency", "4"])
    assert a.command == "compare" and a.max_concurrency == 4 and a.base_url == "http://127.0.0.1:8000"
    with pytest.raises(SystemExit):
        parse_args(["--request-rate", "0"])
    with pytest.raises(ValueError, match="add up to"):
        workload_from_args(parse_args(["--reading-rate", "15:0.4,20:0.4"]))


def test_cli_reports_an_unreachable_server(capsys):
    assert main(["--base-url", "http://127.0.0.1:9", "--num-prompts", "1", "--quiet"]) == 2
    assert "is the server up?" in capsys.readouterr().err
