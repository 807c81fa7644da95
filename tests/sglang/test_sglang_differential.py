"""Differential tests: the SGLang front end against SGLang's own caches (0.5.23 and 0.5.12).

The same seeded operation sequences (inserts with and without states, with the matched
prefix's slots or with every slot fresh, matches that split nodes, locks and unlocks,
evictions of KV tokens and of states) run on this library through ``radix.sglang`` and on
SGLang's ``RadixCache`` / ``UnifiedRadixCache`` (full KV at page sizes 1 and 16; full KV +
Mamba at page size 1), and on SGLang 0.5.12's ``MambaRadixCache`` (page size 1; the library with the options
that give it that release's rules: ``state_recency="path"``, ``stateless_leaf="prune"``,
``match_recency="usable"``). Every operation's answer (prefix length, matched slots,
branching point, ``mamba_exist``, evicted counts), the sizes after it and the exact sets of KV slots and state slots the cache
gave back during it must be equal, operation by operation.

SGLang runs in the anchor environment (built by ``.ci/sglang-anchor-up``; default
``/tmp/sglang-anchor``), as a subprocess (``tests/sglang/anchor/sglang_driver.py``): these tests skip,
saying why, where it is not built. ``HPC_SGLANG_ANCHOR_PYTHON`` / ``HPC_SGLANG_ANCHOR_DIR``
point elsewhere (``tests/helpers/sglang_anchor.py``); ``HPC_SGLANG_DIFF_SEQUENCES`` / ``HPC_SGLANG_DIFF_OPS`` scale the run.

The slot ids come from this library's allocators (real pools); SGLang's side gets the same
ids in the script and only records what it frees.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from allocators import MambaStatePool, PagedAllocator, TokenAllocator
from radix.sglang import (
    CacheInitParams,
    EvictParams,
    InsertParams,
    MatchPrefixParams,
    RadixCache,
    RadixKey,
    ReqToTokenPool,
    UnifiedRadixCache,
)
from tests.helpers.sglang_anchor import ANCHOR_DIR, ANCHOR_PY, anchor_missing, legacy_missing

REPO = Path(__file__).resolve().parents[2]
DRIVER = REPO / "tests" / "sglang" / "anchor" / "sglang_driver.py"
SEQUENCES = int(os.environ.get("HPC_SGLANG_DIFF_SEQUENCES", "8"))
OPS = int(os.environ.get("HPC_SGLANG_DIFF_OPS", "300"))

#: (variant, SGLang class, page size): the caches compared.
#: (A hybrid cache at page > 1 is refused by the front end, as SGLang 0.5.23 refuses it
#: without the Mamba extra buffer, which the front end does not model.)
CONFIGS = [("kv", "radix", 1), ("kv", "radix", 16), ("kv", "unified", 1),
           ("kv", "unified", 16), ("mamba", "unified", 1)]
#: SGLang 0.5.12's ``MambaRadixCache`` (page size 1 only), and the options that give the
#: library its rules; its ``evict`` does not count what the KV walk freed on the way towards
#: the state target, so its scripts ask for one kind at a time.
LEGACY = "mamba-0.5.12"
LEGACY_RULES: dict[str, Any] = dict(state_recency="path", stateless_leaf="prune",
                                    match_recency="usable")


# ============================================================== our side
class Side:
    """The library's front end with real pools, and what each operation did."""

    def __init__(self, variant: str, impl: str, ps: int) -> None:
        self.ps = ps
        self.kv = TokenAllocator(1 << 20) if ps == 1 else PagedAllocator(1 << 20, ps)
        self.sp = MambaStatePool(1 << 14, num_layers=1, conv_state_shape=(1,),
                                 ssm_state_shape=(1,)) if variant == "mamba" else None
        pool = ReqToTokenPool(1, 1, mamba_pool=self.sp) if self.sp is not None else None
        cls = RadixCache if impl == "radix" else UnifiedRadixCache
        rules = LEGACY_RULES if impl == LEGACY else {}
        self.cache = cls(CacheInitParams(disable=False, req_to_token_pool=pool,
                                         token_to_kv_pool_allocator=self.kv, page_size=ps,
                                         **rules))
        self.locks: dict[int, Any] = {}

    def free_ids(self) -> tuple[np.ndarray, np.ndarray | None]:
        kv = self.kv.free_mask.copy()
        st = self.sp.free_mask.copy() if self.sp is not None else None
        return kv, st

    def freed_since(self, before: tuple[np.ndarray, np.ndarray | None]) -> tuple[list[int], list[int]]:
        kv_now, st_now = self.free_ids()
        pages = np.flatnonzero(kv_now & ~before[0])
        kv = sorted(int(p) * self.ps + i for p in pages for i in range(self.ps))
        st: list[int] = []
        if st_now is not None and before[1] is not None:
            st = sorted(int(s) for s in np.flatnonzero(st_now & ~before[1]))
        return kv, st

    def sizes(self) -> list[int]:
        c = self.cache
        out = [c.evictable_size(), c.protected_size()]
        if self.sp is not None:
            out += [c.mamba_evictable_size(), c.mamba_protected_size()]
        return out

    def apply(self, op: list[Any]) -> list[Any]:
        """Run one script operation; return the observation SGLang's driver makes."""
        before = self.free_ids()
        c = self.cache
        kind = op[0]
        answer: Any = None
        if kind == "insert":
            _, toks, value, prev, state = op
            res = c.insert(InsertParams(
                key=RadixKey(toks), value=torch.tensor(value, dtype=torch.int64),
                prev_prefix_len=prev,
                mamba_value=None if state is None else torch.tensor([state])))
            answer = [res.prefix_len, bool(res.mamba_exist)]
        elif kind in ("match", "lock"):
            m = c.match_prefix(MatchPrefixParams(key=RadixKey(op[1])))
            answer = [m.device_prefix_len, m.device_indices.tolist(),
                      m.mamba_branching_seqlen if self.sp is not None else None]
            if kind == "lock":
                self.locks[op[2]] = c.lock(m.last_device_node)
        elif kind == "unlock":
            c.unlock(self.locks.pop(op[1]))
        elif kind == "evict":
            r = c.evict(EvictParams(num_tokens=op[1], mamba_num=op[2]))
            answer = [r.num_tokens_evicted, r.mamba_num_evicted]
        kv, st = self.freed_since(before)
        c.sanity_check()
        return [answer, self.sizes(), kv, st]


