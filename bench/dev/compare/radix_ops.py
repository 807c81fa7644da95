"""Radix-operation speed on the anchor's seeded workloads, driven through our RadixCache.

    python -m bench radix-ops --workload sysprompt|multiturn [--states] [--page-size P]
        [--capacity N --mamba-capacity M --policy lru --allocator real|counter]

Reproduces the SGLang-side bench script of ``python -m bench compare`` exactly: the same seeded generator
(same ``random.Random`` call sequence, sizes and defaults), the same per-request steps, the
same capacities, and prints one JSON line with the same fields. Per request:

1. ``match_prefix`` (timed; our result already carries ``device_indices``, so ``match`` and
   ``match + indices`` are the same call and ``time_s.idx`` is 0);
2. ``inc_lock_ref`` + ``dec_lock_ref`` of the matched node (timed as one pair);
3. with ``--states`` only: when the match reports a branch point past the usable prefix, the
   branch checkpoint: ``insert`` of the key up to ``branching_seqlen`` aligned down to the
   ``--mamba-chunk`` grid (as SGLang's ``mamba_branching_seqlen``) with a fresh state slot
   (timed into ``insert``);
4. ``insert`` of the whole sequence (+ a fresh state slot with ``--states``) (timed);
5. ``evict`` of the KV overflow above ``--capacity`` (timed), and with ``--states``
   ``evict_states`` of the overflow above ``--mamba-capacity`` (timed as ``mevict``).

Keys (``RadixKey``, validated once) are built outside the timers, as the anchor builds
SGLang's ``RadixKey(array('q', toks))`` outside its timers.

Allocators (``--allocator``):

* ``real`` (default): a :class:`TokenAllocator` / :class:`PagedAllocator` sized to hold the
  capacity plus a few requests, and a :class:`MambaStatePool` with tiny states. New slots are
  allocated outside the timers; the driver frees (outside the timers) what the cache reports
  as the caller's: duplicates ``value[hit:prefix_len]``, the partial-page tail, unadopted
  state slots. The cache's own frees (eviction) go to the real allocator inside ``evict``.
  At the end ``allocator.used_size() == cache.total_size()`` is checked (no leak).
* ``counter``: like the anchor, fresh slot ids from a counter and a stub whose ``free`` only
  counts, so ``evict`` times exclude the allocator's bookkeeping (the anchor's convention).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from allocators import MambaStatePool, PagedAllocator, TokenAllocator
from bench.dev.compare.options import radix_ops_parser
from radix import CacheConfig, RadixCache, RadixKey

__all__ = ["make_workload", "run", "main"]


# ----------------------------------------------------------------- workload
def make_workload(args: argparse.Namespace) -> list[list[int]]:
    """The anchor's seeded requests (token id lists), identical call for call."""
    rng = random.Random(args.seed)
    prompts = [
        [rng.randrange(args.vocab) for _ in range(args.sys_len)] for _ in range(args.prompts)
    ]
    reqs: list[list[int]] = []
    if args.workload == "sysprompt":
        suffix_len = args.req_len - args.sys_len
        if suffix_len < 0:
            raise SystemExit("--req-len must be >= --sys-len")
        for _ in range(args.requests):
            p = prompts[rng.randrange(args.prompts)]
            reqs.append(p + [rng.randrange(args.vocab) for _ in range(suffix_len)])
        return reqs
    convs: list[list[int]] = []
    for _ in range(args.requests):
        if not convs or rng.random() < args.new_conv_prob:
            seq = list(prompts[rng.randrange(args.prompts)])
        else:
            seq = list(rng.choice(convs))
            if len(seq) + args.turn_len > args.max_len:
                seq = list(prompts[rng.randrange(args.prompts)])
        seq += [rng.randrange(args.vocab) for _ in range(args.turn_len)]
        convs.append(seq)
        reqs.append(seq)
    return reqs


# --------------------------------------------------------------- allocators
class CountingKVAllocator:
    """The anchor's allocator convention: ids from a counter, ``free`` only counts."""

    size: int | None = 1 << 60  # ids are never reused: the pool is as large as the counter goes

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.device = "cpu"
        self.next = page_size  # page 0 is padding, as in the real allocators
        self.freed_tokens = 0

    def alloc(self, n: int) -> torch.Tensor:
        out = torch.arange(self.next, self.next + n, dtype=torch.int64)
        self.next += n
        return out

    def free(self, idx: torch.Tensor) -> None:
        self.freed_tokens += int(idx.numel())


class CountingStatePool(CountingKVAllocator):
    """State-slot stub: the same convention, ids from 1 (``freed_tokens`` counts slots)."""

    size = None

    def __init__(self) -> None:
        super().__init__(1)


