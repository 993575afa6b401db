"""What TCP delivered as the link's measure (federation/delivery.py), over a real `tc tbf` link
between network namespaces: a writer that hands the kernel a chunk, then waits, as a prefill node
writes each layer's KV, sees each write end at once, while the bytes acknowledged in the intervals
the link set the pace read the link's rate. The meter counts only the sockets to the addresses
asked for."""
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
stop, asked, all3 = threading.Event(), [], []
def sample():
    while not stop.is_set():
        asked.append(meter.sample([recv, "10.255.255.1"]))  # not the other host
        all3.append(meter.sample([other, "10.255.255.1", recv]))
        time.sleep(0.02)
threading.Thread(target=sample, daemon=True).start()
a, b = socket.create_connection((recv, 9100)), socket.create_connection((other, 9100))
chunk, took, sent, t0 = bytes(200_000), 0.0, 0, time.monotonic()
while time.monotonic() - t0 < 3.0:  # 200 KB every 80 ms: the link's pace, in bursts
    w = time.monotonic()
    a.sendall(chunk)
    took, sent = took + time.monotonic() - w, sent + len(chunk)
    b.sendall(bytes(1000))
    time.sleep(0.08)
time.sleep(0.5)
stop.set()
busy = [s[recv] for s in asked if recv in s and s[recv].busy]
print(json.dumps({"rate": sum(d.nbytes for d in busy) / sum(d.seconds for d in busy), "busy": len(busy),
                  "writes": sent / took, "asked": sorted({h for s in asked for h in s}),
                  "all": sorted({h for s in all3 for h in s}),
                  "other_busy": sum(s[other].busy for s in all3 if other in s)}))
"""


def test_what_the_kernel_delivered_reads_the_link_where_the_writes_own_time_does_not(tmp_path):
    net = Network(["send", "recv", "other"])
    try:
        net.rate("send", "20mbit")
        (tmp_path / "sink.py").write_text(SINK)
        (tmp_path / "writer.py").write_text(WRITER)
        sinks = [subprocess.Popen(["ip", "netns", "exec", net.ns[n], sys.executable, str(tmp_path / "sink.py"), net.addr[n]],
                                  stdout=subprocess.PIPE, text=True) for n in ("recv", "other")]
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
        assert 0.8 * RATE < got["rate"] < 1.1 * RATE, got
        assert got["writes"] > 1.5 * RATE, got  # the writes' own time: the kernel took each at once
        # no socket to an address not asked for is read; the 1 KB writes to the other host are the
        # writer's pace, never the link's
        assert net.addr["other"] not in got["asked"] and net.addr["other"] in got["all"], got
        assert got["other_busy"] == 0, got
    finally:
        net.close()
