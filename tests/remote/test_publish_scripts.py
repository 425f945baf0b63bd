"""Publishing against a real Redis. The scripts: each record key gets its record and
the reply names, in order, the record each key held before ('' where none), whatever
the batch's size (the scripts swap records a thousand keys at a time) and whatever it
replaced; a lease that does not hold publishes nothing. The Redis tier's writes: more
writers at once than it has threads sending payloads all publish exact bytes."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator

import blake3
import numpy as np
import pytest
import redis
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvlife.core.identity import ChunkKey
from kvlife.globalindex import IndexConfig
from kvlife.tiers.base import ReplicaMeta
from kvlife.tiers.redis import RedisEndpoint, RedisTier
from kvlife.tiers.redis.server import RedisServer
from kvlife.tiers.redis.tier import SENDERS

SIZES = st.one_of(st.sampled_from([1, 999, 1000, 1001, 2000, 2001]), st.integers(1, 2100))


def _keys(n: int, salt: int) -> list[bytes]:
    return [blake3.blake3(b"pub%d:%d" % (salt, i)).digest() for i in range(n)]


@pytest.fixture
def published(redis_server: RedisServer, index_ns: str) -> Iterator[tuple[RedisTier, redis.Redis]]:
    t = RedisTier(
        RedisEndpoint(url=redis_server.url), 1 << 24, index=IndexConfig(namespace=index_ns)
    )
    raw = redis.Redis.from_url(redis_server.url)
    yield t, raw
    raw.close()
    t.close()


@settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    n=SIZES,
    pattern=st.sampled_from(["none", "all", "every third", "drawn"]),
    per_bucket=st.booleans(),
    salt=st.integers(0, 1 << 30),
)
@example(n=2001, pattern="all", per_bucket=False, salt=1)  # three swaps of a thousand
@example(n=1001, pattern="every third", per_bucket=False, salt=2)
def test_publish_swaps_every_record_and_names_what_it_replaced(
    published: tuple[RedisTier, redis.Redis], n: int, pattern: str, per_bucket: bool, salt: int
) -> None:
    tier, raw = published
    idx = tier.index
    idx.refresh()
    lease = idx.lease()
    keys = _keys(n, salt)
    drawn = random.Random(salt)
    held = [
        pattern == "all"
        or (pattern == "every third" and i % 3 == 0)
        or (pattern == "drawn" and drawn.random() < 0.5)
        for i in range(n)
    ]
    old = {key: b"old-%d" % i for i, (key, h) in enumerate(zip(keys, held, strict=True)) if h}
    if old:
        raw.mset({idx.record_key(key): rec for key, rec in old.items()})
    new = {key: b"new-%d-%d" % (salt, i) for i, key in enumerate(keys)}
    replies: dict[bytes, bytes] = {}
    if per_bucket:
        by_tag: dict[str, list[bytes]] = {}
        for key in keys:
            by_tag.setdefault(idx.tag(key), []).append(key)
        for group in by_tag.values():
            got = idx.run_script(
                "PUBLISH_RECORDS",
                [idx.fence_key(group[0])] + [idx.record_key(key) for key in group],
                [lease.host, lease.token, *(new[key] for key in group)],
            )
            replies.update(zip(group, got, strict=True))
    else:
        fences = sorted({idx.fence_key(key) for key in keys})
        got = idx.run_script(
            "PUBLISH_RECORDS_ALL",
            fences + [idx.record_key(key) for key in keys],
            [lease.host, lease.token, len(fences), *(new[key] for key in keys)],
        )
        replies.update(zip(keys, got, strict=True))
    assert len(replies) == n
    assert all(replies[key] == old.get(key, b"") for key in keys)
    stored = raw.mget([idx.record_key(key) for key in keys])
    assert stored == [new[key] for key in keys]
    raw.delete(*(idx.record_key(key) for key in keys))


def test_a_key_named_twice_reads_as_two_swaps_in_order(
    published: tuple[RedisTier, redis.Redis],
) -> None:
    """The tiers never name a key twice in one publish (the last of each is kept), but
    the script answers as a GET and a SET per key would: the second record replaced
    the first, the last one stays; across the thousand-key boundary too."""
    tier, raw = published
    idx = tier.index
    idx.refresh()
    lease = idx.lease()
    keys = _keys(1200, 99)
    twice = keys[5]
    raw.set(idx.record_key(twice), b"OLD")
    names = [idx.record_key(key) for key in keys] + [idx.record_key(twice)] * 2
    records = [b"r%d" % i for i in range(len(names))]
    fences = sorted({idx.fence_key(key) for key in keys})
    got = idx.run_script(
        "PUBLISH_RECORDS_ALL", fences + names, [lease.host, lease.token, len(fences), *records]
    )
    assert got[5] == b"OLD" and got[-2] == records[5] and got[-1] == records[-2]
    assert got[:5] == [b""] * 5 and raw.get(idx.record_key(twice)) == records[-1]


def test_publish_under_a_lease_that_does_not_hold_writes_nothing(
    published: tuple[RedisTier, redis.Redis],
) -> None:
    tier, raw = published
    idx = tier.index
    idx.refresh()
    lease = idx.lease()
    keys = _keys(1500, 7)
    fences = sorted({idx.fence_key(key) for key in keys})
    with pytest.raises(redis.ResponseError, match="KVLLOST"):
        idx.run_script(
            "PUBLISH_RECORDS_ALL",
            fences + [idx.record_key(key) for key in keys],
            [lease.host, lease.token + 1, len(fences), *(b"r" for _ in keys)],
        )
    assert raw.exists(*(idx.record_key(key) for key in keys)) == 0


def test_writers_beyond_the_send_threads_all_publish_exact_bytes(
    published: tuple[RedisTier, redis.Redis],
) -> None:
    """Each write sends its payloads on one of the tier's sender threads while its own
    thread hashes them: three times as many writers as senders, at once, each publish
    and read back their own bytes."""
    tier, _ = published
    writers = 3 * SENDERS
    batches = {
        w: [
            np.random.default_rng(w * 10 + i).standard_normal(1 << 16).astype(np.float16)
            for i in range(6)
        ]
        for w in range(writers)
    }
    keys = {w: [ChunkKey(k) for k in _keys(6, 1000 + w)] for w in range(writers)}
    start = threading.Barrier(writers)
    failures: list[BaseException] = []

    def write(w: int) -> None:
        metas = [ReplicaMeta(key, "float16", (1 << 16,), "exact", b"i") for key in keys[w]]
        start.wait(10)
        try:
            assert tier.store(metas, batches[w])
        except BaseException as exc:  # reported below
            failures.append(exc)

    threads = [threading.Thread(target=write, args=(w,)) for w in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads) and not failures, failures
    for w in range(writers):
        got = tier.read_batch(keys[w])
        for g, a in zip(got, batches[w], strict=True):
            assert isinstance(g, np.ndarray) and np.array_equal(g, a)
