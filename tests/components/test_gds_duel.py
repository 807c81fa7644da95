"""The duel inside ``gds_adaptive`` (components/gds_duel.py, components/gds_adaptive.py): one
GreedyDual order per candidate, virtual victims and retained ghosts, the ghosts a later match
finds, the charge that moves the lead, and the KV-leaf order. Exact orders by hand."""

from __future__ import annotations

import gc
import random

import pytest

from components.gds_adaptive import LEAF, SPINE, AdaptiveGDSStrategy
from components.gds_duel import Ghosts, GreedyDualHeap, KVOrderDuel
from radix.node import TreeNode
from tests.helpers.gds_helpers import make, put

_ids = iter(range(1, 1 << 30))


def chain(*depths: int, parent: TreeNode | None = None) -> list[TreeNode]:
    """Detached nodes one below the other ending at ``depths``, under ``parent`` (a fresh
    root if ``None``), with ids unique in this module."""
    root = TreeNode(0, 0) if parent is None else parent
    out, p = [], root
    for d in depths:
        n = TreeNode(next(_ids), 0)
        n.parent, n.depth = p, d
        p.children = {**p.children, n.id: n}  # (a leaf shares the read-only NO_CHILDREN)
        out.append(n)
        p = n
    return out


def heap_over(live: dict[int, TreeNode]) -> GreedyDualHeap:
    """GDS with d = 1, e = 0: cost = depth - the nearest live ancestor's depth."""

    def cost(n: TreeNode) -> float:
        p = n.parent
        while p is not None and p.parent is not None and p.id not in live:
            p = p.parent
        return float(n.depth - (p.depth if p is not None and p.parent is not None else 0))

    return GreedyDualHeap("gds", lambda nid: 1.0, cost)


def test_greedy_dual_heap_worked_example() -> None:
    """The worked example of GDS: A at 100, B at 300 below A, C at 250 on another branch.
    A (100) goes and the watermark becomes 100; B's entry (200) is stale, its true priority 300 (rebuilt from
    the root now) is pushed back; C (250) goes (watermark 250); then B."""
    a, b = chain(100, 300)
    (c,) = chain(250, parent=a.parent)
    live = {n.id: n for n in (a, b, c)}
    h = heap_over(live)
    for n in (a, b, c):
        h.add(n)
    assert [h.true_priority(n) for n in (a, b, c)] == [100.0, 200.0, 250.0]
    order = []
    for _ in range(3):
        v = h.pop(live, lambda n: True, virtual=False)
        assert isinstance(v, TreeNode)
        order.append(v.depth)
        h.remove(v.id)
        del live[v.id]
        if v is a:
            assert h.watermark == 100.0 and h.true_priority(b) == 300.0
    assert order == [100, 250, 300] and h.watermark == 300.0


def test_virtual_pops_exclude_readmit_and_retained_ghosts() -> None:
    """A virtual victim stays in the pool but leaves this order (excluded) until readmitted;
    a retained ghost competes at the priority it left with; balance = ghosts - exclusions."""
    a, b = chain(10, 40)
    live = {a.id: a, b.id: b}
    h = heap_over(live)
    h.add(a)
    h.add(b)
    h.retain(-1, 25.0)
    assert h.balance == 1
    v = h.pop(live, lambda n: True, virtual=True)
    assert v is a and a.id in h.excluded and h.balance == 0
    assert h.pop(live, lambda n: True, virtual=True) == -1  # the ghost (25) before b (30)
    assert h.balance == -1 and not h.retained
    h.readmit(a)
    assert not h.excluded
    h.check([a, b])
    assert h.pop(live, lambda n: n is not a, virtual=True) is b  # a held back (not a candidate)
    assert h.pop(live, lambda n: True, virtual=True) is a


