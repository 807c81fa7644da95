"""LoraMemoryPool: narrated scenarios with tiny pools, exact slots and exact victims.

Slots fill lowest-first; the tests name adapters a, b, c, ... in load order (serials 0, 1, ...).
"""

from __future__ import annotations

import pytest
import torch

from allocators.lora import (
    BASE_MODEL,
    LoraAdapter,
    LoraBatchError,
    LoraMemoryPool,
    LoraUid,
)
from hicache.storage.keys import chain_seed
from tests.helpers.lora_refmodel import SHAPES, make_adapter


def make_pool(k: int = 3, policy: str = "lru", rank: int = 4, **kw) -> LoraMemoryPool:
    pool = LoraMemoryPool(SHAPES, rank, k, eviction_policy=policy, dtype=torch.float64, **kw)
    pool.check()
    return pool


def load(pool: LoraMemoryPool, names: str, gen=None, rank: int = 2, **kw) -> dict[str, LoraUid]:
    gen = gen or torch.Generator().manual_seed(len(pool.loaded_uids()))
    return {n: pool.add_adapter(n, make_adapter(gen, rank), **kw) for n in names}


def occupants(pool: LoraMemoryPool) -> list[str | None]:
    """Slots as adapter names, ``"BASE"`` or ``None``."""
    return [None if u is None else "BASE" if u is BASE_MODEL else u.name for u in pool.slot_to_uid]


def step(pool: LoraMemoryPool, *uids) -> tuple[list[str], list[str]]:
    """``prepare_batch``, invariants, and ``(loaded, evicted)`` as names."""
    batch = pool.prepare_batch(list(uids))
    pool.check()
    pool.check_weights()
    name = lambda u: "BASE" if u is BASE_MODEL else u.name  # noqa: E731
    assert batch.weight_indices.tolist() == [pool.uid_to_slot[u] for u in uids]
    return [name(u) for u in batch.loaded], [name(u) for u in batch.evicted]


# ====================================================================== exact victims
@pytest.mark.parametrize(
    ("policy", "expect"),
    [
        # lru: after [a] [b] [c] [a], order b c a; [d] evicts b; [c d] -> order a c d;
        # [b] evicts a; [e] evicts c.
        ("lru", [["b"], ["a"], ["c"]]),
        # fifo: order a b c regardless of reuse; [d] evicts a; [b] is resident; [e] evicts b.
        ("fifo", [["a"], [], ["b"]]),
    ],
)
def test_exact_victims(policy: str, expect: list[list[str]]) -> None:
    pool = make_pool(3, policy)
    u = load(pool, "abcde")
    for n in "abc":
        assert step(pool, u[n]) == ([n], [])
    assert occupants(pool) == ["a", "b", "c"]
    assert step(pool, u["a"]) == ([], [])
    assert step(pool, u["d"]) == (["d"], expect[0])
    assert step(pool, u["c"], u["d"])[1] == []
    assert step(pool, u["b"])[1] == expect[1]
    assert step(pool, u["e"])[1] == expect[2]
    assert pool.eviction_count == sum(map(len, expect))
    want = {"lru": ["b", "d", "e"], "fifo": ["d", "e", "c"]}[policy]
    assert occupants(pool) == want


def test_batch_members_are_never_victims() -> None:
    pool = make_pool(2, "lru")
    u = load(pool, "abc")
    step(pool, u["a"], u["b"])  # order a, b: a is least recent
    assert step(pool, u["a"], u["c"]) == (["c"], ["b"])
    assert occupants(pool) == ["a", "c"]


def test_repeated_rows_share_one_slot_and_three_ids_do_not_fit_two() -> None:
    pool = make_pool(2)
    u = load(pool, "ab")
    with pytest.raises(LoraBatchError, match="needs 3 unpinned slots but only 2"):
        pool.prepare_batch([u["a"], u["b"], u["a"], BASE_MODEL])
    batch = pool.prepare_batch([u["a"], u["b"], u["a"], u["b"]])
    assert batch.weight_indices.tolist() == [0, 1, 0, 1]
    assert batch.num_hits == 0 and dict(batch.uid_to_slot) == {u["a"]: 0, u["b"]: 1}
    assert pool.prepare_batch([u["b"]]).num_hits == 1


