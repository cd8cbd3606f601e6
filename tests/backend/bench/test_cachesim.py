from backend.bench.cachesim import lfu_hit_rate, lru_hit_rate


def test_lru_hand_checked() -> None:
    # cap 2: a b a c b -> miss miss hit miss(evicts b) miss
    assert lru_hit_rate("abacb", 2) == 1 / 5


def test_lfu_keeps_frequent_entries() -> None:
    # a is used often; a scan of one-off keys must not evict it from a 2-slot LFU cache.
    uses = "aaa" + "bcdefg" + "a"
    assert lfu_hit_rate(uses, 2) == 3 / 10
    assert lru_hit_rate(uses, 2) == 2 / 10


def test_lfu_ties_evict_oldest() -> None:
    # cap 2: c evicts a (count 1, oldest); a comes back with count 2 and evicts b
    # (count 1, older than c); so only the final c hits.
    assert lfu_hit_rate("abcac", 2) == 1 / 5
    assert lfu_hit_rate("abcc", 2) == 1 / 4


def test_zero_capacity_never_hits() -> None:
    assert lfu_hit_rate("aaaa", 0) == 0 and lru_hit_rate("aaaa", 0) == 0