def test_ghosts_found_through_the_kv_path_and_the_key() -> None:
    """An internal state's ghost is its node, found on a later match's KV path; a leaf's is
    found through the key (its anchor, first and last token), and only for a key that agrees
    with both; a ghost whose anchor leaves the tree is dropped."""
    cache, kv, pool = make(policy="gds")
    P = list(range(1, 201))
    mid, _ = put(cache, kv, pool, P[:100])
    leaf, _ = put(cache, kv, pool, P)
    dropped: list[int] = []
    g = Ghosts(dropped.append)
    g_mid = g.add(mid, 0b01)
    g_leaf = g.add(leaf, 0b10)
    assert g_mid == -1 and g_leaf == -2 and len(g) == 2
    # the leaf's anchor is mid (it has a state): first token after mid is 101, last is 200
    assert g.records[g_leaf][1:] == [200, mid.id, 101, 200]
    assert g.match(mid, None, P + [7], 201) == (g_leaf, 200)  # the deepest
    assert g.match(mid, None, P[:199] + [999, 7], 201) == (g_mid, 100)  # last token differs
    assert g.match(mid, mid, P + [7], 201) == (g_leaf, 200)  # consumed at the anchor
    g.release(g_leaf)
    assert dropped == [g_leaf] and len(g) == 1
    g.forget(mid)  # a state cached on mid again
    assert dropped == [g_leaf, g_mid] and len(g) == 0


def test_ghost_of_a_removed_anchor_is_dropped() -> None:
    """The table holds its anchors weakly: once the tree lets go of one (and nothing else
    holds it), its ghosts go."""
    cache, kv, pool = make(policy="gds")
    anchor, _ = put(cache, kv, pool, list(range(1, 51)))
    dropped: list[int] = []
    g = Ghosts(dropped.append)
    node, _ = put(cache, kv, pool, list(range(1, 51)) + [60, 61])
    gid = g.add(node, 1)  # anchored at ``anchor`` (it holds a state)
    assert g.records[gid][2] == anchor.id
    del anchor, node
    while cache.state.slot_to_node:  # type: ignore[union-attr]
        cache.evict_states(1)
    gc.collect()
    assert dropped == [gid] and len(g) == 0


def test_the_lead_moves_to_the_order_charged_less() -> None:
    """d = 1, e = 0, four state slots. One prompt's chunk checkpoints at 100, 200, 300 and
    its end at 320: spines, nearly weightless once they have been watched for long without a
    hit. The signals order evicts the spine at 100 (weight ~0, first in), gds would evict the
    end state (20 over 300, excluded in its own pool). A request then forks at 150: it would
    have consumed the spine at 100 (100 tokens, charged to signals); nobody needed gds's
    choice. One such mistake is no evidence while the mean matched key is longer (151): the
    lead stays. After three one-token lookups the mean is (151 + 3) / 4 = 38.5 and at the next
    store gds leads, every order back on the real pool."""
    cache, kv, pool = make(policy="gds_adaptive", states=4)
    walk = cache.state.gds
    assert isinstance(walk, AdaptiveGDSStrategy)
    D = list(range(1, 321))
    s100, _ = put(cache, kv, pool, D[:100])
    s200, _ = put(cache, kv, pool, D[:200])
    s300, _ = put(cache, kv, pool, D[:300])
    walk.exposure[SPINE] += 5000.0  # watched for long, never hit: weight ~ 16 / 5000
    e, _ = put(cache, kv, pool, D)
    assert [walk.kind[n.id] for n in (s100, s200, s300, e)] == [SPINE, SPINE, SPINE, LEAF]
    assert 0.0 < walk.spine_weight < 0.005
    assert cache.evict_states(1).num_states == 1
    assert s100.state_slot is None  # the leader's (signals) victim
    gds = walk.orders[1]
    assert e.id in gds.excluded and gds.balance == 0  # gds's victim; s100 retained as a ghost
    assert walk.regret == [0.0, 0.0, 0.0]
    m = cache.match_prefix(D[:150] + [999])
    assert m.prefix_len == 0  # nothing usable above 150 now
    assert walk.regret == [pytest.approx(100.0), 0.0, 0.0]
    assert (walk.matches, walk.matched_tokens) == (1, 151)
    walk._maybe_switch()
    assert walk.leader == 0 and walk.switches == 0  # 100 tokens: less than one mean match
    for t in (7001, 7002, 7003):
        assert cache.match_prefix([t]).prefix_len == 0
    assert (walk.matches, walk.matched_tokens) == (4, 154)
    put(cache, kv, pool, [5000])  # a store: the lead moves
    assert walk.leader == 1 and walk.switches == 1
    assert all(not o.excluded and not o.retained for o in walk.orders)
    cache.sanity_check()


