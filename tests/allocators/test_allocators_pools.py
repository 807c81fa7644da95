"""KVPool and MambaStatePool: real tensors, bit-exact round trips, copy-on-write."""

from __future__ import annotations

import pytest
import torch

from allocators import KVPool, MambaStatePool, SlotAllocator


def t(*ids: int) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.int64)


# ---------------------------------------------------------------------- KVPool
def test_kv_pool_shapes_and_sizes() -> None:
    pool = KVPool(10, num_layers=3, num_heads=2, head_dim=8, dtype=torch.float16)
    assert pool.k_buffer(0).shape == (11, 2, 8) and pool.v_buffer(2).shape == (11, 2, 8)
    assert pool.k_buffer(1).dtype == torch.float16
    assert pool.bytes_per_token == 2 * 3 * 2 * 8 * 2
    assert pool.total_bytes == pool.bytes_per_token * 11
    assert KVPool(8, page_size=4).k_buffer(0).shape == (12, 2, 8)
    assert torch.count_nonzero(pool.k_all) == 0


def test_set_get_round_trip_is_bit_exact() -> None:
    gen = torch.Generator().manual_seed(0)
    pool = KVPool(16, num_layers=2, num_heads=2, head_dim=4, dtype=torch.bfloat16)
    slots = t(3, 7, 1, 16)
    k = torch.randn(4, 2, 4, generator=gen).to(torch.bfloat16)
    v = torch.randn(4, 2, 4, generator=gen).to(torch.bfloat16)
    pool.set_kv(1, slots, k, v)
    k2, v2 = pool.get_kv(1, slots)
    assert torch.equal(k2.view(torch.int16), k.view(torch.int16))
    assert torch.equal(v2.view(torch.int16), v.view(torch.int16))
    assert torch.equal(pool.k_buffer(1)[7], k[1])
    # Layer 0 and untouched slots stay zero.
    assert torch.count_nonzero(pool.k_buffer(0)) == 0
    assert torch.count_nonzero(pool.v_buffer(1)[t(2, 4, 5)]) == 0
    # get_kv returns copies.
    k2.zero_()
    assert torch.equal(pool.get_kv(1, slots)[0], k)


def test_copy_slots_copies_every_layer_and_handles_overlap() -> None:
    pool = KVPool(6, num_layers=3, num_heads=1, head_dim=2, dtype=torch.float32)
    for layer in range(3):
        vals = torch.arange(7, dtype=torch.float32)[:, None, None].expand(7, 1, 2) + 10 * layer
        pool.set_kv(layer, torch.arange(7), vals.clone(), -vals.clone())
    pool.copy_slots(t(1, 2), t(2, 3))  # overlapping: reads happen before writes
    for layer in range(3):
        k = pool.k_buffer(layer)[:, 0, 0].tolist()
        v = pool.v_buffer(layer)[:, 0, 0].tolist()
        base = 10 * layer
        assert k == [base + x for x in (0, 1, 1, 2, 4, 5, 6)]
        assert v == [-(base + x) for x in (0, 1, 1, 2, 4, 5, 6)]


@pytest.mark.parametrize(
    ("call", "exc", "msg"),
    [
        (lambda p: p.copy_slots(t(1, 2), t(3)), ValueError, "src_slots has 2"),
        (lambda p: p.copy_slots(t(1, 2), t(3, 3)), ValueError, "dst_slots repeats"),
        (lambda p: p.copy_slots(t(1), t(5)), ValueError, "dst_slots: index 5"),
        (lambda p: p.copy_slots(t(1).int(), t(2)), TypeError, "src_slots"),
        (lambda p: p.get_kv(2, t(1)), ValueError, "layer=2"),
        (lambda p: p.get_kv(0, t(-1)), ValueError, "slots: index -1"),
        (lambda p: p.get_kv(0, t(1).view(1, 1)), ValueError, "1-D"),
        (lambda p: p.set_kv(0, t(1), torch.zeros(1, 2, 8), torch.zeros(1, 2, 8)), TypeError, "k"),
        (
            lambda p: p.set_kv(
                0, t(1, 2), torch.zeros(1, 2, 8, dtype=torch.float16), torch.zeros(1, 2, 8)
            ),
            ValueError,
            "k has shape",
        ),
    ],
)
def test_kv_pool_misuse_raises_and_writes_nothing(call: object, exc: type, msg: str) -> None:
    pool = KVPool(4)
    pool.k_all.fill_(1.0)
    with pytest.raises(exc, match=msg):
        call(pool)  # type: ignore[operator]
    assert bool((pool.k_all == 1.0).all()) and torch.count_nonzero(pool.v_all) == 0


