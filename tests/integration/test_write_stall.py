"""A client that stops reading mid-stream, on the real engine: after --write-stall-timeout its
request is aborted, its KV pages go back to idle and its connection is reset."""
from __future__ import annotations

import json
import socket
import time

from daemon import Daemon


def test_a_reader_that_stops_reading_is_aborted_and_its_pages_freed():
    d = Daemon("--kv-cache-memory", "256MiB", "--write-stall-timeout", "3")
    socks = []
    try:
        idle = d.metric("tokenflowd_kv_pages_used")
        for i in range(2):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)  # a small window: writes block soon
            s.connect(("127.0.0.1", d.port))
            payload = json.dumps({"model": "smollm2-135m", "prompt": f"Story {i}:", "max_tokens": 2000,
                                  "ignore_eos": True, "stream": True, "stream_options": {"coalesce": False}}).encode()
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
            s.recv(100)  # the head: then read nothing more
            socks.append(s)
        deadline = time.monotonic() + 300  # 2,000 tokens take minutes: the stall ends them first
        while d.metric("tokenflowd_kv_pages_used") == idle and time.monotonic() < deadline:
            time.sleep(0.1)
        assert d.metric("tokenflowd_kv_pages_used") > idle  # they run
        while time.monotonic() < deadline:
            try:
                if d.metric("tokenflowd_requests_total", outcome="write_stall") == 2:
                    break
            except KeyError:
                pass
            time.sleep(0.2)
        assert d.metric("tokenflowd_requests_total", outcome="write_stall") == 2
        stalled_at = time.monotonic()  # (no speed bound: 2,000 tokens take minutes, the stall ended them)
        while d.metric("tokenflowd_kv_pages_used") != idle and time.monotonic() - stalled_at < 10.0:
            time.sleep(0.05)
        assert d.metric("tokenflowd_kv_pages_used") == idle
        assert d.http.get("/v1/requests").json()["data"] == []
        for s in socks:
            s.settimeout(10)
            try:
                while s.recv(1 << 16):
                    pass
                reset = False
            except ConnectionResetError:
                reset = True
            assert reset
    finally:
        for s in socks:
            s.close()
        d.stop()