# ====================================================================== base model slot
def test_base_model_slot_is_evicted_only_when_the_batch_is_all_adapters() -> None:
    pool = make_pool(3, "lru")
    u = load(pool, "abcd")
    step(pool, BASE_MODEL)
    step(pool, u["a"])
    step(pool, u["b"])
    assert occupants(pool) == ["BASE", "a", "b"]
    # The base model is least recent, but an adapter goes first.
    assert step(pool, u["c"]) == (["c"], ["a"])
    # All-adapter batch needing two slots: b is not in it, then only the base model is left.
    assert step(pool, u["c"], u["a"], u["d"]) == (["a", "d"], ["b", "BASE"])
    assert occupants(pool) == ["d", "c", "a"]  # a took b's slot 2, d the base model's slot 0
    # The base model comes back with zero weights, into the victim's slot.
    assert step(pool, BASE_MODEL) == (["BASE"], ["c"])
    slot = pool.uid_to_slot[BASE_MODEL]
    assert slot == 1 and float(pool.scaling[slot]) == 0.0
    assert all(torch.count_nonzero(buf[slot]) == 0 for buf in pool.A_buffer.values())


# ====================================================================== pinning
def test_pinned_adapters_are_loaded_at_once_and_never_evicted() -> None:
    pool = make_pool(3, "lru")
    u = load(pool, "bcde")
    a = pool.add_adapter("a", make_adapter(torch.Generator().manual_seed(9), 3), pinned=True)
    pool.check()
    assert occupants(pool) == ["a", None, None] and pool.is_pinned(a)
    assert pool.policy.tracked() == ()  # the policy tracks resident *unpinned* ids only
    step(pool, u["b"])
    step(pool, u["c"])
    assert step(pool, u["d"]) == (["d"], ["b"])
    assert step(pool, u["e"], u["d"]) == (["e"], ["c"])
    assert step(pool, a, u["b"], u["e"]) == (["b"], ["d"])  # a in the batch: a hit
    assert occupants(pool) == ["a", "b", "e"]
    assert pool.validate_batch([a, u["b"], u["c"]]) is True  # 2 unpinned ids, 2 unpinned slots
    assert pool.validate_batch([u["b"], u["c"], u["d"]]) is False
    with pytest.raises(LoraBatchError):
        pool.prepare_batch([u["b"], u["c"], u["d"]])


def test_pin_a_resident_adapter_and_unpin() -> None:
    pool = make_pool(3, "lru")
    u = load(pool, "abcd")
    step(pool, u["a"], u["b"], u["c"])  # order a, b, c
    assert pool.pin(u["a"]) is None  # resident: no load, leaves the policy
    pool.check()
    assert pool.policy.tracked() == (u["b"], u["c"])
    assert step(pool, u["d"]) == (["d"], ["b"])
    pool.unpin(u["a"])  # evictable again, as just used
    pool.check()
    assert pool.policy.tracked() == (u["c"], u["d"], u["a"])
    assert occupants(pool) == ["a", "d", "c"]
    assert pool.pin(u["b"]) == u["c"]  # pinning a non-resident adapter evicts the policy's pick
    pool.check()
    assert occupants(pool) == ["a", "d", "b"] and pool.policy.tracked() == (u["d"], u["a"])


