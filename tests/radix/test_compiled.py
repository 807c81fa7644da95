"""The two C hot loops against the Python code they replace (and fall back to).

The slot claim (components/_claim.c) and the numpy claim: both run on the same component
state and the same candidate slots (drawn from the allocator's handed-out slots, the tree's own
slots, free slots, out-of-range ids, repeats and pages out of order, and long runs of
consecutive slots, which the C pass checks and marks as ranges); they must agree on whether the claim is refused, with which message, on the marks left
behind and on the copy returned. A few hand-built cases pin the expected answer itself.

The walk's key comparison (radix/_match.c) and the Python binary search: the same length for
every segment, key, position and limit, checked against a token-by-token count. The walk's
loop (radix/_match.c walk_from) and its Python reference: the same path, partial node and
lengths over drawn trees, the matched length checked against a count by hand.
"""

from __future__ import annotations

from array import array

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import components.kv as kv_mod
import radix.tree as tree_mod
from allocators import PagedAllocator, TokenAllocator
from components.kv import KVComponent

needs_claim_c = pytest.mark.skipif(kv_mod._claim_c is None, reason="C claim not built")
needs_match_c = pytest.mark.skipif(
    tree_mod.common_prefix_len is tree_mod._common_prefix_len_py, reason="C match not built"
)

SIZE = 64


