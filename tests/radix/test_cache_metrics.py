"""The Prometheus collector (``radix.metrics``) and the durations it exports
(``radix.durations``): every ``stats()`` key typed as a counter or a gauge with its value,
SGLang's names, histograms counting the calls made, bad prefixes and labels refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from allocators import MambaStatePool, SWAAllocator, TokenAllocator
from hicache import HiCacheConfig
from radix import CacheConfig, RadixCache
from radix.durations import BUCKETS
from radix.metrics import COUNTERS, GAUGES, CacheCollector
from tests.helpers.isolated import run_python

REPO = Path(__file__).resolve().parents[2]


def scrape(cache: RadixCache, **kw: Any) -> dict[str, Any]:
    """name -> (type, {labels tuple: value}) from the text exposition."""
    reg = CollectorRegistry(auto_describe=True)
    reg.register(CacheCollector(cache, **kw))
    out: dict[str, Any] = {}
    for fam in text_string_to_metric_families(generate_latest(reg).decode()):
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in fam.samples}
        out[fam.name] = (fam.type, samples)
    return out


def full_cache(tmp_path: Path) -> tuple[RadixCache, Any, Any]:
    kv = TokenAllocator(64)
    sp = MambaStatePool(4, num_layers=1, conv_state_shape=(1,), ssm_state_shape=(1,))
    hc = HiCacheConfig(load_back_threshold=1, hicache_storage_backend="file",
                       hicache_storage_dir=str(tmp_path), hicache_storage_model="metrics")
    cache = RadixCache(CacheConfig(enable_kv_cache_events=True), kv_allocator=kv,
                       state_allocator=sp, hicache=hc)
    return cache, kv, sp


def test_every_key_is_typed_and_carries_its_value(tmp_path: Path) -> None:
    cache, kv, sp = full_cache(tmp_path)
    try:
        cache.insert([1, 2, 3], kv.alloc(3), state_slot=int(sp.alloc(1)[0]))
        cache.match_prefix([1, 2, 3, 4])
        cache.poll_transfers()
        cache.evict(3)  # demoted: 3 tokens, their state
        st = cache.stats()
        # by hand: one match of 4 tokens hitting 3, 3 inserted and evicted, 1 state each
        assert (st["match_calls"], st["match_tokens"], st["hit_tokens"], st["inserted_tokens"],
                st["evicted_tokens"], st["evicted_states"], st["host_tokens"]) == (
                    1, 4, 3, 3, 3, 1, 3)
        got = scrape(cache, labels={"engine": "0"})
        lab = (("engine", "0"),)
        for key, value in st.items():
            if key == "policy":
                assert got["sglang:eviction_policy_info"][1][
                    ("sglang:eviction_policy_info", (("engine", "0"), ("policy", "lru")))] == 1
                continue
            if key in GAUGES:
                name = "sglang:" + GAUGES[key][0]
                assert got[name][0] == "gauge", key
                assert got[name][1][(name, lab)] == value, key
                continue
            # every other key is a counter: known, or an L3 count (none left to the fallback)
            assert key in COUNTERS or key.startswith("l3_"), f"{key} is not typed"
            base, extra, _ = COUNTERS.get(key, (key, {}, ""))
            name = "sglang:" + base
            assert got[name][0] == "counter", key
            labels = tuple(sorted({"engine": "0", **extra}.items()))
            assert got[name][1][(name + "_total", labels)] == value, key
        # SGLang's names where SGLang has one
        assert {"sglang:evicted_tokens", "sglang:load_back_tokens", "sglang:kv_evictable_tokens",
                "sglang:mamba_evictable_tokens", "sglang:hicache_host_used_tokens",
                "sglang:cached_tokens", "sglang:hicache_backup_tokens",
                "sglang:prefetched_tokens", "sglang:eviction_duration_seconds",
                "sglang:load_back_duration_seconds",
                "sglang:hicache_backup_duration_seconds"} <= set(got)
    finally:
        cache.close_storage()


def test_histograms_count_the_calls() -> None:
    kv = TokenAllocator(16)
    cache = RadixCache(CacheConfig(), kv_allocator=kv,
                       hicache=HiCacheConfig(load_back_threshold=1))
    cache.insert([1, 2, 3, 4], kv.alloc(4))  # write_through: one backup
    cache.insert([5, 6], kv.alloc(2))  # a second
    cache.poll_transfers()
    for _ in range(3):
        cache.evict(2)
    m = cache.match_prefix([1, 2, 3, 4])
    assert m.last_host_node is not None and cache.load_back(m.last_host_node) > 0
    h = cache.durations.histograms
    assert (h["eviction"].count, h["load_back"].count, h["backup"].count) == (3, 1, 2)
    got = scrape(cache, prefix="hpc:")
    typ, samples = got["hpc:eviction_duration_seconds"]
    assert typ == "histogram"
    assert samples[("hpc:eviction_duration_seconds_count", ())] == 3
    assert samples[("hpc:eviction_duration_seconds_bucket", (("le", "+Inf"),))] == 3
    assert samples[("hpc:eviction_duration_seconds_sum", ())] == pytest.approx(
        h["eviction"].total_s)
    buckets = [samples[("hpc:eviction_duration_seconds_bucket", (("le", repr(b)),))]
               for b in BUCKETS]
    assert buckets == sorted(buckets) and buckets[-1] <= 3
    assert got["hpc:load_back_duration_seconds"][1][
        ("hpc:load_back_duration_seconds_count", ())] == 1
    cache.reset()  # counters restart, histograms do not
    assert cache.durations.histograms["eviction"].count == 3


def test_a_histogram_files_each_observation_in_its_bucket() -> None:
    from radix.durations import Histogram
    h = Histogram()
    for s in (0.0, 1e-5, 3e-5, 0.3, 100.0):
        h.observe(s)
    cum = dict(h.cumulative())
    # le=1e-05 holds 0 and 1e-5 (upper bounds are inclusive), le=5e-05 adds 3e-5, ...
    assert (cum["1e-05"], cum["5e-05"], cum["0.25"], cum["0.5"], cum["5.0"], cum["+Inf"]) == (
        2, 3, 3, 4, 4, 5)
    assert h.count == 5 and h.total_s == pytest.approx(100.30004)


def test_sliding_window_keys() -> None:
    kv = SWAAllocator(16, 8)
    cache = RadixCache(CacheConfig(sliding_window_size=2), kv_allocator=kv)
    cache.insert([1, 2, 3], kv.alloc(3))
    got = scrape(cache)
    assert got["sglang:swa_evictable_tokens"][1][("sglang:swa_evictable_tokens", ())] == (
        cache.stats()["swa_evictable"]) > 0


@pytest.mark.parametrize(("kwargs", "exc", "names"), [
    (dict(prefix="9sglang:"), ValueError, "prefix"),
    (dict(prefix="sg-lang"), ValueError, "prefix"),
    (dict(prefix="sglang "), ValueError, "prefix"),
    (dict(prefix=3), TypeError, "prefix"),
    (dict(labels={"engine-id": "0"}), ValueError, "labels"),
    (dict(labels={"__name": "0"}), ValueError, "labels"),
    (dict(labels={"engine": 0}), TypeError, "labels"),
])
def test_bad_prefixes_and_labels_are_refused(kwargs: dict[str, Any], exc: type,
                                             names: str) -> None:
    kv = TokenAllocator(4)
    with pytest.raises(exc, match=names):
        CacheCollector(RadixCache(kv_allocator=kv), **kwargs)
    with pytest.raises(TypeError, match="cache"):
        CacheCollector(cast(Any, object()))


def test_an_empty_prefix_is_allowed() -> None:
    kv = TokenAllocator(4)
    got = scrape(RadixCache(kv_allocator=kv), prefix="")
    assert got["evicted_tokens"][0] == "counter"


def test_the_library_works_without_prometheus_client() -> None:
    code = """
