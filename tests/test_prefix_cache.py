"""The prefix cache's host-side index: hash-chained page keys, longest cached prefixes, and
least-recently-used eviction of the pages no sequence uses."""

import pytest

from models.prefix_cache import PrefixCache, page_keys

PAGE = 4


def test_a_page_key_names_its_whole_prefix():
    tokens = list(range(10))
    keys = page_keys(tokens, PAGE)
    assert len(keys) == 2  # full pages only
    assert page_keys(tokens + [7, 7], PAGE)[:2] == keys  # a longer prompt extends the chain
    other = page_keys([9, 9, 9, 9] + tokens[PAGE:], PAGE)
    assert other[1] != keys[1]  # the same second page after another first page
    assert page_keys(tokens[:3], PAGE) == []


def test_match_takes_the_longest_cached_run_from_the_first_page():
    cache = PrefixCache()
    keys = page_keys(list(range(16)), PAGE)
    assert cache.insert(keys[0], 5) and cache.insert(keys[1], 2) and cache.insert(keys[3], 7)
    assert cache.match(keys) == [5, 2]  # page 3 is cached, but not page 2 before it
    assert not cache.insert(keys[0], 9)  # that prefix is cached already, in page 5
    assert cache.num_pages == 3 and 5 in cache and 9 not in cache


def test_idle_pages_are_evicted_least_recently_used_deepest_first():
    cache = PrefixCache()
    a, b = page_keys(list(range(12)), PAGE), page_keys(list(range(50, 62)), PAGE)
    for key, page in zip(a + b, [0, 1, 2, 3, 4, 5], strict=True):
        cache.insert(key, page)  # each used by the sequence that computed it
    assert cache.num_idle == 0
    cache.unuse([0, 1, 2])
    cache.unuse([3, 4, 5])
    cache.use([0])  # a new sequence starts on a's first page
    assert cache.num_idle == 5 and not cache.is_idle(0)
    assert [cache.evict() for _ in range(3)] == [2, 1, 5]
    assert cache.match(a) == [0] and cache.match(b) == [3, 4]
    cache.unuse([0])
    assert [cache.evict() for _ in range(3)] == [4, 3, 0]
    assert cache.num_pages == 0
    with pytest.raises(KeyError):
        cache.evict()


def test_num_shared_counts_pages_two_running_sequences_use():
    cache = PrefixCache()
    for key, page in ((b"a", 5), (b"b", 6)):
        assert cache.insert(key, page)  # used by the sequence that computed it
    assert cache.num_shared == 0
    cache.use([5, 6])  # a hit on both pages
    cache.use([5])  # and another on the first
    assert cache.num_shared == 2
    cache.unuse([5, 6])
    assert cache.num_shared == 1
    cache.unuse([5])
    cache.unuse([5, 6])  # the computing sequence ends: both idle
    assert cache.num_shared == 0 and cache.num_idle == 2
