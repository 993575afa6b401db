"""What TCP delivered as the link's measure (federation/delivery.py), over a real `tc tbf` link
between network namespaces: a writer that hands the kernel a chunk, then waits, as a prefill node
writes each layer's KV, a little faster than the link carries, sees each write end at once, while
the bytes acknowledged in the intervals the link set the pace read the link's rate. The meter counts
only the sockets to the addresses asked for."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from netns import Network, available  # noqa: E402

_why = available()
pytestmark = pytest.mark.skipif(_why is not None, reason=_why or "")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RATE = 2.5e6  # bytes/s: the tbf link's 20 Mbit/s
SINK = """
import socket, sys, threading
srv = socket.create_server((sys.argv[1], 9100))
print("ready", flush=True)
def drain(c):
    while c.recv(1 << 16):
        pass
while True:
    threading.Thread(target=drain, args=(srv.accept()[0],), daemon=True).start()
"""
WRITER = """
import json, socket, sys, threading, time
from tokenflowd.federation.delivery import DeliveryMeter
recv, other = sys.argv[1], sys.argv[2]
meter = DeliveryMeter.open()
stop, samples, listed = threading.Event(), [], set()
def sample():
    while not stop.is_set():
        samples.append(meter.sample([other, "10.255.255.1", recv]))
        listed.update(socket.inet_ntop(socket.AF_INET, dst) for dst, _, _, _ in
                      meter._dump(socket.AF_INET, [socket.inet_pton(socket.AF_INET, recv)]))
        time.sleep(0.02)
threading.Thread(target=sample, daemon=True).start()
time.sleep(0.1)
a, b = socket.create_connection((recv, 9100)), socket.create_connection((other, 9100))
chunk, took, sent, small, t0 = bytes(400_000), 0.0, 0, 0, time.monotonic()
i = 0
while time.monotonic() - t0 < 3.0:  # 400 KB every 120 ms: a third more than the link carries, in bursts
    w = time.monotonic()
    a.sendall(chunk)
    took, sent = took + time.monotonic() - w, sent + len(chunk)
    if i % 4 == 0:
        small += b.send(bytes(1000))
    i += 1
    time.sleep(0.12)
a.close(), b.close()
time.sleep(0.1)
while (not samples or samples[-1][recv].sending) and time.monotonic() - t0 < 20:  # until the backlog is delivered
    time.sleep(0.05)
stop.set()
time.sleep(0.1)
busy = [s[recv] for s in samples if s[recv].busy]
print(json.dumps({"rate": sum(d.nbytes for d in busy) / sum(d.seconds for d in busy), "busy": len(busy),
                  "writes": sent / took, "listed": sorted(listed), "sent": sent, "small": small,
                  "recv_bytes": sum(s[recv].nbytes for s in samples),
                  "other_bytes": sum(s[other].nbytes for s in samples),
                  "other_busy": sum(s[other].busy for s in samples)}))
"""


def test_what_the_kernel_delivered_reads_the_link_where_the_writes_own_time_does_not(tmp_path):
    net = Network(["send", "recv", "other"])
    try:
        net.rate("send", "20mbit")
        (tmp_path / "sink.py").write_text(SINK)
        (tmp_path / "writer.py").write_text(WRITER)
        sinks = [subprocess.Popen(["ip", "netns", "exec", net.ns[n], sys.executable, str(tmp_path / "sink.py"),
                                   net.addr[n]], stdout=subprocess.PIPE, text=True) for n in ("recv", "other")]
        try:
            for s in sinks:
                assert s.stdout.readline().strip() == "ready"
            out = subprocess.run(["ip", "netns", "exec", net.ns["send"], sys.executable, str(tmp_path / "writer.py"),
                                  net.addr["recv"], net.addr["other"]], capture_output=True, text=True, timeout=60,
                                 env={**os.environ, "PYTHONPATH": ROOT})
        finally:
            for s in sinks:
                s.kill()
                s.wait()
        assert out.returncode == 0, out.stderr
        got = json.loads(out.stdout)
        assert got["busy"] >= 10
        assert 0.75 * RATE < got["rate"] < 1.1 * RATE, got
        assert got["writes"] > 1.5 * RATE, got  # the writes' own time: the kernel took each at once
        # every byte counted once, to its host; the 1 KB writes to the other host are the writer's
        # pace, never the link's; the kernel lists only the sockets to the addresses asked for
        # (give or take the SYN and the FIN, which the kernel counts as a byte each)
        assert 0 <= got["recv_bytes"] - got["sent"] <= 2 and 0 <= got["other_bytes"] - got["small"] <= 2, got
        assert got["other_busy"] == 0 and got["listed"] == [net.addr["recv"]], got
    finally:
        net.close()
