"""Engine choice: longest cached prefix, unless that engine is clearly busier."""
from dataclasses import dataclass, field

from tokenflowd.kv.pages import chain_page_keys
from tokenflowd.router import Router, cached_pages

PS = 4


@dataclass
class FakeEngine:
    engine_id: int
    keys: set = field(default_factory=set)
    load: int = 0


def keys_of(tokens):
    return chain_page_keys(tokens, PS, [])


def test_cached_pages_counts_the_leading_run_only():
    k = keys_of(list(range(16)))
    assert cached_pages(k, {k[0], k[1], k[3]}) == 2
    assert cached_pages(k, set()) == 0


def test_prefers_the_engine_holding_the_prefix():
    prompt = list(range(40))
    warm = FakeEngine(1, set(keys_of(prompt[:32])))
    choice = Router(PS).pick([FakeEngine(0), warm, FakeEngine(2)], prompt)
    assert (choice.engine_id, choice.cached_pages) == (1, 8)


def test_the_last_prompt_token_is_never_a_hit():
    prompt = list(range(16))  # 4 full pages; the last page holds the last token, so 3 can hit
    warm = FakeEngine(1, set(keys_of(prompt)))
    assert Router(PS).pick([FakeEngine(0), warm], prompt).cached_pages == 3


def test_load_outweighs_a_small_match():
    prompt = list(range(40))
    warm = FakeEngine(0, set(keys_of(prompt[:8])), load=10)  # 2 pages cached, 10 requests ahead
    idle = FakeEngine(1)
    assert Router(PS).pick([warm, idle], prompt).engine_id == 1
    warm.load = 1
    assert Router(PS).pick([warm, idle], prompt).engine_id == 0


def test_no_match_goes_to_the_least_loaded_then_lowest_id():
    prompt = list(range(10))
    engines = [FakeEngine(0, load=3), FakeEngine(1, load=1), FakeEngine(2, load=1)]
    assert Router(PS).pick(engines, prompt).engine_id == 1