class CountingReal:
    """Wraps a real allocator to count the tokens freed through it (by the cache or us)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.page_size = inner.page_size
        self.device = inner.device
        self.size = inner.size
        self.free_mask = inner.free_mask  # the cache checks the slots it adopts against it
        #: The cache frees its own nodes' slots through the bare allocator's unchecked
        #: ``free_owned``, exposed as is: the timed eviction pays no wrapper (the driver counts
        #: those frees from ``used_size``, outside the timers).
        self.free_owned: Callable[[torch.Tensor], None] = inner.free_owned
        #: and its one-pass free that also clears the cache's held marks, exposed as is too
        self.owned_release = inner.owned_release
        self.freed_tokens = 0

    def alloc(self, n: int) -> torch.Tensor:
        out = self.inner.alloc(n)
        if out is None:
            raise RuntimeError(f"allocator exhausted: {n} slots asked, {self.inner!r}")
        return out

    def free(self, idx: torch.Tensor) -> None:
        self.freed_tokens += int(idx.numel())
        self.inner.free(idx)

    def used_size(self) -> int:
        return self.inner.used_size()


@dataclass
class Setup:
    cache: RadixCache
    kv: Any
    states: Any
    allocator_desc: str


def build(args: argparse.Namespace, reqs: list[list[int]]) -> Setup:
    ps = args.page_size
    cfg = CacheConfig(page_size=ps, radix_eviction_policy=args.policy,
                      stateless_leaf="keep" if args.sglang_rules else "prune",
                      match_recency="usable" if args.sglang_rules else "matched")
    if args.allocator == "counter":
        kv: Any = CountingKVAllocator(ps)
        states: Any = CountingStatePool() if args.states else None
        desc = "counter (anchor convention: fresh ids from a counter, free only counts)"
    else:
        longest = max(len(r) for r in reqs)
        size = args.capacity + 4 * longest + 4 * ps
        size = (size + ps - 1) // ps * ps
        inner = TokenAllocator(size) if ps == 1 else PagedAllocator(size, ps)
        kv = CountingReal(inner)
        states = None
        if args.states:
            # live states <= capacity + the two slots of the request in flight
            states = MambaStatePool(args.mamba_capacity + 8, num_layers=1,
                                    conv_state_shape=(1, 1), ssm_state_shape=(1, 1, 1))
        desc = (f"real {type(inner).__name__}(size={size}"
                + (f", page_size={ps}" if ps > 1 else "") + ")"
                + (f" + MambaStatePool({args.mamba_capacity + 8})" if args.states else ""))
    cache = RadixCache(cfg, kv_allocator=kv, state_allocator=states)
    return Setup(cache, kv, states, desc)


# --------------------------------------------------------------------- run
def run(args: argparse.Namespace, keep: dict[str, Any] | None = None) -> dict[str, Any]:
    """Drive the workload; return the anchor's JSON fields. ``keep`` receives the setup."""
    reqs = make_workload(args)
    setup = build(args, reqs)
    if keep is not None:
        keep["setup"] = setup
    cache, kv, states = setup.cache, setup.kv, setup.states
    ps = args.page_size
    hybrid = bool(args.states)
    real = args.allocator == "real"
    grid = args.mamba_chunk
    T = dict(match=0.0, idx=0.0, lock=0.0, insert=0.0, evict=0.0, mevict=0.0)
    n_req = n_evict = n_mevict = n_branch = 0
    tok_req = tok_hit = tok_new = tok_evicted = states_evicted = 0
    pc = time.perf_counter
    keys = [RadixKey(t) for t in reqs]  # validated once, outside the timers (as the anchor)

    prof = cProfile.Profile() if args.profile else None
    gc.collect()
    if prof is not None:
        prof.enable()
    wall0 = pc()
    for toks, key in zip(reqs, keys, strict=True):
        n_req += 1
        n = len(toks)
        tok_req += n

        t0 = pc()
        m = cache.match_prefix(key)
        T["match"] += pc() - t0
        hit = m.prefix_len
        tok_hit += hit
        idx = m.device_indices
        node = m.last_device_node

        t0 = pc()
        cache.inc_lock_ref(node)
        cache.dec_lock_ref(node)
        T["lock"] += pc() - t0

        # fresh slots for [hit, n), whole pages (outside the timers)
        n_new = n - hit
        new = kv.alloc(-(-n_new // ps) * ps)
        value = torch.cat([idx, new[:n_new]]) if hit else new[:n_new]

        b = m.branching_seqlen if hybrid else None
        if b is not None and args.mamba_branch_checkpoint:
            b = b // grid * grid
            if b > hit:
                bkey = key[:b]
                bslot = int(states.alloc(1)[0])
                t0 = pc()
                bres = cache.insert(bkey, value[:b], state_slot=bslot)
                T["insert"] += pc() - t0
                n_branch += 1
                if not bres.state_adopted:
                    states.free(torch.tensor([bslot], dtype=torch.int64))
                # value[hit:b] is already in the tree: freed as duplicates after the insert below

        slot = int(states.alloc(1)[0]) if hybrid else None
        t0 = pc()
        res = cache.insert(key, value, state_slot=slot)
        T["insert"] += pc() - t0
        tok_new += n - res.prefix_len
        # the caller's slots the tree did not adopt (outside the timers)
        if res.prefix_len > hit:
            kv.free(value[hit:res.prefix_len])
        tail = res.inserted_len - hit
        if tail < len(new):
            kv.free(new[max(tail, 0):])
        if hybrid and not res.state_adopted:
            states.free(torch.tensor([slot], dtype=torch.int64))

        over = cache.total_size() - args.capacity
        if over > 0:
            used = kv.used_size() if real else 0
            t0 = pc()
            r = cache.evict(over)
            T["evict"] += pc() - t0
            if real:  # what reached the allocator (outside the timer)
                kv.freed_tokens += used - kv.used_size()
            n_evict += 1
            tok_evicted += r.num_tokens
        if hybrid:
            mover = cache.state_evictable_size() + cache.state_protected_size() - args.mamba_capacity
            if mover > 0:
                t0 = pc()
                r = cache.evict_states(mover)
                T["mevict"] += pc() - t0
                n_mevict += 1
                states_evicted += r.num_states
    wall = pc() - wall0
    if prof is not None:
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.profile)
        print(s.getvalue(), file=sys.stderr)

    if args.check:
        check = getattr(cache, "sanity_check", None)
        if check is None:
            from radix.diagnostics import check_cache as check_fn

            check_fn(cache)
        else:
            check()
    if args.allocator == "real":
        used, held = kv.used_size(), cache.total_size()
        # the tree's slots plus nothing else: every slot the tree did not adopt was freed
        if used != held:
            raise AssertionError(f"allocator holds {used} slots, the tree {held}: a leak")

    def rate(k: float, t: float) -> float | None:
        return round(k / t, 1) if t > 0 else None

    out: dict[str, Any] = {
        "impl": "hybrid-prefix-cache RadixCache" + (" KV+state" if hybrid else " KV"),
        "allocator": setup.allocator_desc,
        "workload": args.workload,
        "policy": args.policy,
        "page_size": ps,
        "requests": args.requests,
        "capacity_tokens": args.capacity,
        "wall_s": round(wall, 3),
        "hit_rate": round(tok_hit / tok_req, 4),
        "requested_tokens": tok_req,
        "final_nodes": cache.tree.num_nodes,
        "match_prefix_ops_s": rate(n_req, T["match"]),
        "match_plus_indices_ops_s": rate(n_req, T["match"] + T["idx"]),
        "match_prefix_Mtok_s": rate(tok_req / 1e6, T["match"]),
        "insert_ops_s": rate(n_req, T["insert"]),
        "insert_Mtok_s": rate(tok_req / 1e6, T["insert"]),
        "lock_unlock_pairs_s": rate(n_req, T["lock"]),
        "evict_calls": n_evict,
        "evict_ops_s": rate(n_evict, T["evict"]),
        "evicted_tokens": tok_evicted,
        "evict_Mtok_s": rate(tok_evicted / 1e6, T["evict"]),
        "time_s": {k: round(v, 4) for k, v in T.items()},
        "freed_tokens_seen_by_allocator": kv.freed_tokens,
        "new_tokens_inserted": tok_new,
        "note_match": "match_prefix returns device_indices: match == match_plus_indices",
    }
    if hybrid:
        out.update(
            mamba_capacity=args.mamba_capacity,
            mamba_evict_calls=n_mevict,
            mamba_evict_ops_s=rate(n_mevict, T["mevict"]),
            mamba_states_evicted=states_evicted,
            mamba_branch_checkpoint_inserts=n_branch,
            note_insert_ops="insert_ops_s counts requests; the branch-checkpoint inserts are "
            "spent inside the insert time too",
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = radix_ops_parser()
    args = parser.parse_args(argv)
    try:  # the policy, before the workload is built
        CacheConfig(page_size=args.page_size, radix_eviction_policy=args.policy)
    except ValueError as exc:
        parser.error(f"--policy: {exc}")
    torch.set_num_threads(1)
    print(json.dumps(run(args)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