def test_pin_limit_counts_a_re_pin_in_place_once() -> None:
    pool = make_pool(3, "lru")
    u = load(pool, "abc")
    pool.pin(u["a"])
    pool.pin(u["b"])
    assert pool.pin(u["a"]) is None  # already pinned: nothing happens, not counted again
    before = pool.snapshot()
    with pytest.raises(
        ValueError, match=r"2 adapters are pinned and at most max_loras_per_batch - 1 = 2"
    ):
        pool.pin(u["c"])
    with pytest.raises(ValueError, match="max_loras_per_batch - 1"):
        pool.add_adapter("z", make_adapter(torch.Generator().manual_seed(1), 2), pinned=True)
    with pytest.raises(ValueError, match="max_loras_per_batch - 1"):
        pool.replace_adapter(u["c"], make_adapter(torch.Generator(), 2), pinned=True)
    assert pool.snapshot() == before
    # Reloading a pinned adapter pinned again replaces it in place: allowed at the limit.
    new_a = pool.replace_adapter(u["a"], make_adapter(torch.Generator().manual_seed(2), 3))
    pool.check()
    pool.check_weights()
    assert pool.is_pinned(new_a) and not pool.is_loaded(u["a"]) and pool.num_pinned == 2
    pool.unpin(u["b"])
    pool.pin(u["c"])
    pool.check()


def test_one_slot_pool_allows_no_pin() -> None:
    pool = make_pool(1)
    u = load(pool, "a")
    with pytest.raises(ValueError, match="max_loras_per_batch - 1 = 0"):
        pool.pin(u["a"])


# ====================================================================== refusal
def test_refused_batch_changes_nothing_buffers_included() -> None:
    pool = make_pool(3, "fifo")
    u = load(pool, "abcde", rank=3)
    pool.pin(u["a"])
    step(pool, u["b"], u["c"])
    before = pool.snapshot()
    bufs = [t.clone() for t in (*pool.A_buffer.values(), *pool.B_buffer.values(), pool.scaling)]
    for bad in ([u["d"], u["e"], BASE_MODEL], [u["b"], u["c"], u["d"]]):
        assert pool.validate_batch(bad) is False
        with pytest.raises(LoraBatchError, match="split the batch"):
            pool.prepare_batch(bad)
    stale = LoraUid("b", 99)
    with pytest.raises(ValueError, match=r"uids\[1\]: adapter b#99 is not loaded"):
        pool.prepare_batch([u["d"], stale])
    with pytest.raises(TypeError, match=r"uids\[0\] must be a LoraUid"):
        pool.prepare_batch(["a"])
    with pytest.raises(TypeError, match="uids must be an iterable"):
        pool.prepare_batch("ab")
    with pytest.raises(TypeError, match=r"uids\[0\] must be a LoraUid, got NoneType"):
        pool.prepare_batch([None])  # None is never the base model
    assert pool.snapshot() == before
    after = [*pool.A_buffer.values(), *pool.B_buffer.values(), pool.scaling]
    assert all(torch.equal(x, y) for x, y in zip(bufs, after, strict=True))


# ====================================================================== identity
def test_reload_under_the_same_name_gives_a_new_uid_and_only_new_weights() -> None:
    gen = torch.Generator().manual_seed(3)
    pool = make_pool(2, "lru", rank=4)
    old = pool.add_adapter("a", make_adapter(gen, 4, ("q_proj", "v_proj")))
    step(pool, old)
    new = pool.replace_adapter(old, make_adapter(gen, 2, ("q_proj",)))  # smaller, fewer modules
    pool.check()
    assert new != old and new.name == old.name == "a" and new.serial > old.serial
    assert occupants(pool) == [None, None]  # the old load left its slot, zeroed
    assert all(torch.count_nonzero(t) == 0 for t in pool.A_buffer.values())
    with pytest.raises(ValueError, match="not loaded"):
        pool.prepare_batch([old])
    step(pool, new)  # lands in slot 0, where the old weights were
    assert pool.uid_to_slot[new] == 0
    assert torch.count_nonzero(pool.A_buffer["q_proj"][0, 2:]) == 0  # rank padding
    assert torch.count_nonzero(pool.B_buffer["q_proj"][0, :, 2:]) == 0
    assert torch.count_nonzero(pool.A_buffer["v_proj"][0]) == 0  # module it lacks
    assert torch.equal(pool.A_buffer["q_proj"][0, :2], pool.adapter(new).weights["q_proj"][0])