@pytest.mark.parametrize(
    ("kwargs", "exc", "name"),
    [
        ({"size": 0}, ValueError, "size"),
        ({"size": 4, "num_layers": 0}, ValueError, "num_layers"),
        ({"size": 4, "num_heads": -1}, ValueError, "num_heads"),
        ({"size": 4, "head_dim": 1.5}, TypeError, "head_dim"),
        ({"size": 4, "dtype": "float16"}, TypeError, "dtype"),
        ({"size": 4, "dtype": torch.int32}, ValueError, "dtype"),
        ({"size": 4, "device": None}, TypeError, "device"),
        ({"size": 4, "page_size": 0}, ValueError, "page_size"),
    ],
)
def test_kv_pool_bad_args(kwargs: dict[str, object], exc: type, name: str) -> None:
    with pytest.raises(exc, match=name):
        KVPool(**kwargs)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- MambaStatePool
def test_state_pool_shapes_and_allocator_contract() -> None:
    pool = MambaStatePool(3, num_layers=2, conv_state_shape=(4, 3), ssm_state_shape=(2, 4, 4))
    assert isinstance(pool, SlotAllocator) and pool.page_size == 1 and pool.size == 3
    assert pool.conv[1].shape == (4, 4, 3) and pool.ssm[0].shape == (4, 2, 4, 4)
    assert pool.bytes_per_slot == 2 * (12 + 32) * 4
    x = pool.alloc(2)
    assert x is not None and x.tolist() == [1, 2]
    assert pool.alloc(2) is None
    pool.free(t(1))
    y = pool.alloc(2)
    assert y is not None and y.tolist() == [3, 1]
    before = pool.snapshot()
    with pytest.raises(ValueError, match="double free"):
        pool.free(t(2, 2))
    with pytest.raises(ValueError, match="foreign index"):
        pool.free(t(0))
    assert pool.snapshot() == before
    pool.check()


def test_copy_on_write_leaves_source_bit_exact() -> None:
    gen = torch.Generator().manual_seed(1)
    pool = MambaStatePool(4, num_layers=2)
    tree_slot, req_slot = pool.alloc(2).tolist()  # type: ignore[union-attr]
    for layer in range(2):
        pool.set_state(
            tree_slot, layer, torch.randn(4, 3, generator=gen), torch.randn(2, 4, 4, generator=gen)
        )
    saved = [pool.get_state(tree_slot, layer) for layer in range(2)]
    pool.copy(tree_slot, req_slot)
    for layer in range(2):
        conv, ssm = pool.get_state(req_slot, layer)
        assert torch.equal(conv, saved[layer][0]) and torch.equal(ssm, saved[layer][1])
    # The engine mutates its own copy in place; the tree's state must not move.
    pool.conv[:, req_slot] += 1.0
    pool.ssm[1][req_slot].mul_(3.0)
    for layer in range(2):
        conv, ssm = pool.get_state(tree_slot, layer)
        assert torch.equal(conv, saved[layer][0]) and torch.equal(ssm, saved[layer][1])