import sys
sys.modules['prometheus_client'] = None
sys.modules['prometheus_client.core'] = None
from allocators import TokenAllocator
from radix import RadixCache
kv = TokenAllocator(4)
c = RadixCache(kv_allocator=kv)
c.insert([1], kv.alloc(1)); c.evict(1)
assert c.durations.histograms['eviction'].count == 1
try:
    import radix.metrics
except ImportError as e:
    print('refused:', e)
"""
    assert "refused: radix.metrics needs prometheus-client" in run_python(code)



def test_the_event_publishers_counts_are_exported() -> None:
    from components.event_publisher import ZmqEventPublisher
    kv = TokenAllocator(8)
    cache = RadixCache(CacheConfig(enable_kv_cache_events=True), kv_allocator=kv)
    pub = ZmqEventPublisher({"publisher": "zmq", "endpoint": "inproc://hpc-metrics"})
    try:
        cache.insert([1, 2], kv.alloc(2))
        pub.publish(cache.take_events())
        pub.publish(cast(Any, [object()]))  # dropped
        pub.close()
        got = scrape(cache, sources=[pub])
        assert got["sglang:kv_events_dropped_batches"] == (
            "counter", {("sglang:kv_events_dropped_batches_total", ()): 1.0})
        assert got["sglang:kv_events_published_batches"][1][
            ("sglang:kv_events_published_batches_total", ())] == 1.0
        assert got["sglang:kv_events_next_seq"][0] == "gauge"
    finally:
        pub.close()
    with pytest.raises(TypeError, match="sources"):
        CacheCollector(cache, sources=[object()])
