"""The replay's speed floor: the same engine over a minimal block-level prefix cache.

:class:`FloorEngine` serves a trace with the rules of :class:`bench.engine.core.ReplayEngine`
(match ``prompt[:-1]``, lock, copy-on-write state, one KV allocation for the uncached prompt
and the output, checkpoints at chunk ends and at the branch point, ``concurrency`` requests in
flight, the prompt cached up to its last full trace block at finish, evict-then-finish-oldest
on a shortfall) over the least a correct prefix cache must do:

* nodes are single trace blocks, filed under their parent by the block's token bytes (the
  hash and compare of a dict lookup is the memcmp of a radix walk);
* the new blocks of an insert share one copy of their KV slot indices (the tail copy),
  each node a view of its block;
* KV slots come from a numpy free stack, state slots from a list;
* eviction is LRU: KV leaves by last access (a lazily invalidated heap), states by last use
  (an ordered dict); a leaf that loses its state leaves with its KV (the cache's default
  ``stateless_leaf`` rule), and so does a stateless leaf left behind.

No validation, no components, no statistics, no events: it is a measuring stick, not a
cache. Every cached boundary of these traces is a block boundary (chunk ends, branch points
and end checkpoints are block multiples when the chunk is), so its hit rate lands close to the
token-level replay's ``lru`` run, which says it does the same work; the ratio of the replay's
CPU time to its CPU time is the distance to the floor (``python -m bench replay --floor``).
"""

from __future__ import annotations

import heapq
import time
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from bench.traces.loader import TraceRequest

__all__ = ["FloorEngine", "FloorResult", "floor_replay"]


class _Node:
    """One trace block in the tree; ``parent`` is ``None`` for the root and once removed."""

    __slots__ = ("parent", "children", "key", "slots", "lock", "last", "state")

    def __init__(self, parent: _Node | None, key: bytes, slots: np.ndarray) -> None:
        self.parent = parent
        self.children: dict[bytes, _Node] = {}
        self.key = key
        self.slots = slots
        self.lock = 0
        self.last = 0
        self.state = -1


