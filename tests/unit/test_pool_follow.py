"""A read follows its segment (pool/member.py `follow`, protocol.Moved): requests that pinned a
sender's pages of segments it then wrote into their homes read them at the homes from then on, and
the sender's copy goes once no one reads it. Without it they read the sender's copy, kept for them,
apart from its homes, for as long as they ran: a second copy, and reads away from the homes."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from test_pool_put import HEAD_DIM, HEADS, PAGE, member

from tokenflowd import protocol as p
from tokenflowd.engine.attention.partial import merge_states
from tokenflowd.kv.pages import chain_page_keys
from tokenflowd.pool.attention import PeerCache, QueriedHolder

N = 8  # pages of the shared prefix: two segments of 4


@pytest.fixture
def node(tmp_path):
    """Engines 0 (the sender, which computed the prefix), 1 (the home) and 2 (a reader)."""
    members = [member(e, 24, str(tmp_path)) for e in range(3)]
    peers = [p.PoolPeer(e, 1, os.getpid(), 24) for e in range(3)]
    for m in members:
        m.set_peers(peers)
    keys = chain_page_keys(list(range(N * PAGE + 1)), PAGE, [])
    sender = members[0]
    local = [sender.pool.allocate() for _ in keys]  # the computing request's own pages
    for page, key in zip(local, keys):
        sender.pool.register(page, key)
    yield members, keys, local
    for m in members:
        m.close()


def write_into_home(sender, keys, local, upto: int = N) -> None:
    """As PoolHooks._hand_off: the request's pages go into their home, engine 1, and stop being
    cached here."""
    assert sender.hand_off("h", [(1, keys[:upto], local[:upto])]) == upto
    sender.pool.unpublish(keys[:upto])


def foreign_attention(m, rid: str, q: torch.Tensor) -> tuple[torch.Tensor, set[str]]:
    """The request's attention over its foreign prefix as its steps compute it (PoolMember.holders:
    one source per engine holding its pages, merged by LSE), and the kinds of source."""
    sources = m.holders(SimpleNamespace(request_ids=[rid], offsets=[N * PAGE]), [0, q.shape[0]])
    out = None
    for src in sources:
        src.submit(0, q)
        o, lse = (t.clone() for t in src.collect(0, q))
        out = (o, lse) if out is None else merge_states(*out, o, lse)
    return out[0], {type(s).__name__ for s in sources}


def test_a_reader_of_the_senders_copy_reads_the_home_from_then_on_and_the_copy_goes(node):
    (sender, home, reader), keys, local = node
    assert reader.pin("r", [p.PrefixRun(0, keys)]) == N
    q = torch.randn(3, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(5))
    before, kinds = foreign_attention(reader, "r", q)
    assert kinds == {QueriedHolder.__name__}
    write_into_home(sender, keys, local)
    assert sender.readers(local) == [2], "the sender knows who reads what moved (StepOutputs.moved_readers)"
    assert all(sender.pool.ref_count(page) == 2 for page in local), "its request's and the reader's"

    assert reader.follow(0, [p.PrefixRun(1, keys)]) == N
    prefix = reader.foreign["r"]
    assert list(prefix.pages) == [1] and prefix.keys[1] == keys, "all of it is read at the home now"
    assert (2, 1, "r") not in sender.service.pins and sender.readers(local) == []
    assert len(home.service.pins[(2, 1, "r")]) == N
    after, _ = foreign_attention(reader, "r", q)
    assert torch.allclose(after, before, atol=1e-5), "the same KV, read where it lives"
    free = sender.pool.num_free
    for page in local:  # the sender's request lets go of its own pages (PoolHooks._hand_off)
        sender.pool.decref(page)
    assert sender.pool.num_free == free + N and not sender.pool.lookup(keys), "no second copy is left"
    assert reader.follow(0, [p.PrefixRun(1, keys)]) == 0, "told twice (every front hears it): nothing more moves"
    reader.release("r")
    assert (2, 1, "r") not in home.service.pins and (0, 1, "h") in home.service.pins, "the sender's own pins stay"


def test_what_the_home_no_longer_holds_is_read_where_it_was(node):
    (sender, _, reader), keys, local = node
    assert reader.pin("r", [p.PrefixRun(0, keys)]) == N
    q = torch.randn(2, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(6))
    before, _ = foreign_attention(reader, "r", q)
    write_into_home(sender, keys, local, upto=5)  # (the home took 5 pages: say it was full)
    assert reader.follow(0, [p.PrefixRun(1, keys)]) == 5, "the run names 8 pages; the home holds 5"
    prefix = reader.foreign["r"]
    assert prefix.keys == {1: keys[:5], 0: keys[5:]}
    assert [pg for seg in sender.service.pins[(2, 1, "r")] for pg in seg] == local[5:]
    after, kinds = foreign_attention(reader, "r", q)
    assert kinds == {QueriedHolder.__name__} and torch.allclose(after, before, atol=1e-5), "two holders, merged"


def test_a_reader_that_is_the_home_reads_its_own_pages(node):
    (sender, home, _), keys, local = node
    assert home.pin("r", [p.PrefixRun(0, keys)]) == N
    q = torch.randn(2, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(7))
    before, _ = foreign_attention(home, "r", q)
    write_into_home(sender, keys, local)
    assert home.follow(0, [p.PrefixRun(1, keys)]) == N
    assert list(home.foreign["r"].pages) == [1] and (1, 1, "r") not in sender.service.pins
    after, kinds = foreign_attention(home, "r", q)
    assert kinds == {PeerCache.__name__} and torch.allclose(after, before, atol=1e-5), "attended in place, here"
    held = home.foreign["r"].pages[1]
    home.release("r")
    assert all(home.pool.ref_count(page) == 1 for page in held), "the sender's request's pin is left"


def test_an_unpin_of_some_pages_leaves_the_rest_pinned(node):
    (sender, _, reader), keys, local = node
    client = reader._client(reader.peers[0])
    pinned = client.pin("r", keys).pages
    client.unpin("r", pinned[2:5])
    assert [pg for seg in sender.service.pins[(2, 1, "r")] for pg in seg] == pinned[:2] + pinned[5:]
    assert [sender.pool.ref_count(pg) for pg in pinned] == [2, 2, 1, 1, 1, 2, 2, 2]
    client.unpin("r", pinned)  # all of them named: the pin goes
    assert (2, 1, "r") not in sender.service.pins
    client.pin("r", keys)
    client.unpin("r")  # none named: all of them
    assert (2, 1, "r") not in sender.service.pins and all(sender.pool.ref_count(pg) == 1 for pg in local)


def test_the_engine_follows_when_told_and_so_do_the_senders_own_readers(node):
    """PoolHooks.follow (protocol.Moved, from the supervisor) counts what moved (EngineStats.pool_followed);
    a request on the sender itself that read the pages as its own run follows as well."""
    from contextlib import nullcontext

    from tokenflowd.pool.engine_hooks import PoolHooks

    (sender, _, reader), keys, local = node
    assert reader.pin("r", [p.PrefixRun(0, keys)]) == N
    assert sender.pin("own", [p.PrefixRun(0, keys)]) == N, "its own pages, pinned where they are"
    write_into_home(sender, keys, local)
    hooks = PoolHooks.__new__(PoolHooks)
    hooks.member, hooks.core, hooks.followed = reader, SimpleNamespace(unlocked=nullcontext), 0
    hooks.follow(p.Moved(0, [p.PrefixRun(1, keys)]))
    assert hooks.followed == N and list(reader.foreign["r"].pages) == [1]
    assert sender.follow(0, [p.PrefixRun(1, keys)]) == N and list(sender.foreign["own"].pages) == [1]
    assert all(sender.pool.ref_count(page) == 1 for page in local), "only the computing request's own"


def test_a_segment_split_between_two_holders_is_pinned_in_its_parts_and_attended_as_one(node):
    """The router names a segment no engine holds whole in its parts where they are (Router._parts:
    its leading pages at one engine, the rest at another). The reader pins each part on its holder,
    and its attention over them, merged, is its attention over the whole read at one holder."""
    (sender, home, reader), keys, local = node
    assert reader.pin("whole", [p.PrefixRun(0, keys)]) == N
    q = torch.randn(3, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(8))
    before, _ = foreign_attention(reader, "whole", q)
    write_into_home(sender, keys, local, upto=5)  # the second segment (pages 4-7): page 4 at the home
    assert reader.pin("split", [p.PrefixRun(1, keys[:5]), p.PrefixRun(0, keys[5:])]) == N
    assert reader.foreign["split"].keys == {1: keys[:5], 0: keys[5:]}
    after, kinds = foreign_attention(reader, "split", q)
    assert kinds == {QueriedHolder.__name__} and torch.allclose(after, before, atol=1e-5), "two holders, merged"
    for rid in ("whole", "split"):
        reader.release(rid)
