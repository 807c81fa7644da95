"""Device -> host -> device round trips are bit-exact (KV and recurrent state).

Random bit patterns (NaN payloads, infinities, subnormals, -0.0 included) are written into the
device slots, backed up, evicted from device, loaded back into *different* slots, and every
byte is compared: the reloaded device slots, and the host copies themselves.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.cache_helpers import bits, free_slots, node_slots, random_bits
from tests.hicache.test_hicache_common import HC, ids, make, node_at

KEY_A = list(range(1, 9))  # 8 tokens
KEY_B = [1, 2, 3, 4, 20, 21, 22, 23]  # shares 4 tokens with A


def fill_kv(h: HC, slots: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random bits into the device K and V of ``slots`` (every layer); return copies."""
    pool = h.kv.pool
    shape = (pool.num_layers, len(slots), pool.num_heads, pool.head_dim)
    k, v = random_bits(shape, pool.dtype, gen), random_bits(shape, pool.dtype, gen)
    pool.k_all[:, slots] = k
    pool.v_all[:, slots] = v
    return k.clone(), v.clone()


def assert_kv_bits(pool, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    assert torch.equal(bits(pool.k_all[:, slots]), bits(k))
    assert torch.equal(bits(pool.v_all[:, slots]), bits(v))


def insert_random(h: HC, key: list[int], gen: torch.Generator, prefix: torch.Tensor | None = None):
    """Insert ``key`` whose new tokens get fresh slots holding random KV; return (slots of the
    new tokens, their K, their V)."""
    prefix = prefix if prefix is not None else torch.empty(0, dtype=torch.int64)
    fresh = h.kv.alloc(len(key) - len(prefix))
    assert fresh is not None
    k, v = fill_kv(h, fresh, gen)
    slot = h.state() if h.sp is not None else None
    res = h.cache.insert(key, torch.cat([prefix, fresh]), state_slot=slot)
    assert ids(res.adopted_indices) == ids(fresh) and len(res.duplicate_indices) == 0
    h.cache.sanity_check()
    return fresh, k, v


@pytest.mark.parametrize(
    "page_size,dtype,policy",
    [
        (1, torch.float32, "write_through"),
        (4, torch.float32, "write_through"),
        (1, torch.float32, "write_back"),
        (4, torch.float32, "write_back"),
        (4, torch.bfloat16, "write_through"),
    ],
)
def test_kv_round_trip_is_bit_exact_into_different_slots(page_size: int, dtype: torch.dtype,
                                                         policy: str) -> None:
    gen = torch.Generator().manual_seed(1234 + page_size)
    h = make(page_size=page_size, size=24, policy=policy, layers=3, heads=2, head_dim=4, dtype=dtype)
    c = h.cache
    first = page_size  # slot ids start after the padding page
    slots_a, ka, va = insert_random(h, KEY_A, gen)
    assert ids(slots_a) == list(range(first, first + 8))
    m = c.match_prefix(KEY_B)
    assert m.prefix_len == 4
    slots_b, kb, vb = insert_random(h, KEY_B, gen, prefix=m.device_indices)
    assert ids(slots_b) == list(range(first + 8, first + 12))
    up, a_low, b_low = node_at(c, KEY_A[:4]), node_at(c, KEY_A), node_at(c, KEY_B)

    if policy == "write_through":  # backed up at insert: U and A's tail first, then B's tail
        assert ids(up.host_value) == list(range(first, first + 4))
        assert ids(a_low.host_value) == list(range(first + 4, first + 8))
        assert ids(b_low.host_value) == list(range(first + 8, first + 12))
    else:
        assert up.host_value is None and a_low.host_value is None and b_low.host_value is None

    assert c.evict(12).num_tokens == 12
    c.sanity_check()
    assert (up.kv_value, a_low.kv_value, b_low.kv_value) == (None, None, None)
    assert c.host_size() == 12 and c.stats()["demoted_tokens"] == 12
    # The host copies hold every byte.
    host_pool = h.host_kv.pool
    assert_kv_bits(host_pool, a_low.host_value, ka[:, 4:], va[:, 4:])
    assert_kv_bits(host_pool, up.host_value, ka[:, :4], va[:, :4])
    assert_kv_bits(host_pool, b_low.host_value, kb, vb)

    # Garbage over the whole device pool: what comes back can only come from the host.
    h.kv.pool.k_all.fill_(7.0)
    h.kv.pool.v_all.fill_(-7.0)
    free_before = free_slots(h.kv)
    m = c.match_prefix(KEY_B)
    assert (m.prefix_len, m.host_hit_length, m.last_host_node) == (0, 8, b_low)
    assert c.load_back(m.last_host_node) == 8
    c.sanity_check()
    new_up, new_b = ids(node_slots(up)), ids(node_slots(b_low))
    assert new_up + new_b == free_before[:8]  # the first free slots, not the old ones
    assert set(new_up + new_b).isdisjoint(ids(slots_a)[:4] + ids(slots_b))
    assert_kv_bits(h.kv.pool, node_slots(up), ka[:, :4], va[:, :4])
    assert_kv_bits(h.kv.pool, node_slots(b_low), kb, vb)

    assert c.load_back(a_low) == 4  # the rest of A: one node, below the reloaded U
    assert ids(node_slots(a_low)) == free_before[8:12]
    assert_kv_bits(h.kv.pool, node_slots(a_low), ka[:, 4:], va[:, 4:])
    m = c.match_prefix(KEY_A)
    assert (m.prefix_len, m.host_hit_length) == (8, 0)
    assert ids(m.device_indices) == free_before[:4] + free_before[8:12]
    assert c.stats()["load_back_tokens"] == 12 and h.hc.load_tokens == 12
    c.sanity_check()


def fill_state(h: HC, slot: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    sp = h.sp
    assert sp is not None
    conv = random_bits(tuple(sp.conv[:, slot].shape), sp.dtype, gen)
    ssm = random_bits(tuple(sp.ssm[:, slot].shape), sp.dtype, gen)
    sp.conv[:, slot] = conv
    sp.ssm[:, slot] = ssm
    return conv.clone(), ssm.clone()


def assert_state_bits(pool, slot: int, conv: torch.Tensor, ssm: torch.Tensor) -> None:
    assert torch.equal(bits(pool.conv[:, slot]), bits(conv))
    assert torch.equal(bits(pool.ssm[:, slot]), bits(ssm))


@pytest.mark.parametrize("page_size", [1, 4])
def test_state_round_trip_is_bit_exact_with_its_kv(page_size: int) -> None:
    gen = torch.Generator().manual_seed(99 + page_size)
    h = make(page_size=page_size, size=16, states=3, layers=3)
    c = h.cache
    sp, hs = h.sp, h.host_state
    assert sp is not None and hs is not None
    kv_slots = h.kv.alloc(8)
    k, v = fill_kv(h, kv_slots, gen)
    s8 = h.state()
    conv8, ssm8 = fill_state(h, s8, gen)
    res = c.insert(KEY_A, kv_slots, state_slot=s8)
    assert res.state_adopted and s8 == 1
    leaf = res.last_node
    assert leaf.host_state_slot == 1  # write_through: the state went to host with the KV
    assert_state_bits(hs, 1, conv8, ssm8)

    # A state set after the KV was backed up (split upper node): copied on its own.
    m = c.match_prefix(KEY_A[:4])
    assert (m.prefix_len, m.kv_hit_length) == (0, 4)
    s4 = h.state()
    conv4, ssm4 = fill_state(h, s4, gen)
    res = c.insert(KEY_A[:4], kv_slots[:4], state_slot=s4)  # the tree's own slots
    up = res.last_node
    assert len(res.duplicate_indices) == 0 and res.state_adopted and (s4, up.state_slot, up.host_state_slot) == (2, 2, 2)
    assert_state_bits(hs, 2, conv4, ssm4)
    c.sanity_check()

    assert c.evict(8).num_states == 2
    assert (leaf.state_slot, up.state_slot, leaf.kv_value, up.kv_value) == (None, None, None, None)
    assert free_slots(sp) == [3, 1, 2]
    sp.conv.fill_(3.0)  # garbage in every device state
    sp.ssm.fill_(3.0)
    h.kv.pool.k_all.fill_(5.0)

    m = c.match_prefix(KEY_A)
    assert (m.prefix_len, m.host_hit_length, m.last_host_node) == (0, 8, leaf)
    assert c.load_back(leaf) == 8
    c.sanity_check()
    assert leaf.state_slot == 3 and up.state_slot is None  # the chain's end gets its state back
    assert_state_bits(sp, 3, conv8, ssm8)
    assert_kv_bits(h.kv.pool, torch.cat([node_slots(up), node_slots(leaf)]), k, v)
    m = c.match_prefix(KEY_A)
    assert (m.prefix_len, m.state_slot, m.host_hit_length) == (8, 3, 0)
    # The host copies stay (the node is device+host now) and still hold every byte.
    assert (leaf.host_state_slot, up.host_state_slot) == (1, 2)
    assert_state_bits(hs, 1, conv8, ssm8)
    assert_state_bits(hs, 2, conv4, ssm4)
