"""What a TCP link delivers, as the kernel counts it: the bytes the peer acknowledged on the sockets
to its host, over time in which the link, not the writer, set the pace.

Why not time the writes. Over TCP, a transfer engine's write ends once the sender's kernel holds its
bytes: in the socket's buffer, and in flight up to the bottleneck's queue. A prefill node writes each
layer's KV as it is computed, so each write meets empty queues, ends in a few milliseconds, and the
link drains it in the gap before the next: measured over a 100 Mb/s `tc tbf` link, 786 KB writes
every 67 ms ended in 5-15 ms each (the wire needs 63 ms), and the writes' busy time put the link at
225 Mb/s while it was sending flat out.

Why not the kernel's per-ACK delivery rate (`tcpi_delivery_rate`): a token bucket, or any buffer
before the bottleneck, lets the first part of a write through at line rate, and those samples are
not marked app-limited: over a 1 Gb/s tbf link their median read 7 Gb/s.

So `DeliveryMeter.sample` reads, for each socket to a host, the bytes acknowledged so far
(`tcpi_bytes_acked`) and the bytes it still owes (written and not acknowledged: the list's
`idiag_wqueue`). Between two samples, the bytes delivered are the growth of the first; a socket gone
from the states that still hold data delivered all it owed (one that comes back within GONE_SECONDS,
because a list missed it, counts on from what it was credited); one that came and went between two
samples is not seen (a short transfer on a fast link). The interval is *busy* when a socket
delivered some and still owes, of what it owed at the start, more than a delayed ACK holds back (two
segments), neither backing off nor recovering a loss by timeout, and the interval spans at least two
of the path's round trips (`tcpi_min_rtt`: a queue filling on a busy link lengthens the others; the
transport samples no more often than that): the link was never idle for want of data, and delivered
/ seconds is what it carries.

A link that its writes do not fill (a fast one, draining each write between two samples) makes no
busy interval, and the transport keeps the writes' own figure there (transport.py `_figure`).

Read through NETLINK_SOCK_DIAG, as `ss -ti` reads it, in the process's own network namespace, the
kernel filtering the sockets to the peers' addresses: a node's thousands of client connections are
never copied out. A few fields of `struct tcp_info` at their fixed offsets (a stable kernel ABI;
`tcpi_bytes_acked` since Linux 4.1, `tcpi_min_rtt` since 4.6). Off Linux, or where the kernel refuses, `DeliveryMeter.open()`
is None.

    meter = DeliveryMeter.open()
    meter.sample(["10.0.0.2"])  # {"10.0.0.2": Delivery(nbytes, seconds, busy, sending)} since the last
"""
from __future__ import annotations

import errno
import socket
import struct
import sys
import time
from dataclasses import dataclass, replace
from typing import Iterable

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
NLMSG_ERROR, NLMSG_DONE = 2, 3
INET_DIAG_REQ_BYTECODE = 1
INET_DIAG_INFO = 2  # the reply's tcp_info attribute, asked for by bit 1 << (INET_DIAG_INFO - 1)
INET_DIAG_BC_JMP, INET_DIAG_BC_D_COND = 1, 8
# the states in which a socket may still have bytes to deliver: ESTABLISHED, FIN_WAIT1, CLOSE_WAIT,
# LAST_ACK, CLOSING (a transfer engine closes its connection once the kernel holds its last bytes);
# one that leaves them has delivered all it had on its way
SENDING_STATES = (1 << 1) | (1 << 4) | (1 << 8) | (1 << 9) | (1 << 11)

_NLMSG = struct.Struct("=IHHII")
_DIAG_MSG = 72  # struct inet_diag_msg: family, state, timer, retrans, the 48-byte sockid, five u32
_RTA = struct.Struct("=HH")
# struct tcp_info offsets
_CA_STATE, _BACKOFF, _SND_MSS, _BYTES_ACKED, _MIN_RTT = 1, 4, 16, 120, 148
TCP_CA_LOSS = 4  # tcpi_ca_state: recovering by retransmission timeout
_WQUEUE = 60  # inet_diag_msg's idiag_wqueue: for TCP, write_seq - snd_una, the bytes not yet acknowledged
NLM_F_DUMP_INTR = 0x10  # the sockets changed while the kernel listed them: the list may miss some
GONE_SECONDS = 1.0  # how long a socket missing from a list is remembered, should it come back


