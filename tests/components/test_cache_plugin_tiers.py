"""A plug-in component on every tier, with no library edit: device, host (L2) and L3.

``Summary`` (below) is written against ``components.base.Component`` only: a per-node summary
vector (``DIM`` float32, say a cross-attention summary valid at a node's end) in its own torch
pool, one slot per node that has one, kept in the node's extension slot (``node.ext``). It
implements

* a per-insert value (``check_value``; the caller passes it as
  ``insert(..., component_values={"summary": vector})``) and its part of a match
  (``match_part``: ``MatchResult.parts["summary"]``);
* its own eviction walk and units (``evict_field = "num_summaries"``: ``evict_component`` and
  ``EvictResult.other`` / ``units``);
* the host tier's hooks (``components.base.TIER_HOOKS``: a host mirror of its pool, backed up,
  dropped on demotion, restored on load-back);
* an L3 end section (``components.base.L3_END_HOOKS``): its vector is stored in the record at
  the end of a node's last page, and a second cache reads it back from there.

Every expected value is the vector the test wrote, compared bit for bit.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from allocators import KVPool, MambaStatePool, TokenAllocator
from components.base import Component, InsertPlan
from hicache import HiCacheConfig
from hicache.host_pools import Lane
from hicache.storage import layout_tag
from radix import CacheConfig, RadixCache
from tests.helpers.cache_helpers import bits, random_bits
from tests.helpers.slot_tier_hooks import OneSlotTierHooks

DIM = 4
FIELD = "num_summaries"


class Summary(OneSlotTierHooks, Component):
    """A summary vector per node, valid at the node's end (see the module docstring)."""

    name = "summary"
    evict_field = FIELD

    def __init__(self, size: int) -> None:
        self.allocator = TokenAllocator(size)  # slots 1..size index ``table``
        self.restore_allocator = self.allocator
        self.table = torch.zeros(size + 1, DIM)
        self.order: dict[Any, None] = {}  # nodes with a device vector, oldest first
        self.host_table = torch.zeros(0, DIM)

    # ---------------------------------------------------------- device
    def check_value(self, n: int, value: Any) -> None:
        if not isinstance(value, torch.Tensor) or value.dtype != torch.float32 or (
                value.shape != (DIM,)):
            raise ValueError(f"component_values['summary'] must be a float32 tensor of shape "
                             f"({DIM},), got {value!r}")

    def on_insert(self, plan: InsertPlan, last: Any, now: int) -> bool:
        value = plan.value_of(self.name)
        if value is None or last.parent is None or plan.insert_end != plan.end:
            return False
        ext = self._ext(last)
        if "dev" not in ext:
            got = self.allocator.alloc(1)
            if got is None:
                return False
            ext["dev"] = int(got[0])
        self.table[ext["dev"]] = value
        self.order[last] = None
        return False

    def match_part(self, node: Any) -> torch.Tensor | None:
        slot = None if node.ext is None else node.ext.get("dev")
        return None if slot is None else self.table[slot].clone()

    def _free_dev(self, node: Any) -> int:
        slot = self._ext(node).pop("dev", None)
        self.order.pop(node, None)
        if slot is None:
            return 0
        self.allocator.free(torch.tensor([slot]))
        return 1

    def on_remove(self, node: Any) -> int:
        return self._free_dev(node)

    def on_detach(self, node: Any) -> None:
        self.order.pop(node, None)

    def pop_victim(self) -> Any:
        for node in self.order:
            if node.lock_ref == 0:
                del self.order[node]
                return node
        return None

    def evict_internal(self, node: Any) -> int:
        return self._free_dev(node)

    # ------------------------------------------------------------ host
    def host_pool(self, config: Any) -> tuple[Any, Any, Any]:
        size = 2 * self.allocator.size
        host = TokenAllocator(size)
        store = torch.zeros(size + 1, 1, DIM)  # [host slots, layers, DIM]
        self.host_table = store[:, 0]
        lane = Lane("summary", (self.table,), self.table.unsqueeze(0), store, slot_first=True)
        return self.allocator, host, (lane,)

    def restore(self, node: Any, device: torch.Tensor, now: int) -> torch.Tensor:
        self.order[node] = None
        return super().restore(node, device, now)

    # -------------------------------------------------------------- L3
    def l3_layout(self) -> str:
        return f"summary={DIM}:float32"

    def l3_sections(self) -> tuple[int, ...]:
        return (DIM * 4,)

    def pack_end(self, node: Any) -> list[bytes]:
        return [self.host_table[self._ext(node)["host"]].numpy().tobytes()]

    def unpack_end(self, nodes: Any, host: torch.Tensor, sections: Any) -> None:
        node = nodes[-1]  # its value is valid at the chain's end
        slot = int(host[0])
        self.host_table[slot] = torch.frombuffer(bytearray(sections[0]), dtype=torch.float32)
        self._ext(node)["host"] = slot


