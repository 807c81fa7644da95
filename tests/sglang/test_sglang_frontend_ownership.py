"""Slot ownership under a random scheduler driving the SGLang front end.

A seeded scheduler admits requests (match with the matched state copied, lock, a row, fresh
slots in whole pages; a third of them extend an earlier prompt, some in a second namespace),
decodes, checkpoints, finishes (with and without insert, then once more, which must be
refused), aborts, runs streaming-session turns, slides SWA windows, evicts, locks matched
nodes for a while, and resets when idle. After every step the owners are recounted from
the records, independently of the cache's counters:

* every KV slot the allocator holds is held by exactly one owner: the tree (a node's device
  slots), a running request (its row past ``cache_protected_len``, and on SWA models its own
  copies kept below it), or an idle streaming session (the same parts of its row); nothing
  else is held (no leak) and no owner holds a free slot (no double free);
* the same for state slots (tree nodes, requests' and sessions' own slots) and for rows;
* a running request's protected row is the tree's path (or its own kept copies);
* ``evictable + protected == total``, and the KV events replayed (stored minus removed
  pages) are the tree's pages;
* an eviction of everything leaves every locked node in the tree.

These found the leaks and lost locks of ``test_sglang_frontend_hunt.py``.
``HPC_SGLANG_OWNERSHIP_SEEDS`` (default 3) / ``HPC_SGLANG_OWNERSHIP_STEPS`` (default 200)
scale the run.
"""

from __future__ import annotations

import os
import random
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from allocators import PagedAllocator, SWAAllocator, TokenAllocator
from hicache import HiCacheConfig
from radix.sglang import (
    CacheInitParams,
    EvictParams,
    InitLoadBackParams,
    MatchPrefixParams,
    RadixCache,
    Req,
    ReqToTokenPool,
    TreeLock,
    UnifiedRadixCache,
)
from radix.sglang.session import is_virtual_node
from tests.helpers.cache_helpers import tiny_state_pool

HUGE = 10**6
SEEDS = int(os.environ.get("HPC_SGLANG_OWNERSHIP_SEEDS", "3"))
STEPS = int(os.environ.get("HPC_SGLANG_OWNERSHIP_STEPS", "200"))


def held(alloc: Any) -> set[int]:
    """The slots ``alloc`` has handed out (its free mask over ids; pages when paged)."""
    mask, ps = alloc.free_mask, alloc.page_size
    ids = [i for i in range(1, len(mask)) if not mask[i]]
    return {p * ps + j for p in ids for j in range(ps)}