def test_kv_order_duel_lru_then_gdsize() -> None:
    """Led by ``lru``, KV leaves go least recently used first (a lock and a release are no
    use); once ``lru`` is charged more, ``gdsize`` leads: a deeper prefix's tokens cost more
    to rebuild (d = 1, e = 1: cost(0, b) / b = 1 + b / 2e5), so with equal stamps the
    shallower leaf goes first."""
    duel = KVOrderDuel(1.0, 1.0, lambda n: 0)
    shallow = chain(1000)[0]
    deep = chain(9000)[0]
    old = chain(5000)[0]
    for n, t in ((old, 1), (deep, 2), (shallow, 3)):
        n.last_access_time = t
        duel.update(n)
    duel.discard(old)  # locked ...
    duel.update(old)  # ... and released: still its access at 1
    duel.check()
    assert duel.pop_first() is old and len(duel) == 2
    duel.regret = [10.0, 0.0]
    for o in duel.orders:
        o.clear_exclusions(duel.members)
    duel.leader = 1
    assert duel.pop_first() is shallow
    duel.check()


def test_kv_order_duel_is_lru_under_random_use() -> None:
    """With ``lru`` leading and never charged, pops follow least recent use exactly."""
    rng = random.Random(3)
    duel = KVOrderDuel(1.0, 0.0, lambda n: 0)
    nodes = [chain(rng.randint(1, 500))[0] for _ in range(40)]
    clock = 0
    members: set[int] = set()
    for _ in range(400):
        n = rng.choice(nodes)
        r = rng.random()
        if r < 0.5:
            clock += 1
            n.last_access_time = clock
            duel.update(n)
            members.add(n.id)
        elif r < 0.7 and n.id in members:
            duel.discard(n)
            members.discard(n.id)
        elif members:
            want = min((m for m in nodes if m.id in members), key=lambda m: m.last_access_time)
            got = duel.pop_first()
            assert got is not None and got.last_access_time == want.last_access_time
            members.discard(got.id)
        duel.regret = [0.0, 0.0]
        assert duel.leader == 0
        duel.check()


def test_kv_order_duel_clear_starts_over() -> None:
    """A reset cache clears its KV order: no member, no ghost, no charge, ``lru`` leading;
    a ghost from before the clear never touches the new orders (same ghost ids)."""
    duel = KVOrderDuel(1.0, 0.0, lambda n: 0)
    a = chain(300)[0]
    a.key = list(range(300))  # a leaf under its own root: its ghost hangs on that root
    b = chain(600)[0]
    for n, t in ((a, 1), (b, 2)):
        n.last_access_time = t
        duel.update(n)
    assert duel.pop_first() is a and len(duel.ghosts) == 1
    duel.regret = [5.0, 1.0]
    duel.clear()
    assert len(duel) == 0 and b not in duel and not len(duel.ghosts)
    assert duel.regret == [0.0, 0.0] and duel.leader == 0
    assert all(not o.stamp and not o.retained for o in duel.orders)
    c = chain(100)[0]
    c.last_access_time = 7
    duel.update(c)
    duel.orders[1].retain(-1, 1e9)  # a new ghost id that an old ghost also had
    del a
    gc.collect()  # a's root goes; the ghost table that watched it went with the clear
    assert duel.orders[1].retained == {-1: 1e9}
    assert duel.pop_first() is c and len(duel) == 0


