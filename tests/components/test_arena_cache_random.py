"""A radix cache over a memory arena under seeded random operations, against a reference of
what memory must hold.

Operations: requests (match, lock, ``make_room`` for the new tokens and a state, alloc, write
real KV bytes and state tensors, a copy-on-write of the matched state, insert, unlock), the
three evictions, ``make_room`` alone (KV or states), ``compact_kv``, locks and unlocks of
cached nodes, memory held by running requests outside the tree (KV pages and state slots,
with their own bytes) and its release; before a request, sometimes one that frees its state
slot before writing it (on a device its zeroing and copy stay pending while the next request
makes room).

The reference, kept by the test alone: the KV row written for each token (a token id is
used at one position only, so its row is fixed), the state written for each key end (keyed
by its last token), and the ids requests hold. After every step:

* every cached token's KV row, read through its node's slot ids, and every node's state,
  read through ``get_state``, equal what was written; so do the requests' own bytes;
* every id lies in a chunk of its kind (``arena.owner``);
* used KV tokens = tokens the tree holds + tokens requests hold; used state slots = states
  on nodes + slots requests hold (nothing leaked, nothing freed twice);
* ``make_room`` returning ``False`` left the boundary where it was; ``compact_kv``
  returning ``False`` changed nothing;
* ``arena.check()`` and ``cache.sanity_check()``.

Arenas: page sizes 1 and 2, 1 to 3 pages per chunk, tiny (2 usable chunks) to 15 chunks,
all-KV, all-state and mixed starts; one run on a simulated device (``SimCuda``: the state
view's pending work).
"""

from __future__ import annotations

import random

import pytest
import torch

from allocators.arena import KV as KV_OWNER
from allocators.arena import STATE as STATE_OWNER
from allocators.arena import KVShape, MemoryArena, StateShape
from bench.dev.gpu.simcuda import SimCuda
from components.compaction import compact_kv
from components.eviction.unified import make_room
from radix.cache import RadixCache
from radix.config import CacheConfig


def state_value(token: int) -> float:
    return float(token % 1000 + 1)