class Scheduler:
    """One cache, its pools, and the records of what each owner holds."""

    def __init__(self, seed: int, cls: type[UnifiedRadixCache], page: int, hybrid: bool,
                 window: int | None, sessions: bool, policy: str, host: bool = False) -> None:
        self.rng = random.Random(seed)
        self.page, self.hybrid, self.window = page, hybrid, window
        scale = max(1, page // 4)
        self.scale = scale
        size = 96 * scale
        self.kv: Any = (SWAAllocator(size, size // 2, page_size=page) if window
                        else TokenAllocator(size) if page == 1 else PagedAllocator(size, page))
        self.sp = tiny_state_pool(6) if hybrid else None
        self.rtp = ReqToTokenPool(6, 72 * scale, mamba_pool=self.sp)
        self.fe = cls(CacheInitParams(
            disable=False, req_to_token_pool=self.rtp, token_to_kv_pool_allocator=self.kv,
            page_size=page, eviction_policy=policy, sliding_window_size=window,
            enable_kv_cache_events=window is None and not host,
            enable_streaming_session=sessions,
            hicache=HiCacheConfig(hicache_ratio=2.0, load_back_threshold=1,
                                  hicache_write_policy=self.rng.choice(["write_through",
                                                                         "write_back"]))
            if host else None))
        self.sessions, self.host = sessions, host
        self.running: list[Req] = []
        self.readers: list[TreeLock | None] = []
        self.prompts: list[list[int]] = []
        self.history: dict[str, list[int]] = {}
        self.events: set[int] = set()
        self.rid = 0

    # ------------------------------------------------------------------ the check
    def records(self) -> list[Any]:
        """Every KV record that holds a row: running requests', then idle sessions'."""
        recs = [r.kv for r in self.running]
        for rec in self.fe.session_records().values():
            if all(rec is not k for k in recs):
                recs.append(rec)
        return recs

    def check(self, tag: str) -> None:
        fe = self.fe
        fe.sanity_check()
        tree = fe.all_values_flatten().tolist()
        tree_set = set(tree)
        assert len(tree) == len(tree_set) == fe.total_size(), tag
        assert fe.evictable_size() + fe.protected_size() == fe.total_size(), tag
        own: list[int] = []
        recs = self.records()
        for rec in recs:
            row = self.rtp.req_to_token[rec.req_pool_idx]
            p = rec.cache_protected_len
            own += row[p:rec.kv_allocated_len].tolist()
            below = row[:p].tolist()
            if self.window:
                own += [s for s in below if s not in tree_set]  # its copies kept
            else:
                assert all(s in tree_set for s in below), (tag, "protected row not the tree's")
        for r in self.running:
            if is_virtual_node(r.last_node):
                continue  # a session turn: its session holds the lock
            p = r.kv.cache_protected_len
            path = fe.path_device_indices(r.last_node)[:p].tolist() if p else []
            row = self.rtp.req_to_token[r.kv.req_pool_idx][:p].tolist()
            assert len(path) == p and all(
                a == b or a not in tree_set for a, b in zip(row, path, strict=True)), (
                tag, "protected row is not the locked path")
        assert len(own) == len(set(own)), (tag, "a slot with two owners")
        assert not set(own) & tree_set, (tag, "a slot held by a request and the tree")
        assert held(self.kv) == set(own) | tree_set, (
            tag, "leaked", sorted(held(self.kv) - set(own) - tree_set),
            "held but free", sorted((set(own) | tree_set) - held(self.kv)))
        assert self.rtp.available_size() == 6 - len(recs), (tag, "rows")
        if self.sp is not None:
            states = fe.all_mamba_values_flatten().tolist()
            mine = [int(rec.mamba_pool_idx) for rec in recs if rec.mamba_pool_idx is not None]
            assert len(states) + len(mine) == len(set(states) | set(mine)), (tag, "state twice")
            assert held(self.sp) == set(states) | set(mine), (tag, "state leaked")
        if self.window is None and not self.host:
            for e in fe.take_events():
                name = type(e).__name__
                if name == "AllBlocksCleared":
                    self.events.clear()
                elif name == "BlockStored":
                    assert not set(e.block_hashes) & self.events, (tag, "page stored twice")
                    self.events |= set(e.block_hashes)
                elif name == "BlockRemoved":
                    assert set(e.block_hashes) <= self.events, (tag, "unknown page removed")
                    self.events -= set(e.block_hashes)
            assert len(self.events) * self.page == fe.total_size(), (tag, "events")

    # ------------------------------------------------------------------ the steps
    def alloc_kv(self, n: int) -> torch.Tensor | None:
        if n <= 0:
            return torch.empty(0, dtype=torch.int64)
        got = self.kv.alloc(n)
        if got is None:
            self.fe.evict(EvictParams(num_tokens=n - self.kv.available_size()))
            got = self.kv.alloc(n)
        return got

    def new_prompt(self) -> tuple[list[int], Any]:
        rng, sc = self.rng, self.scale
        sid = rng.choice(["a", "b", None]) if self.sessions else None
        busy = {r.session_id for r in self.running}
        if sid is not None and sid not in busy:
            tail = [rng.randint(1, 3) for _ in range(rng.randint(1, 5 * sc))]
            return self.history.get(sid, []) + tail, SimpleNamespace(session_id=sid,
                                                                     streaming=True)
        if self.prompts and rng.random() < 0.6:
            base = rng.choice(self.prompts)
            head = base[: rng.randint(0, len(base))]
        else:
            head = []
        return head + [rng.randint(1, 3) for _ in range(rng.randint(1, 10 * sc))], None

    def admit(self) -> None:
        rng = self.rng
        prompt, session = self.new_prompt()
        req = Req(self.rid, prompt, extra_key=None if session else rng.choice([None, "lora"]),
                  session=session)
        self.rid += 1
        try:
            m = self.fe.match_prefix(MatchPrefixParams(key=req.radix_key(len(prompt) - 1),
                                                       req=req, cow_mamba=self.hybrid))
        except RuntimeError as e:  # every state held: the request waits
            assert "no recurrent-state slot" in str(e)
            return
        req.last_node = m.last_device_node
        p, indices = m.device_prefix_len, m.device_indices
        if self.host and m.host_hit_length and rng.random() < 0.8:
            # SGLang's admission: the prefix grows by what the load-back reports
            loaded, node = self.fe.init_load_back(InitLoadBackParams(
                best_match_node=m.best_match_node, host_hit_length=m.host_hit_length, req=req))
            assert loaded in (0, m.host_hit_length), "a load-back commits all or none"
            req.last_node, p = node, p + loaded
            indices = self.fe.path_device_indices(node)
            assert len(indices) == p, "the node the request ends at ends at its prefix"
        if m.cache_protected_len is None:
            req.kv.cache_protected_len = p
        else:
            p = m.device_prefix_len
        req.lock = self.fe.lock(req.last_node)
        if req.kv.req_pool_idx is None:
            if self.rtp.alloc([req]) is None:
                self.fe.unlock(req.lock)
                self.rtp.free_mamba_cache(req)
                return
            assert req.kv.req_pool_idx is not None
            self.rtp.write((req.kv.req_pool_idx, slice(0, p)), indices)
            req.kv.kv_committed_len = req.kv.kv_allocated_len = p
        start = max(req.kv.kv_allocated_len, p)
        end = -(-len(prompt) // self.page) * self.page
        fresh = self.alloc_kv(end - start)
        if fresh is None:  # no memory: the request is aborted
            req.finished_reason = SimpleNamespace(is_abort=True)
            self.fe.release_kv_cache(req, checkpoint=False)
            return
        self.rtp.write((req.kv.req_pool_idx, slice(start, end)), fresh)
        req.kv.kv_committed_len, req.kv.kv_allocated_len = len(prompt), max(end, start)
        self.fe.maybe_hand_to_session(req)
        self.running.append(req)
        self.prompts.append(prompt)

    def decode(self, r: Req) -> None:
        c = r.kv.kv_committed_len
        if c + 1 > 60 * self.scale:
            return
        if c + 1 > r.kv.kv_allocated_len:
            got = self.alloc_kv(self.page)
            if got is None:
                return
            a = r.kv.kv_allocated_len
            self.rtp.write((r.kv.req_pool_idx, slice(a, a + self.page)), got)
            r.kv.kv_allocated_len = a + self.page
        r.output_ids.append(self.rng.randint(1, 3))
        r.kv.kv_committed_len = c + 1

    def finish(self, r: Req) -> None:
        self.running.remove(r)
        if self.rng.random() < 0.1:
            r.finished_reason = SimpleNamespace(is_abort=True)
            self.fe.release_kv_cache(r, checkpoint=False)
            if r.session_id is not None:
                self.history.pop(r.session_id, None)
            return
        r.finished_reason = "stop"
        self.fe.release_kv_cache(r, checkpoint=self.rng.random() < 0.9)
        if r.session_id is not None:
            self.history[r.session_id] = r.full_untruncated_fill_ids
        if not self.fe.session_records():
            with pytest.raises(ValueError, match="holds no req_to_token_pool row"):
                self.fe.release_kv_cache(r)  # finished twice

    def step(self, i: int) -> None:
        rng, fe = self.rng, self.fe
        op = rng.random()
        if op < 0.3 and len(self.running) < 4:
            self.admit()
        elif op < 0.45 and self.running:
            self.decode(rng.choice(self.running))
        elif op < 0.58 and self.running:
            r = rng.choice(self.running)
            try:
                fe.checkpoint(r, up_to=rng.randint(0, r.kv.kv_committed_len))
            except RuntimeError as e:  # no state slot for the tree's copy
                assert "no recurrent-state slot" in str(e)
        elif op < 0.7 and self.running:
            self.finish(rng.choice(self.running))
        elif op < 0.74 and self.window and self.running:
            r = rng.choice(self.running)
            fe.evict_sliding_windows(r, r.kv.kv_committed_len)
        elif op < 0.78 and self.sessions:
            sid = rng.choice(["a", "b"])
            if all(r.session_id != sid for r in self.running):
                fe.release_session(sid)
                self.history.pop(sid, None)
        elif op < 0.81 and self.host:
            fe.evict_host(rng.randint(0, 30 * self.scale))
        elif op < 0.88:
            n = rng.randint(0, 40 * self.scale)
            fe.evict(EvictParams(num_tokens=n if rng.random() < 0.6 else 0,
                                 swa_num_tokens=n if self.window else 0,
                                 mamba_num=rng.randint(0, 3) if self.hybrid else 0))
        elif op < 0.94:
            if self.readers and rng.random() < 0.5:
                fe.unlock(self.readers.pop(rng.randrange(len(self.readers))))
            elif self.prompts:
                m = fe.match_prefix(MatchPrefixParams(key=Req(0, rng.choice(self.prompts))
                                                      .radix_key()))
                self.readers.append(fe.lock(m.last_device_node))
        elif op < 0.97:
            locked = [fe.lib_node(lk.node) for lk in self.readers if lk is not None]
            locked += [fe.lib_node(r.last_node) for r in self.running
                       if r.lock is not None]
            fe.evict(EvictParams(num_tokens=HUGE, swa_num_tokens=HUGE if self.window else 0,
                                 mamba_num=HUGE if self.hybrid else 0))
            assert all(fe.cache.holds(n) for n in locked), f"{i}: a locked node was evicted"
        elif not self.running and not self.readers:
            fe.reset()
            self.history.clear()
        self.check(f"step {i}")

    def drain(self) -> None:
        for lk in self.readers:
            self.fe.unlock(lk)
        for r in list(self.running):
            r.finished_reason = "stop"
            self.running.remove(r)
            self.fe.release_kv_cache(r)
        for sid in ("a", "b"):
            self.fe.release_session(sid)
        self.fe.evict(EvictParams(num_tokens=HUGE, swa_num_tokens=HUGE if self.window else 0,
                                  mamba_num=HUGE if self.hybrid else 0))
        self.check("drained")
        assert self.kv.used_size() == 0 and self.rtp.available_size() == 6
        assert self.sp is None or self.sp.used_size() == 0


CONFIGS = [
    # (class, page, hybrid, window, sessions, policy[, host tier])
    (RadixCache, 1, False, None, False, "lru"),
    (RadixCache, 4, False, None, True, "gds"),
    (UnifiedRadixCache, 1, False, None, True, "lru"),
    (UnifiedRadixCache, 16, False, None, False, "gds"),
    (UnifiedRadixCache, 1, True, None, False, "gds"),
    (UnifiedRadixCache, 1, True, None, True, "lru"),
    (UnifiedRadixCache, 1, True, None, False, "gds_adaptive"),
    (UnifiedRadixCache, 1, False, 4, True, "lru"),
    (UnifiedRadixCache, 4, False, 8, True, "lru"),
    (UnifiedRadixCache, 1, True, 4, True, "lru"),
    (UnifiedRadixCache, 1, True, None, False, "gds", True),
    (UnifiedRadixCache, 4, False, 8, False, "lru", True),
    (UnifiedRadixCache, 1, False, None, True, "gds", True),
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(
    getattr(x, "__name__", str(x)) for x in c))
@pytest.mark.parametrize("seed", range(SEEDS))
def test_every_slot_has_exactly_one_owner(config: tuple[Any, ...], seed: int) -> None:
    s = Scheduler(seed, *config)
    for i in range(STEPS):
        s.step(i)
    s.drain()
