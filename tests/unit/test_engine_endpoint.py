"""The engine's end of the supervisor protocol, without a model: a send the supervisor never takes
ends the engine instead of blocking its loop for good."""
from __future__ import annotations

import time

import pytest

from tokenflowd import protocol as p
from tokenflowd.engine.endpoint import EngineEndpoint, SupervisorUnreachable


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
