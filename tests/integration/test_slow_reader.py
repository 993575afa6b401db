"""A slow reader through an ordinary socket, on the real engine: what the README promises of it.

The client states a fast rate, above the clamp, and then reads 200 bytes every 0.5 s with the
kernel's default receive buffer (autotuned). Its buffer absorbs the stream, the server's writes
never block, and tokenflowd does not read the kernel's view of the peer's window: the rate stays
the stated one, clamped, with its source "stated", all the while the client falls behind. What the
claim buys is bounded by the clamp (README "What the server cannot see").
"""
from __future__ import annotations

import json
import socket
import time

import httpx
from daemon import Daemon

CLAMP = 40.0  # --max-reading-rate
STATED = 1000.0  # what the client claims


def test_a_stated_rate_stands_for_a_slow_reader_with_an_ordinary_buffer_and_stays_clamped():
    d = Daemon("--dtype", "float32", "--quantization", "none", "--kv-cache-memory", "128MiB",
               "--max-reading-rate", str(CLAMP))
    s = socket.create_connection(("127.0.0.1", d.port), timeout=60)  # a read never waits without end
    try:
        payload = json.dumps({"model": "smollm2-135m", "prompt": "A long story:", "max_tokens": 400, "ignore_eos": True,
                              "stream": True, "reading_rate": STATED}).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
        head = b""
        while b"\r\n\r\n" not in head:
            head += s.recv(200)
        rid = next(line.split(b":", 1)[1].strip().decode() for line in head.split(b"\r\n")
                   if line.lower().startswith(b"x-request-id:"))
        seen = []
        read = 0  # bytes of events read past the head
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            time.sleep(0.5)
            read += len(s.recv(200))  # a reader far slower than the stream
            r = httpx.get(f"{d.base_url}/v1/requests/{rid}", timeout=10)
            if r.status_code == 404:  # the engine is done: the rest sits in the client's buffer
                break
            info = r.json()
            seen.append((info["reading_rate"], info["reading_rate_source"], info["delivered_tokens"]))
        assert seen, "the request was seen live"
        # what the README says: the stated rate stands, clamped, whatever the client really reads
        assert all(rate == CLAMP and source == "stated" for rate, source, _ in seen), seen
        delivered = seen[-1][2]
        # it fell behind: it read less than the events of the tokens delivered (each over 150 bytes)
        assert delivered > 50 and read < 150 * delivered, (delivered, read)
    finally:
        s.close()
        d.stop()
