"""The delivery meter's accounting (federation/delivery.py) on socket lists made up here: bytes
delivered between samples, sockets that come, go, or are missed by one list, and when an interval
is busy. The real kernel is read in tests/integration/test_tcp_delivery.py."""
from __future__ import annotations

import socket
import struct

import pytest

from tokenflowd.federation import delivery
from tokenflowd.federation.delivery import DeliveryMeter, _bytecode

HOST, OTHER = "10.0.0.2", "10.0.0.3"
MSS = 1448


def info(acked: int, sent: int, notsent: int = 0, rtt_us: int = 200, loss: bool = False) -> tuple[int, bytes]:
    """The bytes not yet acknowledged, and a tcp_info with the fields the meter reads."""
    b = bytearray(232)
    b[1] = delivery.TCP_CA_LOSS if loss else 0
    struct.pack_into("=I", b, 16, MSS)
    struct.pack_into("=I", b, 148, rtt_us)
    struct.pack_into("=Q", b, 120, acked)
    return sent + notsent - acked, bytes(b)


class FakeMeter(DeliveryMeter):
    def __init__(self) -> None:
        super().__init__(sock=None)
        self.listed: dict[bytes, tuple[str, tuple[int, bytes]]] = {}  # cookie -> (host, (owed, tcp_info))

    def _dump(self, family, addresses):
        for cookie, (host, (owed, tcp)) in self.listed.items():
            addr = socket.inet_pton(socket.AF_INET, host)
            if addr in addresses:
                yield addr, cookie, owed, tcp


@pytest.fixture
def clock(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(delivery.time, "monotonic", lambda: now[0])
    return now


def test_bytes_delivered_between_samples_and_a_busy_interval(clock):
    m = FakeMeter()
    m.listed[b"a"] = (HOST, info(acked=0, sent=300_000, notsent=500_000))  # a write of 800 KB begins
    first = m.sample([HOST])[HOST]
    assert first.seconds == 0 and first.sending and not first.busy
    clock[0] += 0.02
    m.listed[b"a"] = (HOST, info(acked=250_000, sent=550_000, notsent=250_000))
    d = m.sample([HOST])[HOST]
    assert (d.nbytes, d.seconds, d.busy, d.sending) == (250_000, pytest.approx(0.02), True, True)
    clock[0] += 0.02  # it delivered the rest and left the sending states: all it owed was delivered
    del m.listed[b"a"]
    d = m.sample([HOST])[HOST]
    assert (d.nbytes, d.busy, d.sending) == (550_000, False, False)


def test_a_delayed_acks_last_segments_or_an_idle_link_are_not_busy(clock):
    m = FakeMeter()
    m.listed[b"a"] = (HOST, info(acked=0, sent=100_000))
    m.sample([HOST])
    clock[0] += 0.02
    m.listed[b"a"] = (HOST, info(acked=100_000 - 2 * MSS, sent=100_000))  # two segments await their ACK
    assert not m.sample([HOST])[HOST].busy
    m.listed[b"b"] = (HOST, info(acked=0, sent=100_000, rtt_us=30_000))  # a 30 ms path
    m.sample([HOST])
    clock[0] += 0.02
    m.listed[b"b"] = (HOST, info(acked=50_000, sent=100_000, rtt_us=30_000))  # owed, but within two round trips
    assert not m.sample([HOST])[HOST].busy and m.rtt == pytest.approx(0.03)


def test_a_socket_that_delivers_nothing_or_recovers_a_loss_by_timeout_is_not_a_busy_link(clock):
    m = FakeMeter()
    m.listed[b"a"] = (HOST, info(acked=0, sent=100_000))
    m.sample([HOST])
    clock[0] += 0.02  # a dead peer, or one whose window is shut: nothing delivered
    assert not m.sample([HOST])[HOST].busy
    clock[0] += 0.02
    m.listed[b"a"] = (HOST, info(acked=10_000, sent=100_000, loss=True))
    d = m.sample([HOST])[HOST]
    assert d.nbytes == 10_000 and not d.busy


def test_a_new_socket_counts_what_it_delivered_and_another_hosts_sockets_do_not(clock):
    m = FakeMeter()
    m.sample([HOST, OTHER])
    clock[0] += 0.02
    m.listed[b"a"] = (HOST, info(acked=40_000, sent=60_000))  # opened since the last sample
    m.listed[b"z"] = (OTHER, info(acked=7_000, sent=7_000))
    got = m.sample([HOST, OTHER])
    assert got[HOST].nbytes == 40_000 and got[OTHER].nbytes == 7_000
    assert set(m.sample([HOST])) == {HOST}


def test_a_socket_one_list_missed_is_not_counted_twice(clock):
    m = FakeMeter()
    m.listed[b"a"] = (HOST, info(acked=100_000, sent=300_000))
    m.sample([HOST])
    clock[0] += 0.02
    missed = m.listed.pop(b"a")  # credited with the 200 KB it owed
    assert m.sample([HOST])[HOST].nbytes == 200_000
    clock[0] += 0.02
    m.listed[b"a"] = (HOST, info(acked=180_000, sent=300_000))  # back: only 80 KB had been delivered
    d = m.sample([HOST])[HOST]
    assert missed and d.nbytes == 0 and not d.busy
    clock[0] += 0.02
    m.listed[b"a"] = (HOST, info(acked=300_000, sent=400_000))
    assert m.sample([HOST])[HOST].nbytes == 0  # what it was credited ahead of time
    clock[0] += 0.02
    m.listed[b"a"] = (HOST, info(acked=350_000, sent=400_000))
    assert m.sample([HOST])[HOST].nbytes == 50_000
    clock[0] += 0.02
    m.listed[b"a"] = (HOST, info(acked=360_000, sent=400_000))
    m.sample([HOST])
    clock[0] += 0.02  # missed again, then gone: all it wrote counted once in all
    del m.listed[b"a"]
    assert m.sample([HOST])[HOST].nbytes == 40_000


def test_the_kernel_filter_is_an_or_of_addresses_that_accepts_at_its_end_and_rejects_past_it():
    addrs = [socket.inet_pton(socket.AF_INET, a) for a in ("10.0.0.1", "10.0.0.2", "10.0.0.3")]
    code = _bytecode(socket.AF_INET, addrs)
    ops, at = [], 0
    while at < len(code):
        op, yes, no = struct.unpack_from("=BBH", code, at)
        ops.append((at, op, yes, no))
        at += 4 if op == delivery.INET_DIAG_BC_JMP else yes
    conds = [o for o in ops if o[1] == delivery.INET_DIAG_BC_D_COND]
    jumps = [o for o in ops if o[1] == delivery.INET_DIAG_BC_JMP]
    assert len(conds) == 3 and len(jumps) == 2
    for at, _, yes, no in jumps:
        assert at + no == len(code)  # a condition that held jumps to the end: accept
    at, _, yes, no = conds[-1]
    assert at + yes == len(code) and at + no == len(code) + 4  # the last one failing: past the end, reject


def test_a_socket_missed_then_gone_for_good_is_credited_once(clock):
    m = FakeMeter()
    m.listed[b"a"] = (HOST, info(acked=100_000, sent=300_000))
    m.sample([HOST])
    total = 0
    for listed in (None, info(acked=180_000, sent=300_000), None):  # missed, back, gone
        clock[0] += 0.02
        if listed is None:
            m.listed.pop(b"a", None)
        else:
            m.listed[b"a"] = (HOST, listed)
        total += m.sample([HOST])[HOST].nbytes
    assert total == 200_000