def test_a_victims_slot_holds_exactly_the_new_adapter() -> None:
    gen = torch.Generator().manual_seed(4)
    pool = make_pool(1, "lru", rank=4)
    big = pool.add_adapter("big", make_adapter(gen, 4, ("q_proj", "v_proj", "o_proj")))
    small = pool.add_adapter("small", make_adapter(gen, 1, ("v_proj",)))
    step(pool, big)
    assert step(pool, small) == (["small"], ["big"])  # check_weights ran inside step
    assert torch.count_nonzero(pool.A_buffer["q_proj"][0]) == 0
    assert torch.count_nonzero(pool.A_buffer["v_proj"][0, 1:]) == 0


def test_unload_then_load() -> None:
    pool = make_pool(2, "fifo")
    u = load(pool, "ab")
    step(pool, u["a"], u["b"])
    pool.remove_adapter(u["a"])
    pool.check()
    assert occupants(pool) == [None, "b"] and pool.policy.tracked() == (u["b"],)
    assert not pool.is_loaded(u["a"]) and torch.count_nonzero(pool.A_buffer["q_proj"][0]) == 0
    with pytest.raises(ValueError, match="not loaded"):
        pool.remove_adapter(u["a"])
    a2 = pool.add_adapter("a", make_adapter(torch.Generator().manual_seed(5), 3))
    assert a2 == LoraUid("a", 2, pool.adapter(a2).digest())
    assert step(pool, a2) == (["a"], [])
    assert occupants(pool) == ["a", "b"] and pool.policy.tracked() == (u["b"], a2)


def test_unload_a_pinned_adapter_frees_its_pin() -> None:
    pool = make_pool(2)
    u = load(pool, "ab")
    pool.pin(u["a"])
    pool.remove_adapter(u["a"])
    pool.check()
    assert pool.num_pinned == 0 and occupants(pool) == [None, None]
    pool.pin(u["b"])
    pool.check()


# ====================================================================== host tier
def test_compatibility_errors_name_the_argument_to_raise() -> None:
    gen = torch.Generator().manual_seed(6)
    pool = LoraMemoryPool({"q_proj": SHAPES["q_proj"]}, 2, 2, dtype=torch.float64)
    with pytest.raises(
        ValueError, match=r"rank 4 > max_lora_rank=2; start with max_lora_rank >= 4"
    ):
        pool.add_adapter("wide", make_adapter(gen, 4, ("q_proj",)))
    with pytest.raises(
        ValueError, match=r"targets \['v_proj'\], not in lora_target_modules=\['q_proj'\]"
    ):
        pool.add_adapter("other", make_adapter(gen, 2, ("q_proj", "v_proj")))
    assert pool.loaded_uids() == ()


def test_max_loaded_loras_caps_the_host_tier() -> None:
    pool = make_pool(2, max_loaded_loras=2)
    u = load(pool, "ab")
    with pytest.raises(ValueError, match="max_loaded_loras=2 adapters are loaded"):
        load(pool, "c")
    pool.remove_adapter(u["a"])
    load(pool, "c")
    pool.check()
    with pytest.raises(
        ValueError, match=r"max_loaded_loras \(1\) must be >= max_loras_per_batch \(2\)"
    ):
        make_pool(2, max_loaded_loras=1)


