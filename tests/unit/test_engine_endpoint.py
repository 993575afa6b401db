"""The engine's end of the supervisor protocol, without a model: a send the supervisor never takes
ends the engine instead of blocking its loop for good."""
from __future__ import annotations

import time

import pytest

from tokenflowd import protocol as p
from tokenflowd.engine.process.endpoint import EngineEndpoint, SupervisorUnreachable


class Idle(EngineEndpoint):
    def add(self, msg):
        return None

    def abort(self, request_id):
        pass

    def set_reading_rate(self, msg):
        pass

    def set_read_cursor(self, msg):
        pass

    def infos(self, request_ids):
        return []


def test_a_message_nobody_takes_raises_after_the_send_timeout(tmp_path):
    # Nothing is bound at the output address: messages queue up to the socket's high-water mark
    # (1000), then can go nowhere, as with a supervisor that stopped reading.
    spec = p.EngineSpec(0, 0, f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out", 0.5, {}, send_timeout=0.2)
    engine = Idle(spec)
    try:
        t0 = time.monotonic()
        with pytest.raises(SupervisorUnreachable, match="no message for 0.2 s"):
            for i in range(5000):
                engine.send(p.QueryReply(0, 0, i, []))
        assert 1000 <= i < 5000 and time.monotonic() - t0 < 10
    finally:
        engine.close()


def test_deltas_go_to_the_front_that_sent_the_request_and_the_rest_to_all(tmp_path):
    """With API server processes, a request's deltas reach only its front; stats and Ready reach every
    output; a query's reply the output that asked; AbortFront aborts that front's requests alone."""
    import msgspec
    import zmq

    ctx = zmq.Context()
    outs = []
    for name in ("out", "f1", "f2"):
        sock = ctx.socket(zmq.PULL)
        sock.bind(f"ipc://{tmp_path}/{name}")
        outs.append(sock)
    spec = p.EngineSpec(0, 1, f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out", 0.5, {},
                        front_addresses=[f"ipc://{tmp_path}/f1", f"ipc://{tmp_path}/f2"])

    class Recorder(Idle):
        aborted: list[str] = []

        def abort(self, request_id):
            self.aborted.append(request_id)

        def cached_keys(self):
            return [b"k1", b"k2"]

        def pool_moved(self, msg):
            self.moved.append(msg)

    engine = Recorder(spec)
    engine.moved = []
    inbox = ctx.socket(zmq.PUSH)
    inbox.connect(spec.input_address)
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(p.FromEngine)

    def recv(sock):
        assert sock.poll(5000)
        return dec.decode(sock.recv())

    def pump(done, timeout=10.0):
        """Handle the engine's inbox until `done()`; messages sent together may arrive apart."""
        deadline = time.monotonic() + timeout
        while not done() and time.monotonic() < deadline:
            engine.inbox.poll(50)
            engine.drain_inbox()

    try:
        for rid, front in (("a", 1), ("b", 2), ("c", 2)):
            inbox.send(enc.encode(p.AddRequest(rid, [1], p.Sampling(), 10.0, front=front)))
        inbox.send(enc.encode(p.QueryRequests(7, None, front=2)))
        # the adds and the query may come in separate batches: drain until the reply is out
        pump(lambda: len(engine.request_front) == 3 and outs[2].poll(0))
        assert recv(outs[2]).query_id == 7 and not outs[0].poll(0) and not outs[1].poll(0)
        stats = p.EngineStats(3, 0, 0, 0, 0, 0, 0, 0.0)
        engine.send_step(1.0, [p.Delta("a", [5]), p.Delta("b", [6], "length"), p.Delta("c", [7])], stats,
                         [b"k"], [b"m"], [p.PrefixRun(2, [b"m"])], [3])
        got = [recv(s) for s in outs]
        assert [[d.request_id for d in m.deltas] for m in got] == [[], ["a"], ["b", "c"]]
        assert all(m.stats == stats and m.keys_added == [b"k"] and m.keys_removed == [b"m"]
                   and m.keys_moved == [p.PrefixRun(2, [b"m"])] and m.moved_readers == [3] for m in got)
        moved = p.Moved(4, [p.PrefixRun(2, [b"m"])])  # a peer wrote what requests here read into its home
        inbox.send(enc.encode(moved))
        pump(lambda: engine.moved)
        assert engine.moved == [moved], "handed to the pool (PoolHooks.follow)"
        assert "b" not in engine.request_front  # finished: forgotten
        inbox.send(enc.encode(p.AbortFront(2)))
        pump(lambda: "c" not in engine.request_front)
        assert engine.aborted == ["c"] and engine.request_front == {"a": 1}
        # front 2's last add, sent before it died, arrives after the abort: dropped; its successor's is taken
        inbox.send(enc.encode(p.AddRequest("late", [1], p.Sampling(), 10.0, front=2, front_epoch=0)))
        inbox.send(enc.encode(p.AddRequest("next", [1], p.Sampling(), 10.0, front=2, front_epoch=1)))
        pump(lambda: "next" in engine.request_front)
        assert engine.request_front == {"a": 1, "next": 2}
        inbox.send(enc.encode(p.QueryKeys(front=1)))  # a front that (re)starts: the keys it missed
        pump(lambda: outs[1].poll(0))
        snapshot = recv(outs[1])
        assert isinstance(snapshot, p.KeySnapshot) and snapshot.keys == [b"k1", b"k2"]
        assert not outs[0].poll(0) and not outs[2].poll(0)
    finally:
        engine.close()
        ctx.destroy(linger=0)
