"""Tokenization off the event loop: prompts are tokenized in a few worker threads, so that a large
one does not hold up every open stream and /health while it is encoded.

`tokenizers` releases the GIL while it encodes a batch (text/tokenizer.py encodes large texts as a
batch of one), and the chat template's rendering, pure Python, hands the GIL back every few
milliseconds. At most `max_bytes` of text are in the workers at once: a request beyond that waits
its turn (it is cancelled with its client), so a flood of large prompts queues instead of taking
the front's memory.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

WORKERS = 2  # API server processes scale the front; one of them needs no more than this


class TokenizerPool:
    def __init__(self, max_bytes: int, workers: int = WORKERS) -> None:
        self.max_bytes = max_bytes
        self.in_flight = 0  # bytes of text the workers hold
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="tokenize")
        self._room: asyncio.Condition | None = None  # made on the loop that first uses it

    async def run(self, nbytes: int, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) in a worker, once `nbytes` of room is free (a text above max_bytes waits for all of it)."""
        nbytes = min(nbytes, self.max_bytes)
        if self._room is None:
            self._room = asyncio.Condition()
        async with self._room:
            await self._room.wait_for(lambda: self.in_flight + nbytes <= self.max_bytes)
            self.in_flight += nbytes
        work = asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        # a client gone mid-encode leaves the worker busy until it ends: its bytes count until then
        work.add_done_callback(lambda _: asyncio.ensure_future(self._release(nbytes)))
        return await asyncio.shield(work)

    async def _release(self, nbytes: int) -> None:
        async with self._room:
            self.in_flight -= nbytes
            self._room.notify_all()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