@pytest.mark.parametrize(
    ("kwargs", "exc", "msg"),
    [
        ({"target_modules": {}}, ValueError, "target_modules must name at least one module"),
        (
            {"target_modules": {"q": (0, 2)}},
            ValueError,
            r"target_modules\['q'\].in_features must be >= 1",
        ),
        (
            {"target_modules": {"q": 3}},
            TypeError,
            r"target_modules\['q'\] must be \(in_features, out_features\)",
        ),
        ({"target_modules": [("q", (1, 2))]}, TypeError, "target_modules must map"),
        ({"max_lora_rank": 0}, ValueError, "max_lora_rank must be >= 1"),
        ({"max_loras_per_batch": True}, TypeError, "max_loras_per_batch must be an int"),
        ({"eviction_policy": "random"}, ValueError, "eviction_policy must be one of"),
        ({"dtype": torch.int32}, ValueError, "dtype must be a floating-point"),
        ({"device": 3}, TypeError, "device must be a str or torch.device"),
        ({"overlap_loading": "yes"}, TypeError, "overlap_loading must be a bool"),
    ],
)
def test_constructor_arguments_are_validated(kwargs, exc, msg) -> None:
    args = {"target_modules": SHAPES, "max_lora_rank": 4, **kwargs}
    with pytest.raises(exc, match=msg):
        LoraMemoryPool(**args)


def test_add_adapter_arguments_are_validated() -> None:
    pool = make_pool()
    adapter = make_adapter(torch.Generator(), 2)
    with pytest.raises(TypeError, match="name must be a str"):
        pool.add_adapter(1, adapter)
    with pytest.raises(ValueError, match="name must be non-empty"):
        pool.add_adapter(" a", adapter)
    with pytest.raises(TypeError, match="adapter must be a LoraAdapter"):
        pool.add_adapter("a", {"q_proj": (1, 2)})
    with pytest.raises(TypeError, match="pinned must be a bool"):
        pool.add_adapter("a", adapter, pinned=1)
    with pytest.raises(TypeError, match="uid must be a LoraUid"):
        pool.pin("a")
    assert pool.loaded_uids() == ()


def test_overlap_loading_on_cpu_fills_the_same_weights() -> None:
    pool = make_pool(2, overlap_loading=True)
    assert pool.max_loaded_loras == 4  # 2 x max_loras_per_batch
    u = load(pool, "ab")
    step(pool, u["a"], u["b"])  # non_blocking copies; check_weights ran
    with pytest.raises(ValueError, match=r"<= 2 \* max_loras_per_batch \(4\)"):
        make_pool(2, overlap_loading=True, max_loaded_loras=5)


# ====================================================================== batched apply
def test_apply_gives_each_row_its_own_adapter_and_base_rows_zero() -> None:
    gen = torch.Generator().manual_seed(7)
    pool = make_pool(3, rank=4)
    a = pool.add_adapter("a", make_adapter(gen, 4))
    b = pool.add_adapter("b", make_adapter(gen, 1, ("q_proj",), scaling=2.0))
    rows = [b, BASE_MODEL, a, a, b, BASE_MODEL]
    batch = pool.prepare_batch(rows)
    x = torch.randn(len(rows), SHAPES["q_proj"][0], generator=gen, dtype=torch.float64)
    y = pool.apply("q_proj", x, batch.weight_indices)
    for i, uid in enumerate(rows):
        want = (
            torch.zeros(SHAPES["q_proj"][1], dtype=torch.float64)
            if uid is BASE_MODEL
            else pool.adapter(uid).delta("q_proj", x[i : i + 1])[0]
        )
        assert torch.allclose(y[i], want, rtol=0, atol=1e-12), (i, uid)
    v = pool.apply("v_proj", x, batch.weight_indices)  # b has no v_proj: zeros
    assert torch.count_nonzero(v[[0, 4]]) == 0 and torch.count_nonzero(v[[2, 3]]) > 0
    assert pool.apply("q_proj", x[:0], batch.weight_indices[:0]).shape == (0, 6)