def _component(ps: int) -> tuple[KVComponent, torch.Tensor, torch.Tensor]:
    """A component over a fresh allocator: half the pool handed out, a quarter of it (the
    first pages) already held by the tree. Returns (component, held slots, caller's slots)."""
    alloc = TokenAllocator(SIZE) if ps == 1 else PagedAllocator(SIZE, ps)
    kv = KVComponent(alloc, lambda n: (n.id,))
    out = alloc.alloc(SIZE // 2)
    assert out is not None
    tree = out[: SIZE // 4]
    kv.claim(tree)
    return kv, tree, out[SIZE // 4 :]


def _run(kv: KVComponent, slots: torch.Tensor,
         use_c: bool) -> tuple[str | None, np.ndarray | None, list[int] | None]:
    """Claim ``slots`` with a copy: (error message or None, held-mark booleans, copy)."""
    with pytest.MonkeyPatch.context() as m:
        if not use_c:
            m.setattr(kv_mod, "_claim_c", None)
        try:
            got = kv.claim(slots, copy=True)
        except ValueError as e:
            return str(e), kv.held_mask(), None
    assert got is not None
    return None, kv.held_mask(), got.tolist()


def _run_both(kv_c: KVComponent, kv_np: KVComponent,
              slots: list[int]) -> tuple[str | None, list[int] | None]:
    """Claim ``slots`` in twin components, one through the C pass and one through numpy;
    assert the same answer, held marks and copy, and return (error message or None, copy)."""
    value = torch.tensor(slots, dtype=torch.int64)
    err_c, held_c, copy_c = _run(kv_c, value, True)
    err_np, held_np, copy_np = _run(kv_np, value, False)
    assert err_c == err_np
    assert held_c is not None and held_np is not None and (held_c == held_np).all()
    assert copy_c == copy_np
    return err_c, copy_c


@needs_claim_c
@pytest.mark.parametrize("ps", [1, 4])
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_c_claim_agrees_with_numpy(ps: int, data: st.DataObject) -> None:
    kv_c, tree, mine = _component(ps)
    kv_np, _, _ = _component(ps)
    pools = [
        mine.tolist(),  # the caller's: adoptable
        tree.tolist(),  # the tree's: refused
        list(range(SIZE // 2 + ps, SIZE + ps)),  # free: refused
        [0, -1, -ps, SIZE + ps, SIZE + 2 * ps, 1 << 40],  # out of range: refused
    ]
    if ps == 1:
        weights = data.draw(st.lists(st.integers(0, 3), min_size=0, max_size=24))
        slots = [data.draw(st.sampled_from(pools[w])) for w in weights]
    else:  # mostly whole pages in order; sometimes a page broken or shifted
        pages = data.draw(st.lists(st.integers(0, 3), min_size=0, max_size=6))
        slots = []
        for w in pages:
            first = data.draw(st.sampled_from(pools[w][::ps] if w < 3 else pools[3]))
            page = [first + j for j in range(ps)]
            if data.draw(st.integers(0, 9)) == 0:
                page[data.draw(st.integers(1, ps - 1))] += 1
            slots += page
    if slots and data.draw(st.booleans()):
        slots.append(slots[0])  # a repeat
        if ps > 1:
            slots += [slots[-1] + j for j in range(1, ps)]
    err_c, copy_c = _run_both(kv_c, kv_np, slots)
    if err_c is None:
        assert copy_c == slots


RUN_POOL = 256


@needs_claim_c
@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_c_claim_of_runs_agrees_with_numpy(data: st.DataObject) -> None:
    # Long runs of consecutive slots (checked and marked as ranges in C) at any offset and
    # length, some crossing a slot the tree holds, a free slot or the pool's end, some
    # repeating an earlier run: the same answer, marks and copy as the numpy claim.
    def make() -> tuple[KVComponent, list[int]]:
        alloc = TokenAllocator(RUN_POOL)
        kv = KVComponent(alloc, lambda n: (n.id,))
        out = alloc.alloc(RUN_POOL - 16)  # slots RUN_POOL - 15 .. RUN_POOL stay free
        assert out is not None
        held = out[100:103]  # three slots inside the handed-out range: the tree's
        kv.claim(held)
        return kv, held.tolist()

    kv_c, held = make()
    kv_np, _ = make()
    slots: list[int] = []
    for _ in range(data.draw(st.integers(1, 4), label="runs")):
        first = data.draw(st.integers(-2, RUN_POOL + 2), label="first")
        length = data.draw(st.integers(1, 80), label="length")
        slots += range(first, first + length)
    err_c, copy_c = _run_both(kv_c, kv_np, slots)
    fits = all(1 <= s <= RUN_POOL - 16 for s in slots) and not set(slots) & set(held)
    assert (err_c is None) == (fits and len(set(slots)) == len(slots))
    if err_c is None:
        assert copy_c == slots


@needs_claim_c
def test_refusal_leaves_no_mark_and_copy_is_independent() -> None:
    kv, tree, mine = _component(1)
    before = kv.held_mask()
    bad = torch.cat([mine[:5], tree[:1]])  # five adoptable slots, then one the tree holds
    with pytest.raises(ValueError, match=f"slot {int(tree[0])} .* already holds it"):
        kv.claim(bad, copy=True)
    assert (kv.held_mask() == before).all()  # the five marks set before the refusal are undone
    value = mine[:8].clone()
    own = kv.claim(value, 2, 6, copy=True)
    assert own is not None and own.tolist() == mine[2:6].tolist()
    value[2] = 0  # the caller's later writes never reach the tree's copy
    assert own.tolist() == mine[2:6].tolist()
    held = kv.held_mask()
    assert held is not None
    assert held[mine[2:6].numpy()].all() and not held[mine[:2].numpy()].any()


def test_claim_refuses_bad_arguments() -> None:
    kv, _, mine = _component(1)
    with pytest.raises(TypeError, match="int64 CPU tensor"):
        kv.claim(mine.to(torch.int32))
    with pytest.raises(TypeError, match="int64 CPU tensor"):
        kv.claim(mine.numpy())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="claim range"):
        kv.claim(mine, 3, len(mine) + 1)
    strided = mine[::2]  # not contiguous: claimed through a contiguous copy
    own = kv.claim(strided, copy=True)
    assert own is not None and own.tolist() == mine[::2].tolist()


@needs_claim_c
@pytest.mark.parametrize("ps", [1, 4])
def test_c_unmark_clears_exactly_the_node_slots(ps: int) -> None:
    # three claims; releasing the middle one (C) leaves the other two marked, as the numpy
    # release of the same slots does on a twin component
    kv_c, _, mine = _component(ps)
    kv_np, _, _ = _component(ps)
    parts = [mine[: 2 * ps], mine[2 * ps : 5 * ps], mine[5 * ps : 6 * ps]]
    for kv in (kv_c, kv_np):
        for part in parts:
            kv.claim(part)
    kv_c._unmark(parts[1])
    with pytest.MonkeyPatch.context() as m:
        m.setattr(kv_mod, "_unmark_c", None)
        kv_np._unmark(parts[1])
    assert (kv_c._held == kv_np._held).all()  # the same bits
    held = kv_c.held_mask()
    assert held is not None

    def ids(t: torch.Tensor) -> np.ndarray:
        return (t[::ps] // ps).numpy()

    assert not held[ids(parts[1])].any()
    assert held[ids(parts[0])].all() and held[ids(parts[2])].all()
    assert int(held.sum()) == len(ids(parts[0])) + len(ids(parts[2])) + SIZE // 4 // ps


@needs_claim_c
@pytest.mark.parametrize("seed", range(20))
def test_c_unmark_of_runs_clears_what_the_numpy_release_clears(seed: int) -> None:
    # slots in runs of every length around the run threshold and word boundaries, in random
    # order (some single ids, some runs of hundreds): the C pass clears runs as bit ranges,
    # the reference clears bit by bit; the bits around each run must stay set
    from components._claim import unmark

    rng = np.random.default_rng(seed)
    num_ids = 4096
    ids = rng.permutation(np.arange(1, num_ids))
    chunks, pos = [], 0
    while pos < len(ids) // 2:
        n = int(rng.choice([1, 2, 7, 8, 15, 16, 17, 63, 64, 65, 300]))
        start = int(rng.integers(1, num_ids - n))
        chunks.append(np.arange(start, start + n))
        pos += n
    slots = np.unique(np.concatenate(chunks))  # distinct ids, mostly in runs
    rng.shuffle(chunks)
    order = np.concatenate(chunks)
    _, first = np.unique(order, return_index=True)
    order = order[np.sort(first)]  # the runs in random order, each id once
    assert sorted(order.tolist()) == slots.tolist()
    held_c = np.full((num_ids + 8) // 8, 0xFF, dtype=np.uint8)
    held_np = held_c.copy()
    value = torch.from_numpy(order.astype(np.int64))
    unmark(value.data_ptr(), len(value), 1, held_c)
    np.bitwise_and.at(held_np, order >> 3, ~np.left_shift(1, order & 7).astype(np.uint8))
    assert (held_c == held_np).all()


@needs_claim_c
def test_c_unmark_refuses_an_id_outside_the_marks() -> None:
    from components._claim import unmark

    kv, _, mine = _component(1)
    kv.claim(mine[:3])
    held = kv._held
    assert held is not None
    before = held.copy()
    bad = torch.tensor([int(mine[0]), 8 * len(held)], dtype=torch.int64)  # one past the bits
    with pytest.raises(ValueError, match="outside the held marks"):
        unmark(bad.data_ptr(), 2, 1, held)
    assert (held == before).all()  # nothing cleared


@needs_match_c
@settings(max_examples=500, deadline=None)
@given(
    seg=st.lists(st.integers(0, 3), max_size=40),
    key=st.lists(st.integers(0, 3), max_size=60),
    data=st.data(),
)
def test_c_common_prefix_len_agrees(seg: list[int], key: list[int], data: st.DataObject) -> None:
    pos = data.draw(st.integers(0, len(key)))
    limit = data.draw(st.integers(0, min(len(seg), len(key) - pos)))
    a, b = array("q", seg), array("q", key)
    expect = 0  # token by token
    while expect < limit and seg[expect] == key[pos + expect]:
        expect += 1
    assert tree_mod.common_prefix_len(a, b, pos, limit) == expect
    assert tree_mod._common_prefix_len_py(a, b, pos, limit) == expect


@needs_match_c
def test_c_common_prefix_len_refuses_out_of_range() -> None:
    a, b = array("q", [1, 2, 3]), array("q", [1, 2, 3, 4])
    assert tree_mod.common_prefix_len(a, b, 1, 0) == 0
    assert tree_mod.common_prefix_len(a, b, 0, 3) == 3
    with pytest.raises(ValueError, match="outside a buffer"):
        tree_mod.common_prefix_len(a, b, 2, 3)  # key[2:5] is past the key's end
    with pytest.raises(ValueError, match="outside a buffer"):
        tree_mod.common_prefix_len(a, b, 0, 4)  # seg[:4] is past the segment's end
    with pytest.raises(TypeError, match="int64"):
        tree_mod.common_prefix_len(array("i", [1]), b, 0, 1)


needs_walk_c = pytest.mark.skipif(
    tree_mod.walk_from is tree_mod._walk_from_py, reason="C walk not built"
)


def _tree_of(keys: list[list[int]], ps: int) -> tree_mod.RadixTree:
    """A tree holding ``keys`` (each cut to whole pages), built with the tree's own add_leaf
    and split, without any component: a reference insert over :meth:`RadixTree.walk`."""
    tree = tree_mod.RadixTree(ps, lambda upper, lower, n: None)
    for k in keys:
        key = array("q", k)
        end = len(key) - len(key) % ps
        w = tree.walk(key, end, None)
        last = w.path[-1] if w.path else tree.root
        if w.partial is not None:
            last = tree.split(w.partial, w.partial_len)
        if w.matched_len < end:
            tree.add_leaf(last, key[w.matched_len:end], None, 0)
    return tree


def _matched_by_hand(keys: list[list[int]], key: list[int], ps: int) -> int:
    """Longest whole-page prefix of ``key`` that some cached key (cut to whole pages) shares."""
    best = 0
    for k in keys:
        k = k[: len(k) - len(k) % ps]
        n = 0
        while n < min(len(k), len(key)) and k[n] == key[n]:
            n += 1
        best = max(best, n - n % ps)
    return best


@needs_walk_c
@settings(max_examples=60, deadline=None)
@given(ps=st.sampled_from([1, 2, 4]), data=st.data())
def test_c_walk_agrees_with_python_and_by_hand(ps: int, data: st.DataObject) -> None:
    tokens = st.lists(st.integers(0, 3), min_size=0, max_size=24)
    keys = data.draw(st.lists(tokens, min_size=1, max_size=8), label="cached")
    tree = _tree_of(keys, ps)
    probe = data.draw(st.one_of(st.sampled_from(keys), tokens), label="probe")
    key = array("q", probe)
    end = len(key) - len(key) % ps
    root_child = tree.root.children.get((None, key[0] if ps == 1 else key[0:ps].tobytes())) \
        if end else None
    got = tree_mod.walk_from(root_child, key, end, ps)
    assert got == tree_mod._walk_from_py(root_child, key, end, ps)
    path, partial, partial_len, matched = got
    assert matched == _matched_by_hand(keys, probe, ps)
    assert matched == (path[-1].depth if path else 0) + partial_len
    assert [n.parent for n in path] == [tree.root, *path][: len(path)]
    if partial is not None:
        assert 0 < partial_len < len(partial.key) and partial_len % ps == 0


@needs_walk_c
def test_c_walk_refuses_bad_arguments() -> None:
    tree = _tree_of([[1, 2, 3, 4]], 2)
    child = tree.root.children[(None, array("q", [1, 2]).tobytes())]
    key = array("q", [1, 2, 3, 4])
    assert tree_mod.walk_from(child, key, 4, 2) == ([child], None, 0, 4)
    assert tree_mod.walk_from(None, key, 4, 2) == ([], None, 0, 0)
    with pytest.raises(ValueError, match="page-multiple end inside the key"):
        tree_mod.walk_from(child, key, 6, 2)  # past the key's end
    with pytest.raises(ValueError, match="page-multiple end inside the key"):
        tree_mod.walk_from(child, key, 3, 2)  # not a page multiple
    with pytest.raises(ValueError, match="int64 key"):
        tree_mod.walk_from(child, array("i", [1, 2, 3, 4]), 4, 2)
    with pytest.raises(TypeError, match="int64 buffer"):
        tree_mod.walk_from(type("N", (), {"key": array("i", [1, 2])})(), key, 4, 2)
    with pytest.raises(AttributeError):
        tree_mod.walk_from(object(), key, 4, 2)


def test_compiled_says_which_loops_run_and_a_missing_one_warns_in_one_line() -> None:
    """``radix.compiled()`` and the import warning, in fresh interpreters: one with every loop
    this install built, one where ``radix._match`` cannot be imported (as without a compiler)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    code = "import json, radix; print(json.dumps(radix.compiled()))"
    built = {}
    for name in ("components._claim", "radix._match", "allocators._release"):
        try:
            __import__(name)
            built[name] = True
        except ImportError:
            built[name] = False
    run = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True,
                         check=True)
    assert json.loads(run.stdout) == built
    assert ("not built" in run.stderr) == (not all(built.values()))
    run = subprocess.run([sys.executable, "-c", "import sys; sys.modules['radix._match'] = None; "
                          + code], cwd=repo, capture_output=True, text=True, check=True)
    assert json.loads(run.stdout) == {**built, "radix._match": False}
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "radix._match" in lines[0] and "RuntimeWarning" in lines[0]