@dataclass(frozen=True)
class Delivery:
    """What the sockets to one host did since the previous sample of it (seconds 0: the first)."""

    nbytes: int  # the bytes the host acknowledged
    seconds: float
    busy: bool  # a socket still owed more than a delayed ACK holds back of what it owed at the start
    sending: bool  # bytes are on their way now


@dataclass(frozen=True)
class _Socket:
    host: str
    acked: int  # bytes acknowledged so far
    owed: int  # bytes sent and not acknowledged, or not sent yet
    mss: int  # bytes a segment carries
    rtt: float  # s, the least seen: the path's own, without the queues that a busy link fills
    stalled: bool = False  # recovering a loss by timeout, or backing off: no pace of the link's


class DeliveryMeter:
    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._seq = 0
        self._sockets: dict[bytes, _Socket] = {}  # by the kernel's socket cookie
        self._gone: dict[bytes, tuple[float, _Socket]] = {}  # missing from the last list: credited all it owed
        self._at: dict[str, float] = {}  # host -> when last sampled
        self.rtt = 0.0  # s: the longest path round trip the last sample saw (sample at least twice that apart)

    @classmethod
    def open(cls) -> "DeliveryMeter | None":
        if not sys.platform.startswith("linux"):
            return None
        try:
            sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG)
        except OSError:
            return None
        sock.settimeout(1.0)  # a kernel that does not answer never holds the caller
        return cls(sock)

    def close(self) -> None:
        self._sock.close()

    def sample(self, hosts: Iterable[str]) -> dict[str, Delivery]:
        """host (an IP address) -> what its sockets delivered since the previous call, if that call
        asked for it too (else seconds 0: its first sample); OSError if the kernel refuses the query
        (TimeoutError if it does not answer). By address, not port: a transfer engine's data
        connections go to a port of its own, not to the endpoint peers name it by."""
        hosts = set(hosts)
        current = self._list(hosts)
        now = time.monotonic()
        delivered = dict.fromkeys(hosts, 0)
        busy = dict.fromkeys(hosts, False)
        sending = dict.fromkeys(hosts, False)
        for cookie, sock in current.items():
            before = self._sockets.get(cookie)
            if before is None and cookie in self._gone:  # back in the list: what it was credited stands
                before = self._gone.pop(cookie)[1]
            if before is None:  # new since the last sample: what it delivered so far
                delivered[sock.host] += sock.acked
            else:
                got = max(0, sock.acked - before.acked)
                top = max(sock.acked, before.acked)  # counted up to there (a list missed it, it was credited)
                current[cookie] = replace(sock, acked=top, owed=max(0, sock.acked + sock.owed - top))
                delivered[sock.host] += got
                seconds = now - self._at.get(sock.host, now)
                # it delivered, and of what it owed at the start more than two segments (a delayed
                # ACK) are still owed at the end, over at least two of the path's round trips (in
                # one, even an idle link still owes them; queued behind a busy one, they take longer)
                if (got > 0 and not sock.stalled and before.owed - got > 2 * sock.mss
                        and seconds >= 2 * sock.rtt):
                    busy[sock.host] = True
            sending[sock.host] = sending[sock.host] or sock.owed > 0
        for cookie, sock in self._sockets.items():
            if cookie not in current and sock.host in hosts:  # gone from the sending states: all delivered
                delivered[sock.host] += sock.owed
                self._gone[cookie] = (now, _Socket(sock.host, sock.acked + sock.owed, 0, sock.mss, sock.rtt))
        self._gone = {c: g for c, g in self._gone.items() if now - g[0] < GONE_SECONDS}
        out = {host: Delivery(delivered[host], now - self._at[host] if host in self._at else 0.0,
                              busy[host], sending[host]) for host in hosts}
        self._sockets, self._at = current, dict.fromkeys(hosts, now)  # a host not asked for is forgotten
        self.rtt = max((s.rtt for s in current.values()), default=0.0)
        return out

    def _list(self, hosts: set[str]) -> dict[bytes, _Socket]:
        """The sockets to `hosts` in a sending state, by cookie."""
        out: dict[bytes, _Socket] = {}
        for family in (socket.AF_INET, socket.AF_INET6):
            wanted = {socket.inet_pton(family, host): host for host in hosts if _family(host) == family}
            if not wanted:
                continue
            for dst, cookie, owed, info in self._dump(family, list(wanted)):
                if dst not in wanted or len(info) < _MIN_RTT + 4:
                    continue
                mss, rtt = struct.unpack_from("=I", info, _SND_MSS)[0], struct.unpack_from("=I", info, _MIN_RTT)[0]
                acked, = struct.unpack_from("=Q", info, _BYTES_ACKED)
                stalled = info[_CA_STATE] == TCP_CA_LOSS or info[_BACKOFF] > 0
                out[cookie] = _Socket(wanted[dst], acked, owed, mss, rtt / 1e6, stalled)
        return out

    def _dump(self, family: int, addresses: list[bytes]):
        """The destination address, cookie, bytes not yet acknowledged and tcp_info of each socket of
        `family` to one of `addresses`."""
        self._seq += 1
        bytecode = _bytecode(family, addresses)
        attr = _RTA.pack(_RTA.size + len(bytecode), INET_DIAG_REQ_BYTECODE) + bytecode
        req = struct.pack("=BBBxI", family, socket.IPPROTO_TCP, 1 << (INET_DIAG_INFO - 1), SENDING_STATES)
        req += bytes(48) + attr  # the sockid: a dump is filtered by the bytecode, not by it
        self._sock.send(_NLMSG.pack(_NLMSG.size + len(req), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP,
                                    self._seq, 0) + req)
        addr_len = 4 if family == socket.AF_INET else 16
        while True:
            data = self._sock.recv(1 << 16)
            at = 0
            while at + _NLMSG.size <= len(data):
                length, kind, flags, seq, _ = _NLMSG.unpack_from(data, at)
                if length < _NLMSG.size:
                    raise OSError(errno.EPROTO, "sock_diag sent a malformed message")
                body = data[at + _NLMSG.size: at + length]
                at += (length + 3) & ~3
                if seq != self._seq:
                    continue
                if flags & NLM_F_DUMP_INTR:
                    raise OSError(errno.EAGAIN, "the sockets changed while the kernel listed them")
                if kind in (NLMSG_DONE, NLMSG_ERROR):
                    error = struct.unpack_from("=i", body)[0] if len(body) >= 4 else 0
                    if error:
                        raise OSError(-error, "sock_diag refused the query")
                    if kind == NLMSG_DONE:
                        return
                    continue
                info = _attr(body, _DIAG_MSG, INET_DIAG_INFO)
                if info is not None:  # the sockid's destination address and cookie
                    yield body[24: 24 + addr_len], body[44:52], struct.unpack_from("=I", body, _WQUEUE)[0], info


def _family(host: str) -> int:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _attr(body: bytes, at: int, wanted: int) -> bytes | None:
    while at + _RTA.size <= len(body):
        length, kind = _RTA.unpack_from(body, at)
        if length < _RTA.size:
            return None
        if kind == wanted:
            return body[at + _RTA.size: at + length]
        at += (length + 3) & ~3
    return None


def _bytecode(family: int, addresses: list[bytes]) -> bytes:
    """The kernel's socket filter for "destination is one of addresses" (any port): each condition's
    yes goes on to a jump to the end (accept), its no skips that jump to the next condition, and the last
    condition's no jumps past the end (reject); the layout `ss` compiles an "or" to."""
    ops = [struct.pack("=BBxxi", family, 8 * len(addr), -1) + addr for addr in addresses]
    out = b""
    for i, cond in enumerate(ops):
        size = 4 + len(cond)
        out += struct.pack("=BBH", INET_DIAG_BC_D_COND, size, size + 4) + cond
        rest = sum(4 + len(c) + 4 for c in ops[i + 1:]) - 4  # the conditions after this one, their jumps between
        if i < len(ops) - 1:
            out += struct.pack("=BBH", INET_DIAG_BC_JMP, 4, 4 + rest)
    return out