@dataclass(frozen=True, slots=True)
class FloorResult:
    """One floor run: its CPU time [s] (``time.process_time``) and what it served."""

    cpu_s: float
    prompt_tokens: int
    usable_tokens: int
    skipped: int

    @property
    def token_hit_rate(self) -> float:
        """Usable cached prefix / prompt tokens, as the replay's ``token_hit_rate``."""
        return self.usable_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class FloorEngine:
    """The minimal block-level engine (see the module docstring).

    Args:
        kv_tokens: KV pool [tokens]. state_slots: state pool [slots] (0: KV only).
        block_size: tokens per trace block (the node size). chunk_size: prefill chunk
            [tokens] (a multiple of ``block_size`` keeps every checkpoint on a node end).
        concurrency: requests in flight.
    """

    def __init__(self, kv_tokens: int, state_slots: int, block_size: int, chunk_size: int,
                 concurrency: int) -> None:
        self.block = block_size
        self.chunk = chunk_size
        self.concurrency = concurrency
        self.hybrid = state_slots > 0
        self.free_kv = np.arange(kv_tokens, dtype=np.int64)
        self.top = kv_tokens
        self.free_states = list(range(state_slots))
        self.root = _Node(None, b"", np.empty(0, dtype=np.int64))
        self.root.lock = 1  # never evicted
        self.clock = 0
        self.leaves: list[tuple[int, int, _Node]] = []  # (last access, tie, node), lazy
        self.states: OrderedDict[_Node, None] = OrderedDict()  # nodes with a state, LRU first
        self.running: deque[tuple[list[_Node], np.ndarray, np.ndarray, int, int, array]] = deque()
        self.prompt_tokens = self.usable_tokens = self.skipped = 0
        self._tie = 0

    # ------------------------------------------------------------------ pools
    def _alloc(self, n: int) -> np.ndarray | None:
        while self.top < n:
            if not self._evict_leaf() and not self._finish_oldest():
                return None
        self.top -= n
        return self.free_kv[self.top:self.top + n].copy()

    def _free(self, slots: np.ndarray) -> None:
        n = len(slots)
        self.free_kv[self.top:self.top + n] = slots
        self.top += n

    def _alloc_state(self, finish_running: bool) -> int:
        while not self.free_states:
            if not self._evict_state() and not (finish_running and self._finish_oldest()):
                return -1
        return self.free_states.pop()

    # ------------------------------------------------------------------ eviction
    def _push_leaf(self, node: _Node) -> None:
        self._tie += 1
        heapq.heappush(self.leaves, (node.last, self._tie, node))

    def _requeue(self, path: list[_Node]) -> None:
        """The end of ``path``, when an unlocked leaf, re-enters the leaf heap."""
        if path and not path[-1].children and not path[-1].lock:
            self._push_leaf(path[-1])

    def _remove(self, node: _Node) -> None:
        """Drop an unlocked leaf (its KV, its state) and the stateless leaves it leaves."""
        freed = []
        while True:
            parent = node.parent
            assert parent is not None
            del parent.children[node.key]
            node.parent = None
            freed.append(node.slots)
            if node.state >= 0:
                self.free_states.append(node.state)
                del self.states[node]
            if parent.children or parent.lock or parent.state >= 0 or parent is self.root:
                if not parent.children and parent is not self.root:
                    self._push_leaf(parent)
                break
            node = parent
        self._free(freed[0] if len(freed) == 1 else np.concatenate(freed))

    def _evict_leaf(self) -> bool:
        heap = self.leaves
        while heap:
            last, _, node = heapq.heappop(heap)
            if node.parent is not None and not node.children and not node.lock \
                    and node.last == last:
                self._remove(node)
                return True
        return False

    def _evict_state(self) -> bool:
        for node in self.states:
            if not node.lock:
                if node.children:
                    del self.states[node]
                    self.free_states.append(node.state)
                    node.state = -1
                else:
                    self._remove(node)
                return True
        return False

    # ------------------------------------------------------------------ tree
    def _match(self, tokens: array, end: int) -> list[_Node]:
        """The path of whole blocks of ``tokens[:end]`` in the tree."""
        b = self.block
        node, path = self.root, []
        for pos in range(0, end - end % b, b):
            child = node.children.get(tokens[pos:pos + b].tobytes())
            if child is None:
                break
            path.append(child)
            node = child
        return path

    def _touch(self, path: list[_Node]) -> None:
        """Stamp ``path``; its last node, when an unlocked leaf, re-enters the leaf heap."""
        self.clock += 1
        now = self.clock
        for node in path:
            node.last = now
        self._requeue(path)

    def _insert(self, path: list[_Node], tokens: array, slots: np.ndarray, upto: int,
                state: int) -> tuple[list[_Node], np.ndarray]:
        """Cache ``tokens[:upto]`` below ``path`` (the request's cached blocks); a block some
        other request cached meanwhile keeps the tree's slots and the request's are freed.
        Returns the new path and the request's slots with the tree's in front."""
        b = self.block
        node = path[-1] if path else self.root
        pos = len(path) * b
        dup: list[np.ndarray] = []
        new_path = list(path)
        fresh: np.ndarray | None = None  # one copy of the new blocks' slots, viewed per node
        while pos < upto:
            seg = tokens[pos:pos + b].tobytes()
            child = node.children.get(seg) if fresh is None else None
            if child is None:  # a leaf parent's heap entry goes stale (it has a child now)
                if fresh is None:
                    fresh, base = slots[pos:upto].copy(), pos
                child = _Node(node, seg, fresh[pos - base:pos - base + b])
                node.children[seg] = child
            else:
                dup.append(slots[pos:pos + b].copy())
                slots[pos:pos + b] = child.slots
            child.lock += 1
            new_path.append(child)
            node = child
            pos += b
        for d in dup:
            self._free(d)
        if state >= 0:
            if node.state >= 0 or node is self.root:
                self.free_states.append(state)
            else:
                node.state = state
                self.states[node] = None
        if node.state >= 0:
            self.states.move_to_end(node)
        self._touch(new_path)
        return new_path, slots

    # ------------------------------------------------------------------ requests
    def admit(self, tr: TraceRequest) -> None:
        """Serve one request (see the module docstring)."""
        if len(self.running) >= self.concurrency:
            self._finish(self.running.popleft())
        tokens = tr.token_array
        n = len(tokens)
        b = self.block
        path = self._match(tokens, n - 1)
        kv_hit = len(path) * b
        usable = kv_hit
        if self.hybrid:
            while path and path[-1].state < 0:
                path.pop()
            usable = len(path) * b
        for node in path:
            node.lock += 1
        self._touch(path)
        self.prompt_tokens += n
        slot = -1
        if self.hybrid:
            slot = self._alloc_state(True)
            if slot < 0:
                return self._skip(path)
            if path:
                self.states.move_to_end(path[-1])
        full = n - n % b
        out = -(-tr.output_length // b) * b
        kv = self._alloc(n - usable + out)
        if kv is None:
            if slot >= 0:
                self.free_states.append(slot)
            return self._skip(path)
        self.usable_tokens += usable
        tree = [node.slots for node in path]
        slots = np.concatenate([*tree, kv[:full - usable]]) if tree else kv[:full - usable]
        own = kv[full - usable:]
        points = set(range(usable + self.chunk, n, self.chunk))
        if self.hybrid and usable < kv_hit < n:
            points.add(kv_hit)
        for pos in sorted(p - p % b for p in points):
            if pos <= len(path) * b:
                continue
            snap = self._alloc_state(False) if self.hybrid else -1
            if self.hybrid and snap < 0:
                continue
            path, slots = self._insert(path, tokens, slots, pos, snap)
        keep = tr.num_full_blocks * b
        self.running.append((path, slots, own, keep, slot, tokens))

    def _finish(self, run: tuple[list[_Node], np.ndarray, np.ndarray, int, int, array]) -> None:
        path, slots, own, keep, slot, tokens = run
        if keep > len(path) * self.block:
            path, slots = self._insert(path, tokens, slots, keep, slot)
        elif slot >= 0:
            self.free_states.append(slot)
        for node in path:
            node.lock -= 1
        self._touch(path)
        self._free(slots[len(path) * self.block:])
        self._free(own)

    def _finish_oldest(self) -> bool:
        if not self.running:
            return False
        self._finish(self.running.popleft())
        return True

    def _skip(self, path: list[_Node]) -> None:
        for node in path:
            node.lock -= 1
        self._requeue(path)
        self.skipped += 1

    def drain(self) -> None:
        """Finish every running request, oldest first."""
        while self.running:
            self._finish(self.running.popleft())


def floor_replay(trace: Sequence[TraceRequest], kv_tokens: int, state_slots: int,
                 chunk_size: int = 8192, concurrency: int = 32) -> FloorResult:
    """Replay ``trace`` through a fresh :class:`FloorEngine`; its CPU time and hit counts.

    Raises:
        ValueError: an empty trace, or requests of different block sizes.
    """
    if not trace:
        raise ValueError("trace must not be empty")
    block = trace[0].block_size
    if any(r.block_size != block for r in trace):
        raise ValueError("every request of the trace must have the same block_size")
    engine = FloorEngine(kv_tokens, state_slots, block, chunk_size, concurrency)
    cpu0 = time.process_time()
    for tr in trace:
        engine.admit(tr)
    engine.drain()
    cpu = time.process_time() - cpu0
    return FloorResult(cpu, engine.prompt_tokens, engine.usable_tokens, engine.skipped)
