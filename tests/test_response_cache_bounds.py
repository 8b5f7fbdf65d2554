"""The response cache's bounds in one process (core/response_cache.py): it holds at most
`response_cache_bytes` (outputs and keys counted), a hit makes an entry the most recently used, and the
least recently used entries go first when a new one needs room; an entry put again counts once (and is
used again), and a version seen with a new fingerprint loses its entries (and only its own)."""

from __future__ import annotations

from mpsd.daemon.core.response_cache import ResponseCache
from mpsd.daemon.dataplane.request import OutputTensor

KEY = 8  # bytes of each key below
DATA = 92  # bytes of each entry's output: an entry counts 100 bytes


def _key(i: int) -> bytes:
    return i.to_bytes(KEY, "big")


def _outputs(i: int) -> tuple[OutputTensor, ...]:
    return (OutputTensor("y", "UINT8", (DATA,), bytes([i]) * DATA),)


def _cached(cache: ResponseCache, *keys: int) -> list[int]:
    return [i for i in keys if cache.get(_key(i)) is not None]


def test_the_cache_never_holds_more_bytes_than_its_capacity() -> None:
    cache = ResponseCache(capacity_bytes=350)  # three entries of 100 bytes fit, four do not
    for i in range(10):
        cache.put("m/1", _key(i), _outputs(i))
        assert cache.used <= 350, (i, cache.used)
    assert len(cache) == 3 and cache.used == 300
    assert _cached(cache, *range(10)) == [7, 8, 9]  # the newest; the oldest went first


def test_an_entry_larger_than_the_whole_cache_is_not_kept() -> None:
    cache = ResponseCache(capacity_bytes=99)
    cache.put("m/1", _key(1), _outputs(1))
    assert len(cache) == 0 and cache.used == 0


def test_a_hit_makes_the_entry_the_last_to_be_evicted() -> None:
    cache = ResponseCache(capacity_bytes=300)
    for i in (1, 2, 3):
        cache.put("m/1", _key(i), _outputs(i))
    hit = cache.get(_key(1))  # 1 was the oldest; now 2 is
    assert hit is not None and hit[0].data == bytes([1]) * DATA
    cache.put("m/1", _key(4), _outputs(4))
    assert _cached(cache, 1, 2, 3, 4) == [1, 3, 4]
    cache.get(_key(3))  # least recently used first: 1, 4, 3
    cache.put("m/1", _key(5), _outputs(5))
    assert _cached(cache, 1, 3, 4, 5) == [3, 4, 5]


def test_an_entry_put_again_is_counted_once() -> None:
    cache = ResponseCache(capacity_bytes=300)
    for _ in range(3):
        cache.put("m/1", _key(1), _outputs(1))
    assert len(cache) == 1 and cache.used == 100


def test_an_entry_put_again_becomes_the_most_recently_used() -> None:
    """Two identical requests that both missed each put their answer: the second put is a use too."""
    cache = ResponseCache(capacity_bytes=300)
    for i in (1, 2, 3):
        cache.put("m/1", _key(i), _outputs(i))
    cache.put("m/1", _key(1), _outputs(1))  # 1 was the oldest; now 2 is
    cache.put("m/1", _key(4), _outputs(4))
    assert _cached(cache, 1, 2, 3, 4) == [1, 3, 4]


def test_a_new_fingerprint_drops_that_versions_entries_and_only_those() -> None:
    cache = ResponseCache(capacity_bytes=1000)
    cache.seen("m/1", "a")
    cache.put("m/1", _key(1), _outputs(1))
    cache.put("m/1", _key(2), _outputs(2))
    cache.put("other/1", _key(3), _outputs(3))
    cache.seen("m/1", "a")  # the same version again: nothing goes
    assert _cached(cache, 1, 2, 3) == [1, 2, 3]
    cache.seen("m/1", "b")  # reloaded: its predecessor's entries go, and their bytes
    assert _cached(cache, 1, 2, 3) == [3] and cache.used == 100
