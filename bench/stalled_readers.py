"""What readers that stop reading cost the HTTP front: its CPU and the context switches of its
loop while N streams wait on clients that read nothing, once the engine is done with them.

    python bench/stalled_readers.py [--readers 1000] [--tree DIR]

`--tree` runs the front of another checkout (a paired A/B: the same script against an older
commit's bench/front_capacity.py front and null engine). Each client opens a stream (150 tokens
at 20 tokens/s), reads the response head through a 1 KiB receive window and then nothing. When
the engine's request listing is empty, the front's CPU time (utime + stime) and its main
thread's context switches are read over --window seconds. A front that polls each blocked
stream spends a share of a core on it; one woken by the transport's resume_writing spends none.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent


def cpu(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def switches(pid: int) -> int:
    return sum(int(line.split()[1]) for line in open(f"/proc/{pid}/status") if "ctxt_switches" in line)


async def stall(port: int, n: int, window: float, front_pid: int) -> dict:
    def get(path: str) -> dict:
        return json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30).read())

    body = json.dumps({"model": "smollm2-135m", "prompt": "hi", "max_tokens": 150, "stream": True}).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    loop = asyncio.get_running_loop()
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        s.setblocking(False)
        await loop.sock_connect(s, ("127.0.0.1", port))
        await loop.sock_sendall(s, request)
        socks.append(s)
    for s in socks:
        await loop.sock_recv(s, 100)  # the head: then nothing more
    while get("/v1/requests")["data"]:
        await asyncio.sleep(0.5)
    await asyncio.sleep(1.0)
    c0, s0, t0 = cpu(front_pid), switches(front_pid), time.monotonic()
    await asyncio.sleep(window)
    c1, s1, t1 = cpu(front_pid), switches(front_pid), time.monotonic()
    for s in socks:
        s.close()
    return {"readers": n, "window_s": round(t1 - t0, 2), "front_cpu_s_per_s": round((c1 - c0) / (t1 - t0), 4),
            "context_switches_per_s": round((s1 - s0) / (t1 - t0), 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--readers", type=int, default=1000)
    ap.add_argument("--window", type=float, default=5.0)
    ap.add_argument("--tree", default=str(HERE.parent), help="the checkout whose front runs (default: this one)")
    a = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp = Path(f"/tmp/stalled-readers-{os.getpid()}")
    front = subprocess.Popen([sys.executable, f"{a.tree}/bench/front_capacity.py", "--role", "front", "--port",
                              str(port), "--rate", "20", "--engine-log", f"{tmp}.engine", "--probe-log", f"{tmp}.probe"],
                             env={**os.environ, "PYTHONPATH": a.tree}, cwd=a.tree,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                if json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).read())["status"] == "ok":
                    break
            except OSError:
                pass
            time.sleep(0.2)
        result = asyncio.run(stall(port, a.readers, a.window, front.pid))
    finally:
        front.terminate()
        front.wait(60)
    print(json.dumps({"tree": a.tree, **result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
