"""What the kernel tells a sender about a peer that reads slowly, and how early.

    python bench/slow_reader_signal.py [--seconds 20] [--rcvbuf default,131072,16384,2048] [--out FILE]

A server writes SSE-sized events (200 bytes, 40 a second: a stream of 40 tokens/s) over loopback
to a client that reads 200 bytes every 0.5 s (a reader at 2 events/s). Each 0.25 s the server
reads its socket's TCP_INFO: the peer's advertised window (tcpi_snd_wnd, Linux 5.19+), the time
the connection was limited by that window (tcpi_rwnd_limited), and the bytes sent but not yet
acknowledged (tcpi_unacked segments) or not yet sent (tcpi_notsent_bytes, above 16 KiB: below,
it is Nagle holding one small segment); and whether a write would block. For each client receive buffer (`default`: the kernel's autotuned one) it reports,
for each signal, when it first showed and how many bytes the client had left unread by then.
"""
from __future__ import annotations

import argparse
import json
import platform
import select
import socket
import struct
import threading
import time

EVENT = b"data: " + b"x" * 186 + b"\n\n"  # 194 bytes: one token's SSE event, about
EVENTS_PER_S = 40
READ_BYTES, READ_EVERY = 200, 0.5
NOTSENT = 16 << 10  # bytes written but not sent that count as a signal


def tcp_info(sock: socket.socket) -> dict:
    raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    unacked, = struct.unpack_from("I", raw, 24)
    rwnd_limited, = struct.unpack_from("Q", raw, 176)
    notsent, = struct.unpack_from("I", raw, 144)
    snd_wnd = struct.unpack_from("I", raw, 228)[0] if len(raw) >= 232 else None
    return {"unacked_segments": unacked, "rwnd_limited_us": rwnd_limited, "notsent_bytes": notsent,
            "snd_wnd": snd_wnd}


def run(rcvbuf: int | None, seconds: float) -> dict:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    client = socket.socket()
    if rcvbuf:
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    client.connect(("127.0.0.1", port))
    server, _ = listener.accept()
    server.setblocking(False)
    read = [0]
    stop = threading.Event()

    def reader() -> None:
        while not stop.wait(READ_EVERY):
            try:
                read[0] += len(client.recv(READ_BYTES))
            except OSError:
                return

    threading.Thread(target=reader, daemon=True).start()
    sent, samples, t0 = 0, [], time.monotonic()
    first: dict[str, dict] = {}
    max_wnd = 0
    next_event, next_sample = t0, t0
    while (now := time.monotonic()) - t0 < seconds:
        if now >= next_event:
            _, writable, _ = select.select([], [server], [], 0)
            if writable:
                try:
                    sent += server.send(EVENT)
                except BlockingIOError:
                    pass
            elif "write_blocks" not in first:
                first["write_blocks"] = {"s": now - t0, "unread_bytes": sent - read[0]}
            next_event += 1 / EVENTS_PER_S
        if now >= next_sample:
            info = tcp_info(server)
            unread = sent - read[0]
            samples.append({"s": round(now - t0, 2), "sent": sent, "unread": unread, **info})
            if info["snd_wnd"] is not None:
                max_wnd = max(max_wnd, info["snd_wnd"])
                if info["snd_wnd"] < max_wnd / 2 and "window_halved" not in first:
                    first["window_halved"] = {"s": now - t0, "unread_bytes": unread, "snd_wnd": info["snd_wnd"]}
            if info["rwnd_limited_us"] and "rwnd_limited" not in first:
                first["rwnd_limited"] = {"s": now - t0, "unread_bytes": unread}
            if info["notsent_bytes"] > NOTSENT and "notsent" not in first:  # below: Nagle's one small segment
                first["notsent"] = {"s": now - t0, "unread_bytes": unread}
            next_sample += 0.25
        time.sleep(max(0.0, min(next_event, next_sample) - time.monotonic()))
    stop.set()
    for s in (server, client, listener):
        s.close()
    return {"client_rcvbuf": rcvbuf or "default (autotuned)", "seconds": seconds, "sent": sent, "read": read[0],
            "max_snd_wnd": max_wnd, "first": first, "samples": samples[:: max(1, len(samples) // 40)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--rcvbuf", default="default,131072,16384,2048")
    ap.add_argument("--out")
    a = ap.parse_args()
    sizes = [None if x == "default" else int(x) for x in a.rcvbuf.split(",")]
    runs = [run(size, a.seconds) for size in sizes]
    print(f"kernel {platform.release()}; a stream of {EVENTS_PER_S} events/s of {len(EVENT)} bytes, a reader "
          f"of {READ_BYTES} bytes every {READ_EVERY} s; {a.seconds:.0f} s")
    print(f"{'client rcvbuf':<22} {'peer window max':>15}  first signals (s after start, bytes unread then)")
    for r in runs:
        cells = "; ".join(f"{k} {v['s']:.2f} s, {v['unread_bytes']} B" for k, v in r["first"].items()) or "none"
        print(f"{str(r['client_rcvbuf']):<22} {r['max_snd_wnd']:>15}  {cells}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"kernel": platform.release(), "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