def test_copy_of_int_slots_checks_both_and_writes_nothing_when_refused() -> None:
    pool = MambaStatePool(4, num_layers=2)
    a, b = pool.alloc(2).tolist()  # type: ignore[union-attr]
    pool.conv[:, a] = 7.0
    pool.ssm[:, a] = -2.0
    pool.copy(a, b)  # the int fast path: the same result as the tensor path
    assert torch.equal(pool.conv[:, b], pool.conv[:, a]) and torch.equal(pool.ssm[:, b], pool.ssm[:, a])
    free = next(s for s in range(1, 5) if s not in (a, b))
    before = (pool.conv.clone(), pool.ssm.clone())
    with pytest.raises(ValueError, match=f"src: state slot {free} is not allocated"):
        pool.copy(free, b)
    with pytest.raises(ValueError, match=f"dst: state slot {free} is not allocated"):
        pool.copy(a, free)
    with pytest.raises(ValueError, match="dst: foreign index: state slot 9"):
        pool.copy(a, 9)
    with pytest.raises(TypeError, match="src"):
        pool.copy(True, b)  # type: ignore[arg-type]
    assert torch.equal(pool.conv, before[0]) and torch.equal(pool.ssm, before[1])


def test_batched_copy_and_alloc_zeroes_state() -> None:
    pool = MambaStatePool(4, num_layers=1, conv_state_shape=(2,), ssm_state_shape=(1,))
    assert pool.alloc(4) is not None
    pool.conv[0, 1:] = torch.tensor([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0], [4.0, 4.0]])
    pool.copy(t(1, 2), t(3, 4))
    assert pool.conv[0, :, 0].tolist() == [0.0, 1.0, 2.0, 1.0, 2.0]
    pool.free(t(3))
    (slot,) = pool.alloc(1).tolist()  # type: ignore[union-attr]
    assert slot == 3 and pool.conv[0, 3].tolist() == [0.0, 0.0]


@pytest.mark.parametrize(
    ("call", "exc", "msg"),
    [
        (lambda p: p.copy(1, 3), ValueError, "dst: state slot 3 is not allocated"),
        (lambda p: p.copy(0, 2), ValueError, "src: foreign index"),
        (lambda p: p.copy(1, 9), ValueError, "dst: foreign index"),
        (lambda p: p.copy(t(1, 2), t(2)), ValueError, "src has 2 slots"),
        (lambda p: p.copy(t(1, 1), t(2, 2)), ValueError, "dst repeats"),
        (lambda p: p.copy(t(1).int(), t(2)), TypeError, "src"),
        (lambda p: p.copy(1.0, 2), TypeError, "src"),
        (lambda p: p.get_state(3, 0), ValueError, "not allocated"),
        (lambda p: p.get_state(1, 2), ValueError, "layer=2"),
        (lambda p: p.set_state(1, 0, torch.zeros(4, 3), torch.zeros(2, 4)), ValueError, "ssm"),
        (
            lambda p: p.set_state(1, 0, torch.zeros(4, 3).double(), torch.zeros(2, 4, 4)),
            TypeError,
            "conv has dtype",
        ),
    ],
)
def test_state_pool_misuse_raises_and_writes_nothing(call: object, exc: type, msg: str) -> None:
    pool = MambaStatePool(4)
    pool.alloc(2)  # slots 1, 2 in use
    pool.conv.fill_(7.0)
    before = pool.snapshot()
    with pytest.raises(exc, match=msg):
        call(pool)  # type: ignore[operator]
    assert pool.snapshot() == before
    assert bool((pool.conv == 7.0).all()) and torch.count_nonzero(pool.ssm) == 0


@pytest.mark.parametrize(
    ("kwargs", "exc", "name"),
    [
        ({"size": 0}, ValueError, "size"),
        ({"size": 2, "num_layers": 0}, ValueError, "num_layers"),
        ({"size": 2, "conv_state_shape": ()}, ValueError, "conv_state_shape"),
        ({"size": 2, "ssm_state_shape": (2, 0)}, ValueError, "ssm_state_shape"),
        ({"size": 2, "ssm_state_shape": 4}, TypeError, "ssm_state_shape"),
        ({"size": 2, "dtype": torch.int8}, ValueError, "dtype"),
    ],
)
def test_state_pool_bad_args(kwargs: dict[str, object], exc: type, name: str) -> None:
    with pytest.raises(exc, match=name):
        MambaStatePool(**kwargs)  # type: ignore[arg-type]
