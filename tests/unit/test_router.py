"""Engine choice: longest cached prefix, unless that engine is clearly busier."""
from dataclasses import dataclass

from tokenflowd.kv.pages import chain_page_keys
from tokenflowd.prefix_index import PrefixIndex
from tokenflowd.router import Router

PS = 4


@dataclass
class FakeEngine:
    engine_id: int
    load: int = 0


def keys_of(tokens):
    return chain_page_keys(tokens, PS, [])


def router_with(held: dict[int, list[bytes]]) -> Router:
    index = PrefixIndex()
    for engine_id, keys in held.items():
        index.update(engine_id, keys, [])
    return Router(PS, index)


def test_the_index_counts_the_leading_run_only_and_follows_key_events():
    k = keys_of(list(range(16)))
    index = PrefixIndex()
    index.update(0, [k[0], k[1], k[3]], [])
    assert index.cached_pages(0, k) == 2 and index.cached_pages(1, k) == 0
    index.update(0, [k[2]], [k[1]])  # an eviction and a publication in one step message
    assert index.cached_pages(0, k) == 1
    index.update(0, [k[1]], [k[1]])  # evicted, then published again: held
    assert index.cached_pages(0, k) == 4
    index.forget(0)  # the engine went away: its successor starts cold
    assert index.cached_pages(0, k) == 0 and index.num_keys(0) == 0
    index.update(1, [k[3]], [])
    index.replace(1, [k[0], k[1]])  # a snapshot (a front that restarted): all the engine holds
    assert index.cached_pages(1, k) == 2 and index.num_keys(1) == 2


def test_prefers_the_engine_holding_the_prefix():
    prompt = list(range(40))
    choice = router_with({1: keys_of(prompt[:32])}).pick([FakeEngine(0), FakeEngine(1), FakeEngine(2)], prompt)
    assert (choice.engine_id, choice.cached_pages) == (1, 8)


def test_the_last_prompt_token_is_never_a_hit():
    prompt = list(range(16))  # 4 full pages; the last page holds the last token, so 3 can hit
    assert router_with({1: keys_of(prompt)}).pick([FakeEngine(0), FakeEngine(1)], prompt).cached_pages == 3


def test_load_outweighs_a_small_match():
    prompt = list(range(40))
    router = router_with({0: keys_of(prompt[:8])})
    warm = FakeEngine(0, load=10)  # 2 pages cached, 10 requests ahead
    idle = FakeEngine(1)
    assert router.pick([warm, idle], prompt).engine_id == 1
    warm.load = 1
    assert router.pick([warm, idle], prompt).engine_id == 0


def test_no_match_goes_to_the_least_loaded_then_lowest_id():
    prompt = list(range(10))
    engines = [FakeEngine(0, load=3), FakeEngine(1, load=1), FakeEngine(2, load=1)]
    assert router_with({}).pick(engines, prompt).engine_id == 1
