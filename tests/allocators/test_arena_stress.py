"""MemoryArena under seeded random operations: the kept counts (chunks per kind, free KV
pages per chunk, free and used ids) against a recount from the owners and the masks after
every step, and every refused operation leaving the arena exactly as it was.

Shapes as in ``test_arena.py``: 3 KV pages of 2 tokens per chunk; a budget of 40 chunks, so
that single-id frees and withdrawals take the per-id count update and runs of ids the
per-group one (``_LowestFirst._count``)."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from allocators.arena import KV as KV_OWNER
from allocators.arena import STATE, KVShape, MemoryArena, StateShape

KV = KVShape(num_layers=2, num_heads=2, head_dim=4, dtype=torch.float16, page_size=2)
ST = StateShape(num_layers=2, conv_state_shape=(4, 3), ssm_state_shape=(2, 4, 4))
CHUNK = 384  # 3 pages of 128 B


def snap(a: MemoryArena) -> tuple[object, ...]:
    return (a.kv_allocator.snapshot(), a.state_pool.snapshot(), a.owner.tobytes(),
            a.kv_allocator.lowest.group_free.tolist(), a.num_state_chunks)


def recounted(a: MemoryArena) -> tuple[int, int, list[int]]:
    """(KV chunks, state chunks, free KV pages per chunk) from the owners and the mask."""
    owner = a.owner.tolist()
    mask = a.kv_allocator.free_mask.reshape(a.num_chunks, a.pages_per_chunk)
    per = [int(mask[c].sum()) for c in range(a.num_chunks)]
    return owner.count(KV_OWNER), owner.count(STATE), per


OPS = st.lists(st.tuples(st.sampled_from(["kv", "free", "state", "sfree", "to_state",
                                          "to_kv", "move"]),
                         st.integers(0, 10 ** 6)), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None)
@given(OPS, st.integers(0, 39))
def test_counts_follow_every_operation(ops: list[tuple[str, int]], state_slots: int) -> None:
    a = MemoryArena(39 * CHUNK, KV, ST, state_slots=state_slots)
    kv, sp = a.kv_allocator, a.state_pool
    runs: list[list[int]] = []  # KV page ids handed out, per alloc
    slots: list[int] = []
    for op, x in ops:
        rng = np.random.default_rng(x)
        before = snap(a)
        if op == "kv":
            got = kv.alloc(2 * int(rng.integers(1, 12)))
            if got is not None:
                runs.append((got[::2] // 2).tolist())
        elif op == "free" and runs:
            run = runs.pop(x % len(runs))
            keep = run[: int(rng.integers(0, len(run)))]  # free the tail, keep the head
            kv.free(torch.tensor([p * 2 + i for p in run[len(keep):] for i in (0, 1)],
                                 dtype=torch.int64))
            if keep:
                runs.append(keep)
        elif op == "state":
            got = sp.alloc(1)
            if got is not None:
                slots.append(int(got[0]))
        elif op == "sfree" and slots:
            sp.free_slot(slots.pop(x % len(slots)))
        elif op in ("to_state", "to_kv"):
            n = int(rng.integers(0, 4))
            move = a.kv_to_state if op == "to_state" else a.state_to_kv
            if not move(n):
                assert snap(a) == before  # refused: nothing changed
        elif op == "move" and runs:
            i = x % len(runs)
            src = np.array(runs[i], dtype=np.int64)
            chunks = np.unique(src // a.pages_per_chunk)
            dst = a.lowest_free_kv_pages(src.size, chunks)
            if dst is not None:
                a.relocate_kv_pages(np.sort(src), dst)
                order = np.argsort(src)
                moved = np.empty_like(src)
                moved[order] = dst
                runs[i] = moved.tolist()
            bad = np.array([runs[i][0]] * 2, dtype=np.int64)  # a repeat: refused
            now = snap(a)
            try:
                a.relocate_kv_pages(bad, bad)
            except ValueError:
                pass
            else:
                raise AssertionError("a repeated page was accepted")
            assert snap(a) == now
        num_kv, num_state, per = recounted(a)
        assert (a.num_kv_chunks, a.num_state_chunks) == (num_kv, num_state)
        assert num_kv + num_state == a.num_chunks - 1
        assert kv.lowest.group_free.tolist() == per
        assert kv.owned_size() == num_kv * a.tokens_per_chunk and sp.owned_size() == num_state
        a.check()
