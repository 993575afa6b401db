"""KV pages between two processes over Mooncake's Transfer Engine (TCP, P2P handshake): scattered
pages of one cache land on other pages of a differently sized cache, byte-identical (SHA-256 on
both sides), as one aggregated batch of runs and staged as one contiguous run; the link's measured
bandwidth is kept; a peer that is gone is a failed transfer within the timeout, not a hang."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("mooncake.engine", reason="the federation extra (Mooncake Transfer Engine) is not installed")

from tokenflowd.federation.transport import Block, KVLayout, MooncakeTransport, TransferFailed, kv_blocks  # noqa: E402
from tokenflowd.kv.staging import gather_pages  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import federation_peer as peer_script  # noqa: E402
from daemon import read_line  # noqa: E402


@pytest.fixture
def peer(tmp_path):
    env = {**os.environ, "GLOG_minloglevel": "2"}
    log = open(tmp_path / "peer.log", "w")
    proc = subprocess.Popen([sys.executable, peer_script.__file__, "20"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    line = read_line(proc)
    if not line:
        pytest.fail(f"the peer exited: {(tmp_path / 'peer.log').read_text()[-2000:]}")
    info = json.loads(line)

    def ask(line: str) -> str:
        proc.stdin.write(line + "\n")
        proc.stdin.flush()
        return read_line(proc).strip()

    yield info, ask, proc
    if proc.poll() is None:
        proc.stdin.write("quit\n")
        proc.stdin.flush()
        proc.wait(timeout=60)
    log.close()


def landed(ask, pages: list[int], want: str, scatter: bool = False, within: float = 30.0) -> None:
    """DONE means sent, not landed (Mooncake over TCP): ask the receiver until `pages` hold `want`
    (scattering the staged run again first, with `scatter`), or fail after `within` s."""
    listed = ",".join(map(str, pages))
    deadline = time.monotonic() + within
    while True:
        if scatter:
            assert ask("scatter " + listed) == "ok"
        if ask("sha " + listed) == want:
            return
        assert time.monotonic() < deadline, "the pages never arrived intact"
        time.sleep(0.05)


def test_scattered_pages_arrive_byte_identical_in_one_batch(peer):
    info, ask, _ = peer
    P = peer_script
    g = torch.Generator().manual_seed(3)
    cache = torch.randn(P.LAYERS, 2, P.KV_HEADS, 12, P.PAGE, P.HEAD_DIM, generator=g).to(torch.bfloat16)
    transport = MooncakeTransport()
    try:
        transport.register(cache)
        src = KVLayout.of(list(cache.unbind(0)))
        dst = KVLayout(tuple(info["bases"]), tuple(info["shape"]), info["itemsize"])
        src_pages, dst_pages = [3, 4, 5, 9], [10, 11, 2, 7]
        blocks = kv_blocks(src, dst, src_pages, dst_pages)
        # pages 3, 4 -> 10, 11 are adjacent on both sides: one run per (layer, plane, head) for them
        assert len(blocks) == P.LAYERS * 2 * P.KV_HEADS * 3
        transfer = transport.submit_write(info["endpoint"], blocks)
        transport.wait(transfer, timeout=60)
        assert transport.settled(transfer), "done: the engine is through with it"
        landed(ask, dst_pages, P.page_digest(list(cache.unbind(0)), src_pages))
        assert ask("sha 0,1") == P.page_digest([torch.zeros_like(cache[0])] * P.LAYERS, [0, 1]), "nothing else written"
        assert transport.bandwidth(info["endpoint"]) > 0
    finally:
        transport.close()


def test_staged_pages_travel_as_one_run_and_land_byte_identical(peer):
    info, ask, _ = peer
    P = peer_script
    g = torch.Generator().manual_seed(5)
    cache = torch.randn(P.LAYERS, 2, P.KV_HEADS, 12, P.PAGE, P.HEAD_DIM, generator=g).to(torch.bfloat16)
    staging = torch.empty(cache.numel(), dtype=torch.bfloat16)
    transport = MooncakeTransport()
    try:
        transport.register(staging)
        layers, src_pages, dst_pages = list(cache.unbind(0)), [8, 0, 6], [19, 3, 12]
        run = gather_pages(layers, src_pages, staging)
        transport.write(info["endpoint"], [Block(run.data_ptr(), info["staging"], run.numel() * run.element_size())],
                        timeout=60)
        landed(ask, dst_pages, P.page_digest(layers, src_pages), scatter=True)
    finally:
        transport.close()


def test_a_peer_that_is_gone_is_a_failed_transfer_not_a_hang(peer):
    info, _, proc = peer
    proc.kill()
    proc.wait(timeout=30)
    transport = MooncakeTransport()
    try:
        buf = torch.ones(4096, dtype=torch.uint8)
        region = transport.register(buf)
        transfer = transport.submit_write(info["endpoint"], [Block(region.address, info["bases"][0], 4096)])
        with pytest.raises(TransferFailed):
            transport.wait(transfer, timeout=60)
        assert transport.status(transfer) == "failed" and transport.settled(transfer)
        assert transport.links[info["endpoint"]].failures == 1
    finally:
        transport.close()




def test_a_node_is_warned_when_closed_connections_ports_are_not_reused(tmp_path):
    from tokenflowd.federation.transport import port_reuse_warning

    sysctl = tmp_path / "tcp_tw_reuse"
    sysctl.write_text("2\n")  # the kernel's default: loopback only
    assert "tcp_tw_reuse=1" in port_reuse_warning(str(sysctl))
    sysctl.write_text("1\n")
    assert port_reuse_warning(str(sysctl)) is None
    assert port_reuse_warning(str(tmp_path / "absent")) is None