# ====================================================================== helpers
K = list(range(100, 116))
GEN = torch.Generator().manual_seed(37)


def vector() -> torch.Tensor:
    return random_bits((DIM,), torch.float32, GEN)


def kv_cache(summary: Summary, *, page_size: int = 1, hicache: HiCacheConfig | None = None,
             size: int = 32, states: int = 0) -> tuple[RadixCache, Any]:
    pool = KVPool(size, 2, 1, 2, torch.float32, "cpu", page_size=page_size)
    from allocators import PagedAllocator

    kv = TokenAllocator(size, pool=pool) if page_size == 1 else PagedAllocator(
        size, page_size, pool=pool)
    sp = (MambaStatePool(states, num_layers=2, conv_state_shape=(3,), ssm_state_shape=(2, 2))
          if states else None)
    cache = RadixCache(CacheConfig(page_size=page_size), kv_allocator=kv, state_allocator=sp,
                       components=[summary], hicache=hicache)
    return cache, kv


def put(cache: RadixCache, kv: Any, key: list[int], value: torch.Tensor | None
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Insert ``key`` with random KV bits (and ``value`` as its summary), freeing the
    duplicates of what was cached; returns (K, V)."""
    pool = kv.pool
    slots = kv.alloc(len(key))
    assert slots is not None
    shape = (pool.num_layers, len(key), pool.num_heads, pool.head_dim)
    k, v = random_bits(shape, torch.float32, GEN), random_bits(shape, torch.float32, GEN)
    pool.k_all[:, slots] = k
    pool.v_all[:, slots] = v
    values = None if value is None else {"summary": value}
    res = cache.insert(key, slots, component_values=values)
    kv.free(res.duplicate_indices)
    cache.sanity_check()
    return k, v


def part(m: Any) -> torch.Tensor:
    """The summary part of a match (it must have one)."""
    assert m.parts is not None and m.parts["summary"] is not None
    return m.parts["summary"]


def check_served(cache: RadixCache, kv: Any, m: Any, value: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> None:
    """``m`` serves the summary ``value`` and the K / V ``k`` / ``v`` (bit-exactly), and the
    cache's invariants hold."""
    assert torch.equal(bits(part(m)), bits(value))
    assert torch.equal(bits(kv.pool.k_all[:, m.device_indices]), bits(k))
    assert torch.equal(bits(kv.pool.v_all[:, m.device_indices]), bits(v))
    cache.sanity_check()


# ======================================================================= device
def test_a_per_insert_value_lands_at_the_key_end_and_is_the_match_part() -> None:
    s = Summary(4)
    cache, kv = kv_cache(s)
    v8 = vector()
    put(cache, kv, K[:8], v8)
    assert torch.equal(bits(part(cache.match_prefix(K[:8]))), bits(v8))
    m4 = cache.match_prefix(K[:4])  # splits the node: the vector stays at its end (8)
    assert m4.parts == {"summary": None} and m4.prefix_len == 4
    assert torch.equal(bits(part(cache.match_prefix(K[:8]))), bits(v8))
    assert s.allocator.available_size() == 3
    cache.sanity_check()


def test_a_cache_without_a_part_reports_none_and_positional_results_stay_valid() -> None:
    cache = RadixCache(kv_allocator=TokenAllocator(8))
    m = cache.match_prefix([1, 2])
    assert m.parts is None and len(m) == 12
    from radix import MatchResult

    old = MatchResult(m.device_indices, 0, 0, m.last_device_node, None, None, None, 0, 0)
    assert old.parts is None


@pytest.mark.parametrize("values", [{"nope": 1}, {"summary": torch.zeros(3)}, [("summary", 1)],
                                    {"state": 1}])
def test_bad_component_values_are_refused_and_change_nothing(values: Any) -> None:
    s = Summary(4)
    cache, kv = kv_cache(s)
    slots = kv.alloc(4)
    with pytest.raises((TypeError, ValueError), match="component_values"):
        cache.insert(K[:4], slots, component_values=values)
    assert cache.tree.num_nodes == 0 and kv.available_size() == 28
    assert s.allocator.available_size() == 4
    cache.sanity_check()


def test_the_plug_in_evicts_its_own_units_and_every_eviction_counts_them() -> None:
    s = Summary(4)
    cache, kv = kv_cache(s)
    put(cache, kv, K[:4], vector())
    put(cache, kv, K[:4] + [1, 2, 3, 4], vector())  # the first node is internal now
    res = cache.evict_component("summary", 1)  # the oldest: internal, keeps its KV
    assert (res.num_tokens, res.other, res.units(FIELD)) == (0, ((FIELD, 1),), 1)
    assert cache.match_prefix(K[:4]).parts == {"summary": None}
    assert cache.total_size() == 8
    res = cache.evict(8)  # the leaf leaves whole, its vector with it; then the dead parent
    assert res.num_tokens == 8 and res.units(FIELD) == 1 and res.units("num_states") == 0
    assert s.allocator.available_size() == 4
    with pytest.raises(KeyError, match="no eviction field 'num_x'.*num_summaries"):
        res.units("num_x")
    assert RadixCache(kv_allocator=TokenAllocator(4)).evict(1).other == ()
    cache.sanity_check()


# ========================================================================= host
def test_the_plug_in_is_backed_up_demoted_and_loaded_back_bit_exactly() -> None:
    s = Summary(4)
    cache, kv = kv_cache(s, hicache=HiCacheConfig(hicache_ratio=2.0, load_back_threshold=1,
                                                  hicache_write_policy="write_back"))
    v8 = vector()
    k, v = put(cache, kv, K[:8], v8)
    node = cache.match_prefix(K[:8]).last_device_node
    res = cache.evict(8)  # write_back: backed up, then demoted
    assert res.num_tokens == 8 and res.units(FIELD) == 1
    assert "dev" not in node.ext and torch.equal(bits(s.host_table[node.ext["host"]]), bits(v8))
    s.table.zero_()  # no device row holds the vector now: a load-back must bring it
    taken = s.allocator.alloc(1)  # the load lands in another free slot
    assert taken is not None
    m = cache.match_prefix(K[:8])
    assert (m.host_hit_length, m.last_host_node, m.parts) == (8, node, {"summary": None})
    assert cache.load_back(node) == 8
    m = cache.match_prefix(K[:8])
    assert m.prefix_len == 8 and node.ext["dev"] != int(taken[0])
    check_served(cache, kv, m, v8, k, v)


# =========================================================================== L3
def l3_config(where: dict[str, Any], model: str) -> HiCacheConfig:
    return HiCacheConfig(hicache_ratio=2.0, load_back_threshold=1,
                         hicache_write_policy="write_through",
                         hicache_storage_prefetch_policy="wait_complete",
                         hicache_storage_model=model, **where)


def test_the_plug_in_is_served_from_l3_bit_exactly(l3_store: dict[str, Any]) -> None:
    model = f"plugin-{os.getpid()}-{torch.randint(1 << 30, ()).item()}"
    sa, sb = Summary(4), Summary(4)
    a, kv_a = kv_cache(sa, page_size=2, hicache=l3_config(l3_store, model))
    b, kv_b = kv_cache(sb, page_size=2, hicache=l3_config(l3_store, model))
    try:
        assert a.storage is not None and a.storage.tag.endswith(f";summary={DIM}:float32")
        assert a.storage.end_record_bytes == (DIM * 4, 0)
        v8 = vector()
        k, v = put(a, kv_a, K[:8], v8)  # write_through: host, then L3 (pages + end record)
        put(a, kv_a, K[8:14], None)  # no summary at its end: its pages only, no end record
        assert a.flush_storage(10)
        assert a.stats()["l3_backup_written"] == 4 + 1 + 3
        m = b.match_prefix(K[:14])  # prefetch: up to the deepest page with an end record
        assert (m.prefix_len, m.host_hit_length) == (0, 8)
        st = b.stats()
        assert (st["l3_prefetch_pages"], st["l3_prefetch_states"]) == (4, 1)
        node = m.last_host_node
        assert node is not None and torch.equal(bits(sb.host_table[node.ext["host"]]), bits(v8))
        assert b.load_back(node) == 8
        m = b.match_prefix(K[:8])
        assert m.prefix_len == 8
        check_served(b, kv_b, m, v8, k, v)
    finally:
        a.close_storage()
        b.close_storage()


def test_a_plug_in_failing_to_unpack_its_end_section_is_a_miss_that_changes_nothing(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    where = {"hicache_storage_backend": "file", "hicache_storage_dir": str(tmp_path)}
    sa, sb = Summary(4), Summary(4)
    a, kv_a = kv_cache(sa, page_size=2, hicache=l3_config(where, "m"))
    b, _ = kv_cache(sb, page_size=2, hicache=l3_config(where, "m"))
    v8 = vector()
    put(a, kv_a, K[:8], v8)
    assert a.flush_storage(10)
    hb = b.hicache
    assert hb is not None

    def boom(*args: Any) -> None:
        raise RuntimeError("plug-in bug")

    monkeypatch.setattr(sb, "unpack_end", boom)
    m = b.match_prefix(K[:8])  # the pages landed in host slots, the end section failed
    assert m.host_hit_length == 0 and b.stats()["l3_faults"] == 1
    assert b.tree.num_nodes == 0 and hb.host_kv.available_size() == hb.host_kv.size
    assert sb.host_allocator.available_size() == sb.host_allocator.size
    b.sanity_check()
    monkeypatch.undo()
    m = b.match_prefix(K[:8])  # a later match reads it again
    assert m.host_hit_length == 8 and m.last_host_node is not None
    assert torch.equal(bits(sb.host_table[m.last_host_node.ext["host"]]), bits(v8))
    b.sanity_check()
    a.close_storage()
    b.close_storage()


def test_kv_state_records_and_tag_keep_their_format(tmp_path: Any) -> None:
    """KV + state: the tag is ``layout_tag``'s and the end record ``(conv, ssm)``, as before
    the end sections were generalized (so records written then stay readable); a plug-in's
    end section adds a tag part and follows the state's in the record's second section."""
    where = {"hicache_storage_backend": "file", "hicache_storage_dir": str(tmp_path)}
    conv, ssm = 2 * 3 * 4, 2 * 2 * 2 * 4  # layers x shape x float32
    pool = KVPool(16, 2, 1, 2, torch.float32, "cpu", page_size=2)
    from allocators import PagedAllocator

    plain = RadixCache(CacheConfig(page_size=2), kv_allocator=PagedAllocator(16, 2, pool=pool),
                       state_allocator=MambaStatePool(4, num_layers=2, conv_state_shape=(3,),
                                                      ssm_state_shape=(2, 2)),
                       hicache=l3_config(where, "m"))
    with_plugin, _ = kv_cache(Summary(4), page_size=2, states=4, hicache=l3_config(where, "m"))
    for cache, tail, end in ((plain, "", (conv, ssm)),
                             (with_plugin, f";summary={DIM}:float32", (conv, ssm + DIM * 4))):
        hc, st = cache.hicache, cache.storage
        assert hc is not None and st is not None and hc.host_state is not None
        assert st.tag == layout_tag("m", 2, hc.host_kv.pool, hc.host_state) + tail
        assert st.end_record_bytes == end
        cache.close_storage()


def test_state_and_plug_in_end_sections_share_one_record_bit_exactly(
        l3_store: dict[str, Any]) -> None:
    """A hybrid cache with the plug-in: the record at a page end holds the state's conv and
    ssm and the plug-in's vector; a second cache reads all three back."""
    model = f"plugin-state-{os.getpid()}-{torch.randint(1 << 30, ()).item()}"
    sa, sb = Summary(4), Summary(4)
    a, kv_a = kv_cache(sa, page_size=2, states=4, hicache=l3_config(l3_store, model))
    b, kv_b = kv_cache(sb, page_size=2, states=4, hicache=l3_config(l3_store, model))
    try:
        ha, hb = a.hicache, b.hicache
        assert ha is not None and hb is not None
        spa, spb = ha.pools["state"].device, hb.pools["state"].device
        slots = kv_a.alloc(8)
        shape = (2, 8, 1, 2)
        k, v = random_bits(shape, torch.float32, GEN), random_bits(shape, torch.float32, GEN)
        kv_a.pool.k_all[:, slots] = k
        kv_a.pool.v_all[:, slots] = v
        got = spa.alloc(1)
        assert got is not None
        state = int(got[0])
        conv = random_bits(tuple(spa.conv[:, state].shape), spa.dtype, GEN)
        ssm = random_bits(tuple(spa.ssm[:, state].shape), spa.dtype, GEN)
        spa.conv[:, state] = conv
        spa.ssm[:, state] = ssm
        v8 = vector()
        res = a.insert(K[:8], slots, state_slot=state, component_values={"summary": v8})
        assert res.state_adopted
        assert a.flush_storage(10) and a.stats()["l3_backup_written"] == 4 + 1
        m = b.match_prefix(K[:8])
        assert (m.prefix_len, m.host_hit_length) == (0, 8) and m.last_host_node is not None
        assert b.load_back(m.last_host_node) == 8
        m = b.match_prefix(K[:8])
        assert m.prefix_len == 8 and m.state_slot is not None
        assert torch.equal(bits(spb.conv[:, m.state_slot]), bits(conv))
        assert torch.equal(bits(spb.ssm[:, m.state_slot]), bits(ssm))
        check_served(b, kv_b, m, v8, k, v)
    finally:
        a.close_storage()
        b.close_storage()


class NoUnpack(Summary):
    name = "summary"

    unpack_end = Component.unpack_end  # packs its end section but cannot read it back


def test_a_plug_in_with_partial_l3_hooks_is_refused_naming_it(tmp_path: Any) -> None:
    with pytest.raises(ValueError, match=r"component 'summary' keeps host copies .*'unpack_end'"):
        kv_cache(NoUnpack(4), hicache=l3_config(
            {"hicache_storage_backend": "file", "hicache_storage_dir": str(tmp_path)}, "m"))
