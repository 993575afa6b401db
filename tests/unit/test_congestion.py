"""TCP's congestion signal on a node's egress (federation/congestion.py): the share of segments
resent over a window, read from /proc/net/snmp, published in /federation/state, and PrfaaS's t
raised while a remote node's share is high (federation/conductor/remote_prefill.py)."""
from __future__ import annotations

import pytest

from tokenflowd.federation.congestion import Retransmits, read_snmp

SNMP = """Ip: Forwarding DefaultTTL
Ip: 1 64
Tcp: RtoAlgorithm RtoMin RtoMax MaxConn ActiveOpens PassiveOpens AttemptFails EstabResets CurrEstab InSegs OutSegs RetransSegs InErrs OutRsts InCsumErrors
Tcp: 1 200 120000 -1 10 5 0 0 2 1000 {out} {retrans} 0 0 0
Udp: InDatagrams
Udp: 0
"""


def test_the_counters_are_read_from_the_tcp_lines(tmp_path):
    path = tmp_path / "snmp"
    path.write_text(SNMP.format(out=5000, retrans=7))
    assert read_snmp(str(path)) == (7, 5000)
    assert read_snmp(str(tmp_path / "absent")) is None
    path.write_text("Ip: Forwarding\nIp: 1\n")
    assert read_snmp(str(path)) is None


def test_the_share_is_resent_over_sent_segments_across_the_last_window():
    counters, now = [(0, 1000)], [0.0]
    r = Retransmits(read=lambda: counters[0], clock=lambda: now[0])
    assert r.share() is None  # one sample: nothing sent since
    counters[0], now[0] = (2, 1100), 0.5
    assert r.share() is None  # 100 segments: too few to judge (2% of an idle node's polls)
    counters[0], now[0] = (10, 2000), 1.0
    assert r.share() == pytest.approx(10 / 1000)
    counters[0], now[0] = (110, 3000), 2.0
    assert r.share() == pytest.approx(110 / 2000)
    # the window moves on: only what was sent in the last 5 s counts
    counters[0], now[0] = (130, 13000), 7.5
    assert r.share() == pytest.approx(20 / 10000)  # since the sample at 2.0 s, the newest 5 s old
    counters[0], now[0] = (130, 23000), 20.0
    assert r.share() == 0.0  # since 7.5 s: nothing resent
    assert Retransmits(read=lambda: None).share() is None  # not Linux: not measured


def test_a_remote_node_resending_many_segments_raises_t_until_it_eases():
    from test_prfaas_offload import cluster, state

    c = cluster(prfaas_threshold=1000, prfaas_retransmit_share=0.02)
    remote, local = [c.nodes["r0"]], [c.nodes[n] for n in ("p0", "d0", "d1")]
    for n in [500] * 40 + [6000] * 40:
        c.remote_prefill.route(n, n)
    calm_state = state("prefill", 1e-5, "r:0", links={"d:0": 1e9})
    c.nodes["r0"].apply({**calm_state, "tcp_retransmits": 0.001})
    calm = c.remote_prefill.update(remote, local, 0.0)
    assert not c.remote_prefill.congested
    c.nodes["r0"].apply({**calm_state, "tcp_retransmits": 0.05})
    assert c.remote_prefill.update(remote, local, 5.0) == 1.25 * calm and c.remote_prefill.congested
    c.nodes["r0"].apply({**calm_state, "tcp_retransmits": None})  # not measured: no signal
    assert c.remote_prefill.update(remote, local, 10.0) == calm and not c.remote_prefill.congested