def test_entries_of_an_earlier_stay_never_pass_for_current() -> None:
    """A state cached on a node, evicted and cached there again: the heap entries of its first
    stay are stale for good. X at depth 50 is added while A (depth 10) above it is not live
    (entry 50), then A is cached and X re-seeded (entry 40 = 50 - 10); X leaves and comes back
    (entry 40 again, stamp 0). The entry at 50 is above X's true priority 40; were it taken
    for X's current entry (versions counted per stay restart at 1), the order's invariant
    check would fail, as it did in a replay where a node's state came back."""
    (a,) = chain(10)
    (x,) = chain(50, parent=a)
    live: dict[int, TreeNode] = {x.id: x}
    h = heap_over(live)
    h.add(x)
    assert h.true_priority(x) == 50.0
    live[a.id] = a
    h.add(a)
    h.reseed(x)
    assert h.true_priority(x) == 40.0
    h.remove(x.id)
    del live[x.id]
    live[x.id] = x
    h.add(x)
    h.check([a, x])
    v = h.pop(live, lambda n: True, virtual=False)
    assert v is a and h.watermark == 10.0
    h.remove(a.id)
    del live[a.id]
    assert h.true_priority(x) == 50.0  # rebuilt from the root now
    v = h.pop(live, lambda n: True, virtual=False)
    assert v is x and h.watermark == 50.0


def test_the_adaptive_watermark_never_decreases_across_victims_and_leader_switches() -> None:
    """A random workload over four state slots, the lead moved to each order in turn (by
    charging the others): ``RadixCache.watermark`` never goes down, although the new leader's
    own watermark is sometimes below it (so a walk that reported its leader's would drop)."""
    cache, kv, pool = make(policy="gds_adaptive", states=4, size=20000)
    walk = cache.state.gds
    assert isinstance(walk, AdaptiveGDSStrategy)
    rng = random.Random(5)
    prompts: list[list[int]] = []
    marks = [cache.watermark]
    below_at_switch = 0
    for step in range(240):
        if prompts and rng.random() < 0.6:
            base = rng.choice(prompts)
            key = base[: rng.randint(1, len(base))] + [rng.randint(1, 50) for _ in range(rng.randint(1, 30))]
        else:
            key = [rng.randint(1, 50) for _ in range(rng.randint(5, 60))]
        if rng.random() < 0.5:
            cache.match_prefix(key)
        if pool.available_size() == 0:
            cache.evict_states(1)
        if kv.available_size() < len(key):
            cache.evict(len(key))
        put(cache, kv, pool, key)
        prompts.append(key)
        marks.append(cache.watermark)
        if step % 30 == 29:
            target = (walk.leader + 1) % len(walk.orders)
            walk.regret = [0.0 if i == target else 1e9 for i in range(len(walk.orders))]
            walk._maybe_switch()
            assert walk.leader == target
            below_at_switch += walk.orders[target].watermark < walk.watermark
    assert walk.switches == 8 and below_at_switch > 0
    assert all(b >= a for a, b in zip(marks, marks[1:], strict=False)), marks
    assert marks[-1] > 0.0
    cache.sanity_check()


def test_an_excluded_state_that_a_match_consumes_charges_the_orders_that_excluded_it() -> None:
    """The setup of the test above: signals (leading) evicts the spine at 100; gds and gdsf
    (all hits 0: the same order) would each have evicted the end state at 320 (cost 20 over
    the live state at 300, the least) and excluded it. A match then consumes that state: each
    is charged what it would have lost, 320 - 300 = 20 tokens; the leader nothing."""
    cache, kv, pool = make(policy="gds_adaptive", states=4)
    walk = cache.state.gds
    assert isinstance(walk, AdaptiveGDSStrategy)
    D = list(range(1, 321))
    for n in (100, 200, 300):
        put(cache, kv, pool, D[:n])
    walk.exposure[SPINE] += 5000.0
    e, _ = put(cache, kv, pool, D)
    assert cache.evict_states(1).num_states == 1
    assert [o.name for o in walk.orders] == ["signals", "gds", "gdsf"]
    assert [sorted(o.excluded) for o in walk.orders] == [[], [e.id], [e.id]]
    m = cache.match_prefix(D + [999])
    assert (m.prefix_len, m.state_slot) == (320, e.state_slot)
    assert walk.regret == [0.0, pytest.approx(20.0), pytest.approx(20.0)]
    cache.sanity_check()
