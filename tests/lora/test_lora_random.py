"""Seeded random load / pin / unpin / unload / reload / prepare_batch against the reference
model (``tests/helpers/lora_refmodel.py``), with every invariant checked after every step, and a
batched apply proving each row gets exactly its adapter's output wherever it landed."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from allocators.lora import BASE_MODEL, LoraAdapter, LoraBatchError, LoraMemoryPool, LoraUid
from tests.helpers.lora_refmodel import SHAPES, RefPool, Refused, make_adapter

MAX_RANK = 4


def ref_id(uid: object) -> object:
    return uid if uid is BASE_MODEL or uid is None else (uid.name, uid.serial)


class Harness:
    """One pool and its reference model, driven in lock step."""

    def __init__(self, k: int, policy: str, cap: int | None, seed: int) -> None:
        self.pool = LoraMemoryPool(
            SHAPES, MAX_RANK, k, max_loaded_loras=cap, eviction_policy=policy, dtype=torch.float64
        )
        self.ref = RefPool(k, policy, cap)
        self.gen = torch.Generator().manual_seed(seed)
        self.original: dict[LoraUid, LoraAdapter] = {}  # the weights as given, per load
        self.names = iter(f"n{i}" for i in range(10**6))

    def loaded(self) -> list[LoraUid]:
        return list(self.pool.loaded_uids())

    def new_adapter(self, rnd: random.Random) -> LoraAdapter:
        modules = tuple(m for m in SHAPES if rnd.random() < 0.6) or ("o_proj",)
        return make_adapter(self.gen, rnd.randint(1, MAX_RANK), modules, rnd.uniform(0.1, 2))

    def call(self, lib, ref) -> object:
        """Run both sides; both succeed or both refuse (the library changing nothing)."""
        before = self.pool.snapshot()
        try:
            want = ref()
        except Refused:
            with pytest.raises(ValueError):
                lib()
            assert self.pool.snapshot() == before
            return None
        return lib(), want

    def agree(self) -> None:
        pool, ref = self.pool, self.ref
        pool.check()
        pool.check_weights()
        assert [ref_id(u) for u in pool.slot_to_uid] == ref.slots
        assert [ref_id(u) for u in pool.policy.tracked()] == ref.order
        assert {ref_id(u) for u in self.loaded()} == set(ref.loaded)
        assert {ref_id(u) for u in self.loaded() if pool.is_pinned(u)} == ref.pinned
        assert pool.eviction_count == ref.evictions

    # ---------------------------------------------------------------- operations
    def op_load(self, rnd: random.Random) -> None:
        adapter, name, pinned = self.new_adapter(rnd), next(self.names), rnd.random() < 0.2
        out = self.call(
            lambda: self.pool.add_adapter(name, adapter, pinned=pinned),
            lambda: self.ref.load(name, pinned),
        )
        if out is not None:
            uid, want = out
            assert ref_id(uid) == want
            self.original[uid] = adapter

    def op_reload(self, rnd: random.Random, uid: LoraUid) -> None:
        adapter, pinned = self.new_adapter(rnd), rnd.choice([None, True, False])
        out = self.call(
            lambda: self.pool.replace_adapter(uid, adapter, pinned=pinned),
            lambda: self.ref.reload(ref_id(uid), pinned),
        )
        if out is not None:
            assert ref_id(out[0]) == out[1] and out[0].name == uid.name
            self.original[out[0]] = adapter

    def op_pin(self, uid: LoraUid) -> None:
        out = self.call(lambda: self.pool.pin(uid), lambda: self.ref.pin(ref_id(uid)))
        if out is not None:
            assert ref_id(out[0]) == out[1]

    def op_prepare(self, rnd: random.Random, rows: list) -> None:
        ref_rows = [ref_id(u) for u in rows]
        out = self.call(lambda: self.pool.prepare_batch(rows), lambda: self.ref.prepare(ref_rows))
        if out is None:
            return
        batch, (loaded, evicted) = out
        assert [ref_id(u) for u in batch.loaded] == loaded
        assert [ref_id(u) for u in batch.evicted] == evicted
        self.check_apply(rnd, rows, batch.weight_indices)

    def check_apply(self, rnd: random.Random, rows: list, weight_indices: torch.Tensor) -> None:
        module = rnd.choice(list(SHAPES))
        x = torch.randn(len(rows), SHAPES[module][0], generator=self.gen, dtype=torch.float64)
        y = self.pool.apply(module, x, weight_indices)
        for i, uid in enumerate(rows):
            adapter = None if uid is BASE_MODEL else self.original[uid]
            if adapter is None or module not in adapter.weights:
                assert torch.count_nonzero(y[i]) == 0, (i, uid, module)
            else:
                want = adapter.delta(module, x[i : i + 1])[0]
                assert torch.allclose(y[i], want, rtol=1e-12, atol=1e-12), (i, uid, module)


def random_walk(h: Harness, rnd: random.Random, steps: int) -> None:
    k = h.pool.max_loras_per_batch
    for _ in range(steps):
        loaded = h.loaded()
        r = rnd.random()
        if r < 0.15 or not loaded:
            h.op_load(rnd)
        elif r < 0.22:
            uid = rnd.choice(loaded)
            h.pool.remove_adapter(uid)
            h.ref.unload(ref_id(uid))
        elif r < 0.28:
            h.op_reload(rnd, rnd.choice(loaded))
        elif r < 0.34:
            h.op_pin(rnd.choice(loaded))
        elif r < 0.42:
            uid = rnd.choice(loaded)
            h.pool.unpin(uid)
            h.ref.unpin(ref_id(uid))
        else:
            width = rnd.randint(1, k + 1)  # sometimes too wide: a refusal
            choices = [*loaded, BASE_MODEL]
            rows = [rnd.choice(choices) for _ in range(rnd.randint(1, 2 * width))][: 3 * k]
            distinct = list(dict.fromkeys(rows))[:width]
            rows = [u for u in rows if u in distinct]
            assert h.pool.validate_batch(rows) == (
                len({u for u in distinct if not h.pool.is_pinned(u)}) <= h.pool.num_unpinned_slots
            )
            h.op_prepare(rnd, rows)
        h.agree()


@pytest.mark.parametrize("policy", ["lru", "fifo"])
@pytest.mark.parametrize(("k", "cap", "seed"), [(1, None, 0), (3, None, 1), (4, 6, 2), (6, 8, 3)])
def test_random_operations_match_the_reference_model(policy, k, cap, seed) -> None:
    h = Harness(k, policy, cap, seed)
    random_walk(h, random.Random(seed * 7919 + len(policy)), 400)
    assert h.pool.eviction_count > 0 or k == 1 and h.pool.num_loads > 0


def test_refusals_happen_in_the_walk() -> None:
    """The walk exercises refusals (batch too wide, pin limit), not only the happy path."""
    h = Harness(3, "lru", 5, 11)
    refused = 0
    original = h.call

    def counting(lib, ref):
        nonlocal refused
        out = original(lib, ref)
        refused += out is None
        return out

    h.call = counting  # type: ignore[method-assign]
    random_walk(h, random.Random(5), 300)
    assert refused >= 5


# ---------------------------------------------------------------------- hypothesis stateful
class LoraPoolMachine(RuleBasedStateMachine):
    """The same lock step, with hypothesis choosing the operations (k = 3, lru)."""

    def __init__(self) -> None:
        super().__init__()
        self.h = Harness(3, "lru", 6, 0)
        self.rnd = random.Random(0)

    @rule()
    def load(self) -> None:
        self.h.op_load(self.rnd)

    @precondition(lambda self: self.h.loaded())
    @rule(i=st.integers(0, 100))
    def unload(self, i: int) -> None:
        uid = self.h.loaded()[i % len(self.h.loaded())]
        self.h.pool.remove_adapter(uid)
        self.h.ref.unload(ref_id(uid))

    @precondition(lambda self: self.h.loaded())
    @rule(i=st.integers(0, 100))
    def reload(self, i: int) -> None:
        self.h.op_reload(self.rnd, self.h.loaded()[i % len(self.h.loaded())])

    @precondition(lambda self: self.h.loaded())
    @rule(i=st.integers(0, 100), unpin=st.booleans())
    def pin_or_unpin(self, i: int, unpin: bool) -> None:
        uid = self.h.loaded()[i % len(self.h.loaded())]
        if unpin:
            self.h.pool.unpin(uid)
            self.h.ref.unpin(ref_id(uid))
        else:
            self.h.op_pin(uid)

    @rule(picks=st.lists(st.integers(-1, 100), min_size=1, max_size=6))
    def prepare(self, picks: list[int]) -> None:
        loaded = self.h.loaded()
        rows = [BASE_MODEL if p < 0 or not loaded else loaded[p % len(loaded)] for p in picks]
        self.h.op_prepare(self.rnd, rows)

    @invariant()
    def agrees(self) -> None:
        self.h.agree()


TestLoraPoolMachine = LoraPoolMachine.TestCase
TestLoraPoolMachine.settings = settings(max_examples=25, stateful_step_count=30, deadline=None)


def test_lora_batch_error_is_a_value_error() -> None:
    assert issubclass(LoraBatchError, ValueError)
