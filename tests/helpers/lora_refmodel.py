"""Helpers for the LoRA tests: tiny adapters and a brute-force reference model of the pool.

The reference model shares no code with the library: plain lists and sets, written from the
serving rules (SGLang's) and ``allocators/lora/pool.py``'s docstring:

* a batch is refused when its distinct unpinned ids exceed ``K - pinned``;
* a missing id goes to the lowest empty slot, else evicts the first id of the policy order
  that is resident, unpinned and not in the batch, adapters before the base model;
* after loading, the batch's unpinned adapters are marked used in batch order (lru: move to
  the back; fifo: append when absent); the base model is never in the order;
* pinning loads now (same slot rule, protecting only the pinned id) and leaves the order;
  unpinning appends to the order; at most ``K - 1`` pins; a reload re-pinned counts once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from allocators.lora import BASE_MODEL, LoraAdapter

SHAPES = {"q_proj": (8, 6), "v_proj": (8, 4), "o_proj": (6, 8)}
"""Base-model modules of the tests: name -> (in_features, out_features)."""


def make_adapter(
    gen: torch.Generator,
    rank: int,
    modules: tuple[str, ...] = ("q_proj", "v_proj"),
    scaling: float = 0.5,
    dtype: torch.dtype = torch.float64,
) -> LoraAdapter:
    """Random weights (no zeros in practice) for ``modules`` of :data:`SHAPES`."""
    weights = {}
    for m in modules:
        in_f, out_f = SHAPES[m]
        a = torch.randn(rank, in_f, generator=gen, dtype=dtype)
        b = torch.randn(out_f, rank, generator=gen, dtype=dtype)
        weights[m] = (a, b)
    return LoraAdapter(weights, scaling)


class Refused(Exception):
    """The reference model refuses the call (the library must raise, changing nothing)."""


@dataclass
class RefPool:
    k: int
    policy: str
    cap: int | None = None
    slots: list = field(default_factory=list)
    order: list = field(default_factory=list)  # first = next victim
    pinned: set = field(default_factory=set)
    loaded: list = field(default_factory=list)  # uids (name, serial) in load order
    serial: int = 0
    evictions: int = 0

    def __post_init__(self) -> None:
        self.slots = [None] * self.k

    # -- helpers
    def _take(self, protect: set) -> tuple[int, object]:
        if None in self.slots:
            return self.slots.index(None), None
        cands = [u for u in self.slots if u not in protect and u not in self.pinned]
        adapters = [u for u in cands if u is not BASE_MODEL]
        if adapters:
            victim = next(u for u in self.order if u in adapters)
            self.order.remove(victim)
        else:
            victim = BASE_MODEL  # the only candidate left; never in the order
        self.evictions += 1
        slot = self.slots.index(victim)
        self.slots[slot] = None
        return slot, victim

    def _use(self, uid: object) -> None:
        if uid is BASE_MODEL:
            return
        if self.policy == "lru":
            if uid in self.order:
                self.order.remove(uid)
            self.order.append(uid)
        elif uid not in self.order:
            self.order.append(uid)

    # -- operations
    def load(self, name: str, pinned: bool) -> tuple[str, int]:
        if self.cap is not None and len(self.loaded) >= self.cap:
            raise Refused("max_loaded_loras")
        if pinned and len(self.pinned) >= self.k - 1:
            raise Refused("pin limit")
        uid = (name, self.serial)
        self.serial += 1
        self.loaded.append(uid)
        if pinned:
            self.pin(uid)
        return uid

    def unload(self, uid: tuple[str, int]) -> None:
        if uid in self.slots:
            self.slots[self.slots.index(uid)] = None
            if uid not in self.pinned:
                self.order.remove(uid)
        self.pinned.discard(uid)
        self.loaded.remove(uid)

    def reload(self, uid: tuple[str, int], pinned: bool | None) -> tuple[str, int]:
        was = uid in self.pinned
        new_pin = was if pinned is None else pinned
        if new_pin and len(self.pinned) - was + 1 > self.k - 1:
            raise Refused("pin limit")
        self.unload(uid)
        return self.load(uid[0], new_pin)

    def pin(self, uid: tuple[str, int]) -> object:
        if uid in self.pinned:
            return None
        if len(self.pinned) >= self.k - 1:
            raise Refused("pin limit")
        victim = None
        if uid in self.slots:
            self.order.remove(uid)
        else:
            slot, victim = self._take({uid})
            self.slots[slot] = uid
        self.pinned.add(uid)
        return victim

    def unpin(self, uid: tuple[str, int]) -> None:
        if uid in self.pinned:
            self.pinned.remove(uid)
            self._use(uid)

    def prepare(self, rows: list) -> tuple[list, list]:
        distinct = list(dict.fromkeys(rows))
        if len([u for u in distinct if u not in self.pinned]) > self.k - len(self.pinned):
            raise Refused("batch does not fit")
        loaded, evicted = [], []
        for u in distinct:
            if u in self.slots:
                continue
            slot, victim = self._take(set(distinct))
            if victim is not None:
                evicted.append(victim)
            self.slots[slot] = u
            loaded.append(u)
        for u in distinct:
            if u not in self.pinned:
                self._use(u)
        return loaded, evicted
