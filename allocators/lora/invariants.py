"""The LoRA pool's invariants, recomputed from scratch (``LoraMemoryPool.check`` /
``check_weights``). Each failure raises ``AssertionError`` with the broken rule and a dump."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .identity import BaseModel, LoraUid

if TYPE_CHECKING:
    from .pool import LoraMemoryPool

__all__ = ["check_pool", "check_pool_weights"]


def _dump(pool: LoraMemoryPool) -> str:
    return (
        f"slot_to_uid={pool.slots.slot_to_uid}\nuid_to_slot={pool.slots.uid_to_slot}\n"
        f"pinned={sorted(map(str, pool.pinned_uids()))}\nloaded={[str(u) for u in pool.loaded_uids()]}\n"
        f"policy={pool.policy!r}"
    )


def check_pool(pool: LoraMemoryPool) -> None:
    """Slots, both maps, pins, policy and host tier agree (see ``LoraMemoryPool.check``)."""
    try:
        _check(pool)
    except AssertionError as exc:
        raise AssertionError(f"LoRA pool invariant broken: {exc}\n{_dump(pool)}") from None


def _check(pool: LoraMemoryPool) -> None:
    k = pool.max_loras_per_batch
    loaded = pool.loaded_uids()
    pinned = pool.pinned_uids()
    slots = pool.slots.slot_to_uid
    assert len(slots) == k, f"{len(slots)} slots, max_loras_per_batch={k}"
    residents = [u for u in slots if u is not None]
    assert len(set(residents)) == len(residents), "an id sits in two slots"
    for slot, uid in enumerate(slots):
        if uid is None:
            continue
        assert isinstance(uid, LoraUid | BaseModel), f"slot {slot} holds {uid!r}"
        assert pool.slots.uid_to_slot.get(uid) == slot, (
            f"slot {slot} holds {uid}, uid_to_slot disagrees"
        )
        if isinstance(uid, LoraUid):
            assert uid in loaded, f"slot {slot} holds {uid}, which is not loaded"
    for uid, slot in pool.slots.uid_to_slot.items():
        assert 0 <= slot < k and slots[slot] == uid, f"uid_to_slot[{uid}]={slot} disagrees"
    assert len(pool.slots.uid_to_slot) == len(residents), "uid_to_slot has extra entries"
    assert len(pinned) <= k - 1, f"{len(pinned)} pinned > max_loras_per_batch - 1"
    for uid in pinned:
        assert uid in loaded, f"pinned {uid} is not loaded"
        assert uid in pool.slots.uid_to_slot, f"pinned {uid} is not resident"
    expected = {u for u in residents if isinstance(u, LoraUid)} - pinned
    tracked = pool.policy.tracked()
    assert len(set(tracked)) == len(tracked), "the policy tracks an id twice"
    assert set(tracked) == expected, (
        f"policy tracks {sorted(map(str, tracked))}, resident unpinned adapters are "
        f"{sorted(map(str, expected))}"
    )
    cap = pool.max_loaded_loras
    assert cap is None or len(loaded) <= cap, f"{len(loaded)} loaded > {cap}"
    assert all(u.serial < pool.next_serial for u in loaded), "serial from the future"
    assert len({u.serial for u in loaded}) == len(loaded), "serial reused"


def check_pool_weights(pool: LoraMemoryPool) -> None:
    """Each slot holds exactly its occupant's weights, zero-padded; others are all zero."""
    r_max = pool.max_lora_rank
    for slot, uid in enumerate(pool.slots.slot_to_uid):
        adapter = pool.adapter(uid) if isinstance(uid, LoraUid) else None
        weights = {} if adapter is None else adapter.weights
        want_scale = 0.0 if adapter is None else adapter.scaling
        got_scale = float(pool.scaling[slot])
        assert got_scale == torch.tensor(want_scale, dtype=pool.dtype).item(), (
            f"slot {slot} ({uid}): scaling {got_scale} != {want_scale}"
        )
        for module, (in_f, out_f) in pool.target_modules.items():
            a_want = torch.zeros((r_max, in_f), dtype=pool.dtype)
            b_want = torch.zeros((out_f, r_max), dtype=pool.dtype)
            if module in weights:
                a, b = weights[module]
                a_want[: a.shape[0]] = a
                b_want[:, : b.shape[1]] = b
            a_got = pool.A_buffer[module][slot].cpu()
            b_got = pool.B_buffer[module][slot].cpu()
            assert torch.equal(a_got, a_want), f"slot {slot} ({uid}): A[{module!r}] differs"
            assert torch.equal(b_got, b_want), f"slot {slot} ({uid}): B[{module!r}] differs"
