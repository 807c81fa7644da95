"""Random operations against a brute-force reference model, ``check()`` after every step.

The reference is a Python list in free-list order plus a set of used ids, so the tests pin
the exact ids each ``alloc`` returns, not only counts.
"""

from __future__ import annotations

import random

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from allocators import AllocTxn, MambaStatePool, PagedAllocator, SlotAllocator, TokenAllocator


class Reference:
    """FIFO free list of page ids; ``alloc`` from the front, ``free`` to the back."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.page_size = page_size
        self.free = list(range(1, num_pages + 1))
        self.used: set[int] = set()

    def alloc(self, n: int) -> list[int] | None:
        k = n // self.page_size
        if k > len(self.free):
            return None
        pages, self.free = self.free[:k], self.free[k:]
        self.used.update(pages)
        return [p * self.page_size + i for p in pages for i in range(self.page_size)]

    def free_slots(self, slots: list[int]) -> None:
        pages = slots[:: self.page_size]
        pages = [s // self.page_size for s in pages]
        self.used.difference_update(pages)
        self.free.extend(pages)

    def undo(self, slots: list[int]) -> None:
        pages = [s // self.page_size for s in slots[:: self.page_size]]
        self.used.difference_update(pages)
        self.free[:0] = pages


def _agree(alloc: SlotAllocator, ref: Reference) -> None:
    alloc.check()
    assert alloc.snapshot().free_ids() == ref.free
    assert alloc.available_size() == len(ref.free) * ref.page_size
    assert alloc.used_size() == len(ref.used) * ref.page_size


def _as_tensor(slots: list[int]) -> torch.Tensor:
    return torch.tensor(slots, dtype=torch.int64)


class AllocatorMachine(RuleBasedStateMachine):
    """Drives a TokenAllocator, a PagedAllocator and a MambaStatePool side by side."""

    def __init__(self) -> None:
        super().__init__()
        self.allocs: list[SlotAllocator] = [
            TokenAllocator(12),
            PagedAllocator(12, page_size=3),
            MambaStatePool(5, num_layers=1, conv_state_shape=(2,), ssm_state_shape=(1,)),
        ]
        self.refs = [Reference(12, 1), Reference(4, 3), Reference(5, 1)]
        self.held: list[list[list[int]]] = [[], [], []]  # per allocator: live alloc results

    which = st.integers(0, 2)

    @rule(which=which, pages=st.integers(0, 6))
    def alloc(self, which: int, pages: int) -> None:
        n = pages * self.refs[which].page_size
        got = self.allocs[which].alloc(n)
        want = self.refs[which].alloc(n)
        assert (None if got is None else got.tolist()) == want
        if want:
            self.held[which].append(want)

    @precondition(lambda self: any(self.held))
    @rule(data=st.data())
    def free_some(self, data: st.DataObject) -> None:
        which = data.draw(st.sampled_from([i for i, h in enumerate(self.held) if h]))
        held = self.held[which]
        slots = held.pop(data.draw(st.integers(0, len(held) - 1)))
        p = self.refs[which].page_size
        keep = data.draw(st.integers(0, len(slots) // p)) * p  # free a whole-page prefix
        freed, rest = slots[keep:], slots[:keep]
        if rest:
            held.append(rest)
        self.allocs[which].free(_as_tensor(freed))
        self.refs[which].free_slots(freed)

    @precondition(lambda self: any(self.held))
    @rule(data=st.data(), bad=st.sampled_from(["double", "dup", "zero", "beyond"]))
    def misuse(self, data: st.DataObject, bad: str) -> None:
        which = data.draw(st.sampled_from([i for i, h in enumerate(self.held) if h]))
        alloc, ref = self.allocs[which], self.refs[which]
        p = ref.page_size
        live = self.held[which][0][:p]
        if bad == "double" and ref.free:
            slots = [ref.free[0] * p + i for i in range(p)]
        elif bad == "dup":
            slots = live + live
        elif bad == "zero":
            slots = list(range(p))
        else:
            slots = [alloc.size + p + i for i in range(p)]
        before = alloc.snapshot()
        try:
            alloc.free(_as_tensor(slots))
        except ValueError as exc:
            assert "double free" in str(exc) or "foreign index" in str(exc)
        else:
            raise AssertionError(f"free({slots}) should have raised")
        assert alloc.snapshot() == before

    @rule(sizes=st.lists(st.integers(0, 3), min_size=3, max_size=3))
    def txn_rollback(self, sizes: list[int]) -> None:
        before = [a.snapshot() for a in self.allocs]
        with AllocTxn() as txn:
            for alloc, ref, k in zip(self.allocs, self.refs, sizes, strict=True):
                txn.alloc(alloc, k * ref.page_size)
        assert [a.snapshot() for a in self.allocs] == before

    @invariant()
    def agrees_with_reference(self) -> None:
        for alloc, ref in zip(self.allocs, self.refs, strict=True):
            _agree(alloc, ref)


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_seeded_random_stress_with_undo() -> None:
    """Longer seeded runs: alloc / free in random order / undo, checked every step."""
    for seed in range(3):
        rng = random.Random(seed)
        for alloc, ref in (
            (TokenAllocator(64), Reference(64, 1)),
            (PagedAllocator(64, page_size=4), Reference(16, 4)),
        ):
            held: list[list[int]] = []
            for _ in range(300):
                op = rng.random()
                if op < 0.45 or not held:
                    n = rng.randint(0, 12) * ref.page_size
                    got, want = alloc.alloc(n), ref.alloc(n)
                    assert (None if got is None else got.tolist()) == want
                    if want:
                        held.append(want)
                elif op < 0.9:
                    slots = held.pop(rng.randrange(len(held)))
                    pages = [
                        slots[i : i + ref.page_size] for i in range(0, len(slots), ref.page_size)
                    ]
                    rng.shuffle(pages)  # free whole pages in any order
                    flat = [s for pg in pages for s in pg]
                    alloc.free(_as_tensor(flat))
                    ref.free_slots(flat)
                else:
                    slots = held.pop()  # undo puts the ids back at the front
                    alloc.undo_alloc(_as_tensor(slots))
                    ref.undo(slots)
                _agree(alloc, ref)
