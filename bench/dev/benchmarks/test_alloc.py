"""Allocator alloc / free cost (pytest-benchmark).

    python -m pytest bench/dev/benchmarks/test_alloc.py --benchmark-only --benchmark-group-by=func

* ``alloc_free``: ``PAIRS`` pairs of ``alloc(n)`` + ``free`` of what it returned, for a
  token allocator (page 1) and a paged one (page 16), at several request sizes ``n`` and pool
  sizes (the pool size must not matter: both are O(n)).
* ``free_scattered``: freeing ``n`` slots spread over the pool (whole pages, shuffled), as an
  eviction frees leaves allocated at different times; then re-allocating them (setup).
* ``free_views``: freeing ``PAIRS`` small slices of one big index tensor, the way the cache
  frees a node's ``kv_value`` (a view of its request's slots) on eviction: the per-call
  overhead that dominates ``evict`` on the anchor workloads.
* ``state_alloc_free``: ``MambaStatePool`` one-slot ``alloc`` (zeroes the slot's tensors)
  + ``free`` pairs, with a small and a realistic per-slot state size.
"""

from __future__ import annotations

import pytest
import torch

from allocators import MambaStatePool, PagedAllocator, TokenAllocator

PAIRS = 200


def make(kind: str, size: int):
    return TokenAllocator(size) if kind == "token" else PagedAllocator(size, 16)


kinds = pytest.mark.parametrize("kind", ["token", "paged16"])


@kinds
@pytest.mark.parametrize("pool", [1 << 20, 1 << 24])
@pytest.mark.parametrize("n", [16, 1024, 8192])
def test_alloc_free(benchmark, kind: str, pool: int, n: int) -> None:
    a = make(kind, pool)

    def run() -> None:
        for _ in range(PAIRS):
            a.free(a.alloc(n))

    benchmark.extra_info["ops_per_round"] = PAIRS
    benchmark.pedantic(run, rounds=10, iterations=1, warmup_rounds=1)


@kinds
@pytest.mark.parametrize("n", [1024, 65536])
def test_free_scattered(benchmark, kind: str, n: int) -> None:
    pool = 1 << 22
    a = make(kind, pool)
    ps = 1 if kind == "token" else 16

    def setup():
        a.clear()
        everything = a.alloc(pool)
        pages = everything.view(-1, ps)
        pick = torch.randperm(pages.shape[0], generator=torch.Generator().manual_seed(0))[: n // ps]
        victims = pages[pick].reshape(-1).clone()
        return (victims,), {}

    def run(victims: torch.Tensor) -> None:
        a.free(victims)

    benchmark.pedantic(run, setup=setup, rounds=5, iterations=1)


@kinds
@pytest.mark.parametrize("node_len", [16, 256])
def test_free_views(benchmark, kind: str, node_len: int) -> None:
    a = make(kind, 1 << 22)

    def setup():
        a.clear()
        base = a.alloc(PAIRS * node_len)
        return ([base[i * node_len:(i + 1) * node_len] for i in range(PAIRS)],), {}

    def run(views: list[torch.Tensor]) -> None:
        for v in views:
            a.free(v)

    benchmark.extra_info["ops_per_round"] = PAIRS
    benchmark.pedantic(run, setup=setup, rounds=10, iterations=1)


@pytest.mark.parametrize("state", ["tiny", "2MiB"])
def test_state_alloc_free(benchmark, state: str) -> None:
    if state == "tiny":
        pool = MambaStatePool(1024, num_layers=1, conv_state_shape=(1,), ssm_state_shape=(1,))
    else:  # 8 layers x (conv 4x1024 + ssm 16x64x64) fp32 ~ 2.1 MiB per slot
        pool = MambaStatePool(64, num_layers=8, conv_state_shape=(4, 1024),
                              ssm_state_shape=(16, 64, 64))

    def run() -> None:
        for _ in range(PAIRS):
            slots = pool.alloc(1)
            assert slots is not None  # 1 slot out of a free pool
            pool.free(slots)

    benchmark.extra_info["ops_per_round"] = PAIRS
    benchmark.pedantic(run, rounds=10, iterations=1, warmup_rounds=1)