# ============================================================== the sequences
def make_key(rng: random.Random, ps: int, pool: list[list[int]]) -> list[int]:
    """A key sharing a random prefix with an earlier one (or a fresh one), in pages plus a
    partial tail."""
    if pool and rng.random() < 0.8:
        base = rng.choice(pool)
        cut = rng.randrange(0, len(base) // ps + 1) * ps
        key = base[:cut]
    else:
        key = []
    key = key + [rng.randrange(1, 40) for _ in range(rng.randrange(1, 4) * ps + rng.randrange(ps))]
    pool.append(key)
    return key


def generate(variant: str, impl: str, ps: int, seed: int, n_ops: int
             ) -> tuple[dict[str, Any], list[Any]]:
    """A script and our observations, built together: an insert after a match reuses the
    matched slots (``prev_prefix_len``), as an engine does."""
    rng = random.Random(f"{variant}/{impl}/{ps}/{seed}")
    side = Side(variant, impl, ps)
    ops: list[Any] = []
    obs: list[Any] = []
    keys: list[list[int]] = []
    next_lock = 0

    def run(op: list[Any]) -> list[Any]:
        ops.append(op)
        got = side.apply(op)
        obs.append(got)
        return got

    while len(ops) < n_ops:
        r = rng.random()
        if r < 0.45:
            key = make_key(rng, ps, keys)
            if rng.random() < 0.7:
                m = run(["match", key])
                prefix = m[0][1]
            else:
                prefix = []
            need = -(-(len(key) - len(prefix)) // ps) * ps
            fresh = side.kv.alloc(need)
            assert fresh is not None
            value = (prefix + fresh.tolist())[: len(key)]
            state = None
            if side.sp is not None:  # SGLang's hybrid insert always takes a state
                got = side.sp.alloc(1)
                assert got is not None
                state = int(got[0])
            held_before = set(side.cache.all_values_flatten().tolist())
            o = run(["insert", key, value, len(prefix), state])
            held = set(side.cache.all_values_flatten().tolist())
            freed = set(o[2])
            left = [s for s in fresh.tolist() if s not in held and s not in freed]
            assert not set(left) & held_before
            if left:
                side.kv.free(torch.tensor(left, dtype=torch.int64))
            if state is not None and state not in set(
                    side.cache.all_mamba_values_flatten().tolist()):
                assert side.sp is not None
                side.sp.free(torch.tensor([state]))
        elif r < 0.6:
            run(["match", make_key(rng, ps, keys)])
        elif r < 0.72:
            run(["lock", make_key(rng, ps, keys), next_lock])
            next_lock += 1
        elif r < 0.84 and side.locks:
            run(["unlock", rng.choice(sorted(side.locks))])
        else:
            states = rng.randrange(0, 3) if side.sp is not None else 0
            tokens = rng.randrange(0, 3) * ps
            if impl == LEGACY and tokens and states:
                tokens, states = (tokens, 0) if rng.random() < 0.5 else (0, states)
            run(["evict", tokens, states])
    script = {"variant": variant, "impl": impl, "page_size": ps, "policy": "lru", "ops": ops}
    return script, obs


def run_anchor(scripts: list[dict[str, Any]]) -> list[Any]:
    proc = subprocess.run([str(ANCHOR_PY), str(DRIVER), str(ANCHOR_DIR)],
                          input=json.dumps(scripts), capture_output=True, text=True,
                          timeout=1800, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if proc.returncode:
        raise RuntimeError(f"SGLang driver failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def legacy_view(op: list[Any], obs: list[Any]) -> list[Any]:
    """Our observation as SGLang 0.5.12 reports it: its ``evict`` counts only what the walk
    asked for walked (KV tokens of the KV walk, states of the state walk), not what it freed
    on the way (the freed-slot sets stay compared exactly)."""
    if op[0] != "evict":
        return obs
    tokens, states = obs[0]
    return [[tokens if op[1] else 0, states if op[2] else 0], *obs[1:]]


def first_mismatch(script: dict[str, Any], ours: list[Any], theirs: list[Any]) -> str | None:
    if script["impl"] == LEGACY:
        ours = [legacy_view(op, o) for op, o in zip(script["ops"], ours, strict=True)]
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if a != b:
            ctx = script["ops"][max(0, i - 3): i + 1]
            return f"op {i} {script['ops'][i][:2]}: ours {a} != SGLang {b}; last ops {ctx}"
    return None


def check_sequences(seqs: list[tuple[dict[str, Any], list[Any], list[Any]]], variant: str,
                    impl: str) -> None:
    """Every sequence gives SGLang's observations, and the sequences did exercise what they
    are meant to (every kind of operation, evictions that freed KV slots and states, inserts
    that freed the caller's duplicates)."""
    bad = [m for s, o, t in seqs if (m := first_mismatch(s, o, t)) is not None]
    total = sum(len(s["ops"]) for s, _, _ in seqs)
    kinds = {op[0] for s, _, _ in seqs for op in s["ops"]}
    assert kinds == {"insert", "match", "lock", "unlock", "evict"}
    evicts = [o for s, obs, _ in seqs for op, o in zip(s["ops"], obs, strict=True)
              if op[0] == "evict"]
    assert any(o[2] for o in evicts), "no eviction freed a KV slot"
    if variant == "mamba":
        assert any(o[3] for o in evicts), "no eviction freed a state"
    inserts = [o for s, obs, _ in seqs for op, o in zip(s["ops"], obs, strict=True)
               if op[0] == "insert"]
    assert impl == "radix" or any(o[2] for o in inserts), "no insert freed a duplicate"
    assert not bad, f"{len(bad)} of {len(seqs)} sequences ({total} ops) differ; first: {bad[0]}"


@pytest.mark.skipif(legacy_missing() is not None, reason=str(legacy_missing()))
def test_path_recency_and_pruning_reproduce_sglang_0_5_12() -> None:
    """``state_recency="path"``, ``stateless_leaf="prune"``, ``match_recency="usable"`` against
    SGLang 0.5.12's ``MambaRadixCache`` (whose ``lru`` refreshes every state on a path)."""
    made = [generate("mamba", LEGACY, 1, seed, OPS) for seed in range(SEQUENCES)]
    theirs = run_anchor([s for s, _ in made])
    check_sequences([(s, o, t) for (s, o), t in zip(made, theirs, strict=True)], "mamba", LEGACY)


@pytest.fixture(scope="module")
def runs() -> dict[tuple[str, str, int], list[tuple[dict[str, Any], list[Any], list[Any]]]]:
    """Every configuration's sequences, ours and SGLang's observations (one SGLang process
    for all of them: importing SGLang takes most of its time)."""
    made = {cfg: [generate(*cfg, seed, OPS) for seed in range(SEQUENCES)] for cfg in CONFIGS}
    scripts = [s for seqs in made.values() for s, _ in seqs]
    theirs = iter(run_anchor(scripts))
    return {cfg: [(s, o, next(theirs)) for s, o in seqs] for cfg, seqs in made.items()}


@pytest.mark.skipif(anchor_missing() is not None, reason=str(anchor_missing()))
@pytest.mark.parametrize(("variant", "impl", "ps"), CONFIGS)
def test_same_answers_sizes_and_freed_slots_as_sglang(
        runs: dict[tuple[str, str, int], list[tuple[dict[str, Any], list[Any], list[Any]]]],
        variant: str, impl: str, ps: int) -> None:
    check_sequences(runs[(variant, impl, ps)], variant, impl)
