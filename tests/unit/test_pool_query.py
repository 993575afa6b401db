"""The pool's query path across processes: a requester ships each layer's query rows to a holder
process (POSIX shared memory for the rows, zmq for the control message), gets back partial
outputs and log-sum-exp over the holder's pinned segments, and merges them with its own
attention: the result equals attention over all pages (fp32, 1e-5). Pins are released by unpin
and by the holder's release of a dead peer; a key the holder lacks ends the pinned run."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tokenflowd.engine.attention.base import AttentionInputs, PageQuery
from tokenflowd.engine.attention.partial import merge_states
from tokenflowd.pool.query import PeerGone, QueryClient
from tokenflowd.pool.shared_kv import SharedKV

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import pool_holder as H  # noqa: E402
from daemon import read_line  # noqa: E402

SEED = 11


@pytest.fixture
def holder_process(tmp_path):
    """A holder process serving pages: (its address, its refs(), its cache's name, the process)."""
    address = f"ipc://{tmp_path}/pool-query.sock"
    shm_name = f"tokenflowd-test-{os.getpid()}-{tmp_path.name}"
    proc = subprocess.Popen([sys.executable, str(Path(H.__file__)), address, str(SEED), shm_name],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert read_line(proc).strip() == "ready"

    def refs() -> tuple[int, int]:
        proc.stdin.write("refs\n")
        proc.stdin.flush()
        pages, requests = read_line(proc).split()
        return int(pages), int(requests)

    yield address, refs, shm_name, proc
    proc.stdin.write("quit\n")
    proc.stdin.flush()
    assert proc.wait(timeout=30) == 0
    assert not Path(f"/dev/shm/{shm_name}").exists(), "the owner unlinks its cache"


@pytest.fixture
def holder(holder_process):
    return holder_process[:3]


def test_shipped_queries_merged_with_local_attention_equal_attention_over_all_pages(holder):
    address, refs, _ = holder
    backend = H.backend_()
    caches = H.caches(SEED)  # the holder's cache, rebuilt here for the reference
    client = QueryClient(1, address, 64, H.HEADS, H.HEAD_DIM, torch.float32)
    try:
        # Request a: segments 0 and 1 on the holder (16 tokens), then its own pages 30..33 with 3
        # more tokens and a 3-row chunk; request b: segment 5 only, then one decode token.
        held_a = client.pin("a", [bytes([0]), bytes([1]), bytes([99])]).held
        held_b = client.pin("b", [bytes([5])]).held
        assert (held_a, held_b) == (2, 1), "the run stops at the key it lacks"
        assert refs() == (6, 2)
        seg_pages = {"a": H.SEGMENTS[bytes([0])] + H.SEGMENTS[bytes([1])], "b": H.SEGMENTS[bytes([5])]}
        local_tables = {"a": [30, 31], "b": [34]}
        local_lens = {"a": 7, "b": 2}
        q_lens = {"a": 3, "b": 1}
        start = [0, 3, 4]
        gen = torch.Generator().manual_seed(1)
        for layer in range(H.LAYERS):
            q = torch.randn(4, H.HEADS, H.HEAD_DIM, generator=gen)
            k = torch.randn(4, H.KV_HEADS, H.HEAD_DIM, generator=gen)
            v = torch.randn(4, H.KV_HEADS, H.HEAD_DIM, generator=gen)
            cache = caches[layer].clone()
            # The reference: one block table with the segments' pages first, attended here.
            slots_all, tables_all, lens_all = [], [], []
            for rid in ("a", "b"):
                table = seg_pages[rid] + local_tables[rid]
                n = len(seg_pages[rid]) * H.PAGE + local_lens[rid]
                tables_all.append(table)
                lens_all.append(n)
                slots_all += [table[p // H.PAGE] * H.PAGE + p % H.PAGE for p in range(n - q_lens[rid], n)]
            whole = AttentionInputs(start, lens_all, tables_all, torch.tensor(slots_all))
            want = backend.forward(layer, q, k, v, cache.clone(), backend.prepare(whole))
            # Shipped: the holder attends to the segments; the rest is attended here.
            slots = [local_tables[r][p // H.PAGE] * H.PAGE + p % H.PAGE
                     for r in ("a", "b") for p in range(local_lens[r] - q_lens[r], local_lens[r])]
            rest = AttentionInputs(start, [local_lens["a"], local_lens["b"]], [local_tables["a"], local_tables["b"]],
                                   torch.tensor(slots))
            o_local, s_local = backend.forward_with_lse(layer, q, k, v, cache, backend.prepare(rest))
            o_seg, s_seg = client.query(layer, q, start, ["a", "b"])
            o, _ = merge_states(o_seg.clone(), s_seg.clone(), o_local, s_local)
            assert (o - want).abs().max() <= 1e-5
        client.unpin("a")
        assert refs() == (2, 1)
        client.release_peer(1, 0)  # the supervisor's word that requester 1 died
        assert refs() == (0, 0)
    finally:
        client.close()


def test_a_bad_query_is_an_error_for_the_requester_and_the_holder_keeps_serving(holder):
    address, refs, _ = holder
    client = QueryClient(2, address, 4, H.HEADS, H.HEAD_DIM, torch.float32)
    try:
        with pytest.raises(ValueError):
            client.query(0, torch.zeros(5, H.HEADS, H.HEAD_DIM), [0, 5], ["x"])
        with pytest.raises(RuntimeError, match="pool peer"):
            client.query(H.LAYERS, torch.zeros(1, H.HEADS, H.HEAD_DIM), [0, 1], ["x"])  # no such layer
        with pytest.raises(RuntimeError, match="no pins"):  # lost pins are an error, never an empty state
            client.query(0, torch.zeros(1, H.HEADS, H.HEAD_DIM), [0, 1], ["nothing pinned"])
        o, lse = client.query(0, torch.zeros(1, H.HEADS, H.HEAD_DIM), [0, 1], [""])  # no segments, on purpose
        assert torch.isneginf(lse).all() and not o.any()
        assert refs() == (0, 0)
    finally:
        client.close()


def test_read_mode_attends_in_place_to_the_peers_mapped_cache_and_equals_query_mode(holder):
    address, refs, shm_name = holder
    backend = H.backend_()
    peer = SharedKV.attach(shm_name, H.LAYERS, backend.kv_cache_shape(H.PAGES), torch.float32)
    client = QueryClient(3, address, 8, H.HEADS, H.HEAD_DIM, torch.float32)
    try:
        pinned = client.pin("r", [bytes([2])])  # read mode pins too: pages must not move
        pinned_more = client.pin("r", [bytes([3])])  # a second pin adds to the first
        assert refs() == (4, 1)
        pages = H.SEGMENTS[bytes([2])] + H.SEGMENTS[bytes([3])]
        assert pinned.pages + pinned_more.pages == pages, "the holder says which of its pages to read"
        q = torch.randn(3, H.HEADS, H.HEAD_DIM, generator=torch.Generator().manual_seed(4))
        for layer in range(H.LAYERS):
            o_read, s_read = backend.attend_pages(q, peer.layers[layer], PageQuery([0, 1, 3], [pages, pages]))
            o_query, s_query = client.query(layer, q, [0, 1, 3], ["r", "r"])
            assert (o_read - o_query).abs().max() <= 1e-5 and (s_read - s_query).abs().max() <= 1e-5
            want, _ = backend.attend_pages(q, H.caches(SEED)[layer], PageQuery([0, 1, 3], [pages, pages]))
            assert (o_read - want).abs().max() <= 1e-6
        client.unpin("r")
        assert refs() == (0, 0)
    finally:
        client.close()
        peer.close()


@pytest.mark.parametrize("how", ["timeout", "liveness"])
def test_a_dead_holder_is_an_error_not_a_hang(tmp_path, how):
    """Without a liveness check the timeout ends the wait; with one (the engine's: the holder's pid)
    the wait ends as soon as the holder's process is gone, however long the timeout."""
    address = f"ipc://{tmp_path}/pool-query.sock"
    shm_name = f"tokenflowd-test-{os.getpid()}-{how}"
    proc = subprocess.Popen([sys.executable, str(Path(H.__file__)), address, str(SEED), shm_name],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert read_line(proc).strip() == "ready"
        client = QueryClient(4, address, 2, H.HEADS, H.HEAD_DIM, torch.float32,  # a busy box may be slow here
                             alive=(lambda: proc.poll() is None) if how == "liveness" else None)
        try:
            assert client.pin("r", [bytes([0])]).held == 1
            proc.kill()
            proc.wait(timeout=30)
            # the holder is dead: no answer is coming however long we wait
            client.timeout_ms = 1000 if how == "timeout" else 600_000
            t0 = time.monotonic()
            with pytest.raises(PeerGone):
                client.query(0, torch.zeros(1, H.HEADS, H.HEAD_DIM), [0, 1], ["r"])
            assert time.monotonic() - t0 < 60
            t0 = time.monotonic()
            with pytest.raises(PeerGone, match="earlier" if how == "liveness" else "did not answer"):
                client.unpin("r")  # liveness: at once, the channel is known dead; timeout: it waits again
            assert time.monotonic() - t0 < 60
        finally:
            client.close()
    finally:
        proc.kill()
        Path(f"/dev/shm/{shm_name}").unlink(missing_ok=True)  # a killed owner cannot unlink its cache


def test_a_holder_alive_but_stopped_is_taken_for_gone_at_once_after_one_wait_then_asked_again(holder_process):
    """A holder that stops answering (SIGSTOP) ends one wait at the timeout; every call after it
    within `silent_for` is PeerGone at once, without asking (the engine's: a quarter of the
    supervisor's heartbeat timeout, then one whole: pool/member.py PEER_WAIT_SHARE). Each call waiting
    the timeout in turn, a requester's step went as long without a heartbeat as the stopped peer,
    and the supervisor killed the requester too. Once the window ends the holder is asked again."""
    import signal

    address, refs, _, proc = holder_process
    client = QueryClient(7, address, 4, H.HEADS, H.HEAD_DIM, torch.float32, timeout_ms=60_000, silent_for=600.0)
    try:
        assert client.pin("s", [bytes([0])]).held == 1  # (a busy box may be slow here)
        proc.send_signal(signal.SIGSTOP)
        client.timeout_ms = 300  # stopped: no answer comes however long the wait
        try:
            with pytest.raises(PeerGone, match="did not answer Query within 300 ms"):
                client.query(0, torch.zeros(1, H.HEADS, H.HEAD_DIM), [0, 1], ["s"])
            asked = client._seq
            with pytest.raises(PeerGone, match="taken for gone for 600 s"):
                client.unpin("s")
            assert client._seq == asked, "it asked the silent holder again"
        finally:
            proc.send_signal(signal.SIGCONT)
        client.silent_until = 0.0  # (the window over)
        client.timeout_ms = 60_000
        client.unpin("s")  # asked again: it answers, the query's late answer dropped
        assert refs() == (0, 0)
    finally:
        client.close()


def test_a_late_answer_is_dropped_by_its_sequence_number_and_the_channel_goes_on(holder):
    address, refs, _ = holder
    client = QueryClient(6, address, 4, H.HEADS, H.HEAD_DIM, torch.float32)
    try:
        assert client.pin("late", [bytes([4])]).held == 1
        q = torch.randn(2, H.HEADS, H.HEAD_DIM, generator=torch.Generator().manual_seed(2))
        client.submit(0, q, [0, 2], ["late"])  # given up on: never collected (a step that failed)
        time.sleep(0.2)  # its answer is waiting in the socket
        o, s = client.query(1, q, [0, 2], ["late"])  # the next call gets its own answer, not that one
        want, s_want = H.backend_().attend_pages(q, H.caches(SEED)[1], PageQuery([0, 2], [H.SEGMENTS[bytes([4])]]))
        assert (o - want).abs().max() <= 1e-6 and (s - s_want).abs().max() <= 1e-6
        client.unpin("late")
        assert refs() == (0, 0)
    finally:
        client.close()


def test_release_of_a_dead_incarnation_leaves_its_successors_pins(holder):
    address, refs, _ = holder
    old = QueryClient(7, address, 2, H.HEADS, H.HEAD_DIM, torch.float32, incarnation=1)
    new = QueryClient(7, address, 2, H.HEADS, H.HEAD_DIM, torch.float32, incarnation=2)
    try:
        assert old.pin("r", [bytes([6])]).held == 1 and new.pin("r", [bytes([7])]).held == 1
        assert refs() == (4, 2)
        new.release_peer(7, 1)  # incarnation 1 of engine 7 died (the supervisor said so, late)
        assert refs() == (2, 1)
        new.unpin("r")
        assert refs() == (0, 0)
    finally:
        old.close()
        new.close()


@pytest.mark.parametrize("refused", [False, True], ids=["opened", "refused"])
def test_query_buffers_on_the_requesters_device_carry_the_rows_or_fall_back_to_the_host(tmp_path, monkeypatch,
                                                                                        refused):
    """Query mode on a GPU (query.py QueryBuffers.on_device): q, o and lse live in one block of the
    requester's that it exports (cuda_ipc.export) and the holder opens (cuda_ipc.open_export), so the
    rows never go through shared memory; the answers are the holder's attention over the pages. A holder that
    cannot open the block (another GPU, IPC refused) says why; the requester moves its buffers to
    shared memory, sends the query again, and stages from then on (`staged` says why). Here the
    export is an in-process registry (the CPU stands in for the device) and the holder a thread."""
    from tokenflowd.pool import cuda_ipc
    from tokenflowd.pool.query import QueryService

    blocks: dict[str, torch.Tensor] = {}
    opened: list[str] = []

    def open_export(path: str) -> torch.Tensor:
        opened.append(path)
        if refused:
            raise ValueError("it is on GPU GPU-a, this engine on GPU-b")
        return blocks[path]

    monkeypatch.setattr(cuda_ipc, "export", lambda t, path: blocks.__setitem__(path, t))
    monkeypatch.setattr(cuda_ipc, "open_export", open_export)
    address = f"ipc://{tmp_path}/holder.sock"
    backend, caches = H.backend_(), H.caches(SEED)
    service = QueryService(address, backend, caches, lambda keys: [H.SEGMENTS[k] for k in keys],
                           lambda segments: None).start()
    exported = QueryClient(2, address, 8, H.HEADS, H.HEAD_DIM, torch.float32, device=torch.device("cpu"),
                           export=str(tmp_path / "q-2-0-0.cudaipc"))
    try:
        assert exported.buffers.on_gpu and blocks, "the requester's buffers are its exported block"
        assert exported.pin("a", [bytes([0]), bytes([1])]).held == 2
        gen = torch.Generator().manual_seed(3)
        for layer in range(H.LAYERS):
            q = torch.randn(3, H.HEADS, H.HEAD_DIM, generator=gen)
            want = backend.attend_pages(q, caches[layer], PageQuery([0, 3], [H.SEGMENTS[bytes([0])] +
                                                                             H.SEGMENTS[bytes([1])]]))
            got = exported.query(layer, q, [0, 3], ["a"])
            assert all(torch.equal(g, w) for g, w in zip(got, want)), layer
        assert opened == [str(tmp_path / "q-2-0-0.cudaipc")], "the holder opens the block once"
        if refused:
            assert "cannot be opened over CUDA IPC" in exported.staged and "GPU-b" in exported.staged
            assert not exported.buffers.on_gpu, "its rows go through shared memory from then on"
        else:
            assert exported.staged == "" and exported.buffers.on_gpu
            assert exported.buffers.raw is blocks[str(tmp_path / "q-2-0-0.cudaipc")]
            assert got[0].data_ptr() == exported.buffers.o.data_ptr(), "o is read from the block the holder wrote"
    finally:
        exported.close()
        service.close()


def test_the_files_of_a_killed_engines_query_buffers_are_found_for_every_holder_and_no_other_engines(tmp_path):
    """The supervisor removes them with the engine's cache (supervisor.py _engine_gone)."""
    from tokenflowd.pool.names import query_buffers_of, query_buffers_path

    for engine, incarnation, holder in ((1, 0, 0), (1, 0, 2), (1, 1, 0), (11, 0, 2)):
        (tmp_path / os.path.basename(query_buffers_path(str(tmp_path), engine, incarnation, holder))).touch()
    found = sorted(os.path.basename(p) for p in query_buffers_of(str(tmp_path), 1, 0))
    assert found == ["q-1-0-0.cudaipc", "q-1-0-2.cudaipc"]
