"""A Prometheus collector over ``RadixCache.stats()`` and ``RadixCache.durations`` (needs
``prometheus-client``: the ``metrics`` extra).

Each scrape reads ``stats()`` once and exports every numeric key, typed:

* counters (``_total``): the monotonic counts (match calls and tokens, hits, evictions,
  insertions, backups, demotions, load-backs, KV events, every L3 count);
* gauges: the sizes (evictable / protected per component, host tokens, L3 stored pages and
  bytes, queued events, nodes) and the watermark;
* ``policy`` as an info gauge (value 1, label ``policy``);
* histograms (seconds): eviction passes, load-backs and backups (``radix.durations``).

Names are SGLang's where SGLang exports the same quantity (``evicted_tokens_total``,
``load_back_tokens_total``, ``hicache_backup_tokens_total``, ``prefetched_tokens_total``,
``kv_evictable_tokens``, ``mamba_evictable_tokens``, ``swa_evictable_tokens``,
``hicache_host_used_tokens``, ``cached_tokens_total{source="device"|"host"}``,
``eviction_duration_seconds``, ``load_back_duration_seconds``,
``hicache_backup_duration_seconds``), else the ``stats()`` key; all behind ``prefix``
(``"sglang:"`` by default, as SGLang's). A key this module does not know is exported as a
gauge. A counter restarts at 0 after ``RadixCache.reset`` (Prometheus treats the drop as a
counter reset); the histograms do not.

Usage::

    from prometheus_client import REGISTRY
    REGISTRY.register(CacheCollector(cache, labels={"engine": "0"}))
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

try:
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
        Metric,
    )
except ImportError as _e:  # the optional dependency: a clear error, only when used
    raise ImportError(
        "radix.metrics needs prometheus-client (pip install 'hybrid-prefix-cache[metrics]')"
    ) from _e

if TYPE_CHECKING:
    from radix.cache import RadixCache

__all__ = ["COUNTERS", "GAUGES", "CacheCollector"]

_CACHED = ("Prefix tokens matched, by source (device: the usable hit on device; host: "
           "continued on the host tier)")
#: stats() key -> (exported name without prefix and ``_total``, extra labels, help).
COUNTERS: dict[str, tuple[str, dict[str, str], str]] = {
    "match_calls": ("match_calls", {}, "match_prefix calls"),
    "match_tokens": ("match_tokens", {}, "Tokens asked for by match_prefix"),
    "hit_tokens": ("cached_tokens", {"source": "device"}, _CACHED),
    "host_hit_tokens": ("cached_tokens", {"source": "host"}, _CACHED),
    "kv_hit_tokens": ("kv_hit_tokens", {}, "KV tokens matched (before the state / SWA rules)"),
    "evicted_tokens": ("evicted_tokens", {}, "Device KV token slots freed by eviction"),
    "evicted_states": ("evicted_states", {}, "Recurrent states freed by eviction"),
    "evicted_swa_tokens": ("evicted_swa_tokens", {}, "Sliding-window KV tokens freed"),
    "revived_swa_tokens": ("revived_swa_tokens", {}, "Sliding-window tokens revived"),
    "inserted_tokens": ("inserted_tokens", {}, "KV tokens inserted"),
    "inserted_states": ("inserted_states", {}, "Recurrent states inserted"),
    "backup_tokens": ("hicache_backup_tokens", {}, "Tokens backed up from device to host"),
    "demoted_tokens": ("demoted_tokens", {}, "Device tokens demoted to host-only"),
    "host_evicted_tokens": ("hicache_host_evicted_tokens", {}, "Host tokens evicted"),
    "load_back_tokens": ("load_back_tokens", {}, "Tokens loaded back from host to device"),
    "load_back_states": ("load_back_states", {}, "States loaded back from host to device"),
    "copy_failures": ("hicache_copy_failures", {},
                      "Host-tier copies that could not start (skipped, units given back)"),
    "kv_events_emitted": ("kv_events_emitted", {}, "KV events recorded"),
    "kv_events_dropped": ("kv_events_dropped", {}, "KV events dropped from a full queue"),
    "l3_prefetch_tokens": ("prefetched_tokens", {}, "Tokens prefetched from L3 storage"),
    # components.event_publisher.ZmqEventPublisher.stats() (a ``sources`` entry)
    "kv_events_published_batches": ("kv_events_published_batches", {}, "Event batches sent"),
    "kv_events_dropped_batches": ("kv_events_dropped_batches", {},
                                  "Event batches dropped (unencodable, queue full, closed)"),
    "kv_events_dropped_events": ("kv_events_dropped_events", {}, "Events in dropped batches"),
    "kv_events_send_failures": ("kv_events_send_failures", {},
                                "Event batches the socket failed to send (kept for replay)"),
    "kv_events_replays": ("kv_events_replays", {}, "Replay requests served"),
}
#: stats() key -> (exported name without prefix, help).
GAUGES: dict[str, tuple[str, str]] = {
    "kv_evictable": ("kv_evictable_tokens", "Evictable KV token slots on device"),
    "kv_protected": ("kv_protected_tokens", "Locked KV token slots on device"),
    "state_evictable": ("mamba_evictable_tokens", "Evictable recurrent-state slots"),
    "state_protected": ("mamba_protected_tokens", "Locked recurrent-state slots"),
    "swa_evictable": ("swa_evictable_tokens", "Evictable sliding-window token slots"),
    "swa_protected": ("swa_protected_tokens", "Locked sliding-window token slots"),
    "host_tokens": ("hicache_host_used_tokens", "KV tokens held on the host tier"),
    "watermark": ("watermark", "The eviction walk's watermark (GreedyDual-Size's L)"),
    "kv_events_pending": ("kv_events_pending", "KV events queued, not yet taken"),
    "num_nodes": ("num_nodes", "Radix tree nodes"),
    "l3_backend_stored_bytes": ("l3_backend_stored_bytes", "Bytes stored in L3"),
    "l3_backend_stored_pages": ("l3_backend_stored_pages", "Pages stored in L3"),
    "kv_events_queued_batches": ("kv_events_queued_batches", "Event batches waiting to be sent"),
    "kv_events_next_seq": ("kv_events_next_seq", "The next event batch's sequence number"),
}
#: Every other ``l3_*`` count is a counter under its own name.
_L3_COUNTER = re.compile(r"l3_[a-z0-9_]+")
_DURATIONS = {"eviction": ("eviction_duration_seconds", "Wall time of a device eviction pass"),
              "load_back": ("load_back_duration_seconds", "Wall time of a host-to-device load-back"),
              "backup": ("hicache_backup_duration_seconds", "Wall time of a device-to-host backup")}
_PREFIX = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


class CacheCollector:
    """A ``prometheus_client`` collector of one cache (see the module docstring).

    Args:
        cache: the :class:`radix.RadixCache` to read at each scrape.
        prefix: prepended to every name (``"sglang:"``; ``""`` for none): letters, digits,
            ``_`` and ``:``, not starting with a digit.
        labels: constant labels on every sample (e.g. ``{"engine": "0"}``).
        sources: more objects whose ``stats()`` (a flat dict of numbers) is exported the same
            way at each scrape, e.g. the KV event publisher
            (``components.event_publisher.ZmqEventPublisher``: batches sent, dropped, failed).

    Raises:
        TypeError / ValueError: a bad ``prefix`` or ``labels``, naming it.
    """

    def __init__(self, cache: RadixCache, prefix: str = "sglang:",
                 labels: Mapping[str, str] | None = None, sources: Sequence[Any] = ()) -> None:
        if not callable(getattr(cache, "stats", None)):
            raise TypeError(f"cache must be a RadixCache, got {type(cache).__name__}")
        for i, src in enumerate(sources):
            if not callable(getattr(src, "stats", None)):
                raise TypeError(f"sources[{i}] must have a stats() method, "
                                f"got {type(src).__name__}")
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a str, got {type(prefix).__name__}")
        if prefix and not _PREFIX.fullmatch(prefix):
            raise ValueError(f"prefix must match [a-zA-Z_:][a-zA-Z0-9_:]* (a Prometheus metric "
                             f"name prefix), got {prefix!r}")
        labels = dict(labels or {})
        for k, v in labels.items():
            if not isinstance(k, str) or not _LABEL.fullmatch(k) or k.startswith("__"):
                raise ValueError(f"labels keys must be Prometheus label names, got {k!r}")
            if not isinstance(v, str):
                raise TypeError(f"labels values must be str, got {v!r} for {k!r}")
        self.cache = cache
        self.prefix = prefix
        self.labels = labels
        self.sources = tuple(sources)

    def collect(self) -> Iterator[Metric]:
        """The metric families of one scrape."""
        st = self.cache.stats()
        for src in self.sources:
            st.update(src.stats())
        p, names, values = self.prefix, list(self.labels), list(self.labels.values())
        counters: dict[str, CounterMetricFamily] = {}
        for key, value in st.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if key in COUNTERS or (key not in GAUGES and _L3_COUNTER.fullmatch(key)):
                name, extra, doc = COUNTERS.get(key, (key, {}, f"L3: {key[3:]}"))
                fam = counters.get(name)
                if fam is None:
                    fam = counters[name] = CounterMetricFamily(
                        p + name, doc, labels=names + list(extra))
                fam.add_metric(values + list(extra.values()), float(value))
                continue
            gname, gdoc = GAUGES.get(key, (key, f"stats()[{key!r}]"))
            g = GaugeMetricFamily(p + gname, gdoc, labels=names)
            g.add_metric(values, float(value))
            yield g
        yield from counters.values()
        policy = st.get("policy")
        if isinstance(policy, str):
            info = GaugeMetricFamily(p + "eviction_policy_info", "The eviction policy",
                                     labels=[*names, "policy"])
            info.add_metric([*values, policy], 1.0)
            yield info
        for kind, h in self.cache.durations.histograms.items():
            hname, hdoc = _DURATIONS[kind]
            fam_h = HistogramMetricFamily(p + hname, hdoc, labels=names)
            fam_h.add_metric(values, [(b, float(n)) for b, n in h.cumulative()], h.total_s)
            yield fam_h