def run(seed: int, page_size: int, chunks: int, state_slots: int, ssm: int,
        steps: int = 200, device: str = "cpu") -> int:
    """The random run; returns how many boundary moves and compactions it made."""
    rng = random.Random(seed)
    kv_shape = KVShape(2, 1, 4, torch.float16, page_size)  # 32 B per token
    st_shape = StateShape(2, (2, 3), (2, ssm))  # 2 * (6 + 2 * ssm) * 4 B
    page = kv_shape.page_bytes
    chunk = page * -(-st_shape.bytes // page)
    a = MemoryArena((chunks - 1) * chunk, kv_shape, st_shape, state_slots=state_slots,
                    device=device)
    assert a.num_chunks == chunks
    cache = RadixCache(CacheConfig(page_size=page_size, radix_eviction_policy="unified"),
                       kv_allocator=a.kv_allocator, state_allocator=a.state_pool)
    kv, sp = a.kv_allocator, a.state_pool
    rows = a.buffer.view(-1, kv_shape.bytes_per_token)  # one row per KV slot
    row_of: dict[int, torch.Tensor] = {}  # token -> its KV row
    keys: list[list[int]] = []
    locks: list[object] = []
    held_kv: list[tuple[torch.Tensor, int]] = []  # a request's KV slots, the byte written
    held_states: list[tuple[int, int]] = []  # a request's state slot, the token it encodes
    next_token = 1
    moves = 0

    def write_state(slot: int, token: int) -> None:
        v = state_value(token)
        for layer in range(2):
            sp.set_state(slot, layer, torch.full((2, 3), v + layer),
                         torch.full((2, ssm), -v - layer))

    def read_state(slot: int) -> float:
        conv, ssm_state = sp.get_state(slot, 1)
        assert bool((ssm_state == -float(conv[0, 0])).all())
        return float(conv[0, 0]) - 1

    def check() -> None:
        a.check()
        cache.sanity_check()
        host_rows = rows.cpu()
        tree_tokens = tree_states = 0
        for node in cache.tree.iter_nodes():
            if node.kv_value is None:
                continue
            ids = torch.tensor(list(node.kv_value), dtype=torch.int64)
            assert (a.owner[ids.numpy() // a.tokens_per_chunk] == KV_OWNER).all()
            want = torch.stack([row_of[t] for t in node.key])
            assert torch.equal(host_rows[ids], want), node
            tree_tokens += len(node.key)
            if node.state_slot is not None:
                tree_states += 1
                assert a.owner[node.state_slot] == STATE_OWNER
                assert read_state(node.state_slot) == state_value(node.key[-1]), node
        for slots, byte in held_kv:
            assert (a.owner[slots.cpu().numpy() // a.tokens_per_chunk] == KV_OWNER).all()
            assert bool((host_rows[slots.cpu()] == byte).all())
        for slot, token in held_states:
            assert a.owner[slot] == STATE_OWNER and read_state(slot) == state_value(token)
        assert kv.owned_size() - kv.available_size() == tree_tokens + sum(
            int(s.numel()) for s, _ in held_kv)
        assert sp.owned_size() - sp.available_size() == tree_states + len(held_states)

    for _ in range(steps):
        op = rng.random()
        owner_before = a.owner.tobytes()
        band_before = a.num_state_chunks
        if op < 0.4:  # a request: its new tokens and a state at the key's end
            head: list[int] = []
            if keys and rng.random() < 0.6:
                k = rng.choice(keys)
                head = k[: page_size * rng.randint(0, len(k) // page_size)]
            n = page_size * rng.randint(1, 4)
            key = head + list(range(next_token, next_token + n))
            next_token += n
            if rng.random() < 0.3:  # a request stopped before writing its state: on a
                s = sp.alloc_slot()  # device its zeroing and a copy into it stay pending
                if s is not None:
                    states = [n.state_slot for n in cache.tree.iter_nodes()
                              if n.state_slot is not None]
                    if states:
                        sp.copy(rng.choice(states), s)
                    sp.free_slot(s)
            m = cache.match_prefix(key)
            need = len(key) - m.prefix_len
            lock = cache.inc_lock_ref(m.last_device_node)
            ok = make_room(cache, a, kv_tokens=need, states=1)
            if not ok:
                assert a.owner.tobytes() == owner_before
            new = kv.alloc(need) if ok else None
            slot = sp.alloc_slot() if new is not None else None
            if new is None or slot is None:
                if new is not None:
                    kv.free(new)
                cache.dec_lock_ref(lock)
                continue
            if m.state_slot is not None and rng.random() < 0.5:  # copy-on-write
                sp.copy(m.state_slot, slot)
                assert read_state(slot) == state_value(key[m.prefix_len - 1])
            data = torch.randint(0, 256, (need, kv_shape.bytes_per_token), dtype=torch.uint8)
            rows[new] = data.to(a.device)
            write_state(slot, key[-1])
            res = cache.insert(key, torch.cat([m.device_indices, new]), state_slot=slot)
            # (the tree may hold more of the key than the match gave: those slots are
            # duplicates, the tree keeps its own rows)
            for token, row in zip(key[res.prefix_len:], data[res.prefix_len - m.prefix_len:],
                                  strict=True):
                row_of[token] = row
            if res.duplicate_indices.numel():
                kv.free(res.duplicate_indices)
            if not res.state_adopted:
                sp.free_slot(slot)
            cache.dec_lock_ref(lock)
            keys.append(key)
        elif op < 0.5:
            r = rng.random()
            if r < 0.33:
                cache.evict(page_size * rng.randint(1, 4))
            elif r < 0.66:
                cache.evict_states(rng.randint(1, 2))
            else:
                cache.evict_bytes(rng.randint(1, 600))
        elif op < 0.6:
            if rng.random() < 0.5:
                ok = make_room(cache, a, kv_tokens=page_size * rng.randint(0, 8))
            else:
                ok = make_room(cache, a, states=rng.randint(0, 3))
            if not ok:
                assert a.owner.tobytes() == owner_before
        elif op < 0.68:
            snap = (kv.snapshot(), sp.snapshot(), owner_before)
            if compact_kv(cache, a, rng.randint(1, 2)):
                moves += 1
            else:
                assert (kv.snapshot(), sp.snapshot(), a.owner.tobytes()) == snap
        elif op < 0.76:
            nodes = cache.tree.iter_nodes()
            if nodes:
                locks.append(cache.inc_lock_ref(rng.choice(nodes)))
        elif op < 0.84:
            if locks:
                cache.dec_lock_ref(locks.pop(rng.randrange(len(locks))))
        elif op < 0.92:  # a running request's own memory, outside the tree
            if rng.random() < 0.5:
                got = kv.alloc(page_size * rng.randint(1, 3))
                if got is not None:
                    byte = rng.randrange(256)
                    rows[got] = torch.full((), byte, dtype=torch.uint8, device=a.device)
                    held_kv.append((got, byte))
            else:
                s = sp.alloc_slot()
                if s is not None:
                    write_state(s, next_token)
                    held_states.append((s, next_token))
                    next_token += 1
        elif held_kv and rng.random() < 0.5:
            kv.free(held_kv.pop(rng.randrange(len(held_kv)))[0])
        elif held_states:
            sp.free_slot(held_states.pop(rng.randrange(len(held_states)))[0])
        moves += a.num_state_chunks != band_before
        check()
    return moves


# (chunks, state_slots at the start, ssm width: 1 to 3 pages per chunk at 32 B per token)
ARENAS = [(3, 0, 5), (3, 1, 13), (3, 2, 21), (8, 7, 5), (12, 4, 21), (16, 5, 29)]


@pytest.mark.parametrize("page_size", [1, 2])
@pytest.mark.parametrize(("chunks", "state_slots", "ssm"), ARENAS)
def test_random_cache_operations_keep_memory_exact(page_size: int, chunks: int,
                                                   state_slots: int, ssm: int) -> None:
    moves = sum(run(seed, page_size, chunks, state_slots, ssm) for seed in range(2))
    if chunks >= 12:
        assert moves >= 5  # the run did move the boundary and compact


def test_random_cache_operations_on_a_device() -> None:
    with SimCuda():
        assert run(0, 2, 12, 4, 21, steps=150, device="cuda") >= 3