@pytest.mark.parametrize(
    ("call", "exc", "msg"),
    [
        (lambda p, x, i: p.apply("k_proj", x, i), ValueError, "module must be one of"),
        (
            lambda p, x, i: p.apply("q_proj", x.float(), i),
            TypeError,
            "x must have dtype torch.float64",
        ),
        (
            lambda p, x, i: p.apply("q_proj", x[:, :3], i),
            ValueError,
            r"x must have shape \[\*, 8\]",
        ),
        (
            lambda p, x, i: p.apply("q_proj", x, i[:1]),
            ValueError,
            r"weight_indices must have shape \[2\]",
        ),
        (
            lambda p, x, i: p.apply("q_proj", x, i.int()),
            TypeError,
            "weight_indices must have dtype torch.int64",
        ),
        (
            lambda p, x, i: p.apply("q_proj", x, i + 5),
            ValueError,
            r"weight_indices must lie in \[0, 3\)",
        ),
        (lambda p, x, i: p.apply("q_proj", x.tolist(), i), TypeError, "x must be a torch.Tensor"),
    ],
)
def test_apply_arguments_are_validated(call, exc, msg) -> None:
    pool = make_pool(3)
    u = load(pool, "a")
    batch = pool.prepare_batch([u["a"], BASE_MODEL])
    x = torch.zeros(2, 8, dtype=torch.float64)
    with pytest.raises(exc, match=msg):
        call(pool, x, batch.weight_indices)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_overlap_loading_uses_pinned_host_memory_and_async_fills() -> None:
    pool = LoraMemoryPool(SHAPES, 4, 2, dtype=torch.float32, device="cuda", overlap_loading=True)
    gen = torch.Generator().manual_seed(8)
    a = pool.add_adapter("a", make_adapter(gen, 3, dtype=torch.float32))
    b = pool.add_adapter("b", make_adapter(gen, 2, ("q_proj",), dtype=torch.float32))
    assert all(w.is_pinned() for pair in pool.adapter(a).weights.values() for w in pair)
    c = pool.add_adapter("c", make_adapter(gen, 4, dtype=torch.float32))
    rows = [a, b, a]
    batch = pool.prepare_batch(rows)
    assert batch.weight_indices.device.type == "cuda"
    x = torch.randn(3, 8, device="cuda")
    y = pool.apply("q_proj", x, batch.weight_indices)  # same stream: ordered after the fills
    for i, uid in enumerate(rows):
        want = pool.adapter(uid).delta("q_proj", x[i : i + 1].cpu())[0]
        assert torch.allclose(y[i].cpu(), want, atol=1e-5)
    pool.prepare_batch([c, BASE_MODEL])  # evicts both, async fills again
    torch.cuda.synchronize()
    pool.check()
    pool.check_weights()


def test_a_uid_identifies_the_adapters_content_across_pools() -> None:
    """Two pools (a restart, or a second engine on one L3 store) each issue serial 0 to their
    first adapter ``a``: different weights give different uids, and so different L3 seeds;
    the same weights give the same uid. Before: both were ``LoraUid('a', 0)``."""
    gen = torch.Generator().manual_seed(11)
    first = make_adapter(gen, 2)
    changed = LoraAdapter({m: (a.clone(), b.clone()) for m, (a, b) in first.weights.items()},
                          first.scaling)
    changed.weights["v_proj"][1][0, 0] += 1e-12  # one weight, one ulp-scale change
    u1 = make_pool().add_adapter("a", first)
    u2 = make_pool().add_adapter("a", changed)
    u3 = make_pool().add_adapter("a", first)
    assert (u1.name, u1.serial) == (u2.name, u2.serial) == ("a", 0)
    assert u1 != u2 and hash(u1) != hash(u2) and u1 == u3
    assert chain_seed("t", u1) != chain_seed("t", u2) and chain_seed("t", u1) == chain_seed("t", u3)
    assert len(u1.digest) == 64 and u1.digest == first.digest()  # (float64 pool: same bytes)
    scaled = LoraAdapter(dict(first.weights), 0.25)
    assert make_pool().add_adapter("a", scaled) != u1  # the config (scaling) counts too


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_an_adapter_with_non_finite_weights_is_refused(bad: float) -> None:
    gen = torch.Generator().manual_seed(12)
    good = make_adapter(gen, 2)
    a, b = good.weights["q_proj"]
    b = b.clone()
    b[3, 1] = bad
    with pytest.raises(ValueError, match=r"weights\['q_proj'\].B must be finite, got 1 NaN / inf"):
        LoraAdapter({"q_proj": (a, b)}, 0.5)
