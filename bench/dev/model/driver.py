"""Multi-request driver: a real hybrid model served through our cache, every request checked.

Per request (``L`` prompt tokens, ``P`` page size, ``F = L // P * P``, ``U`` usable prefix)::

    prompt   |<-------- U -------->|<------------ computed now ------------>|
             [ tree slots (match)  ][ own slots: whole pages ... F ][ tail page ]
             0                     U      c1     b      c2         F     L

1. ``m = cache.match_prefix(prompt[:L-1])`` (at least one token is computed, for its logits),
   ``inc_lock_ref(m.last_device_node)``; the request's own state slot receives a copy of
   ``m.state_slot`` (copy-on-write; the tree's slot is never written).
2. KV slots for ``[U, ceil(L/P)*P)`` in one allocation; on a shortfall ``evict`` (and
   ``evict_swa``), on a state shortfall ``evict_states``.
3. The model runs ``[U, L)`` in segments ending at the checkpoints the cache asks for: chunk
   ends ``c1, c2`` (multiples of ``chunk_size``), ``branching_seqlen`` ``b`` and ``F``. At each
   checkpoint ``< L`` a fresh state slot gets a copy of the running state and
   ``cache_unfinished_req`` inserts the prefix so far (no slot to be had: checkpoint skipped);
   a sliding-window model first releases the SWA KV that slid out of its window (``release_swa``).
   Each segment is one :meth:`ModelAdapter.forward`: the cache object is rebuilt from our pools.
4. At ``L``: ``cache_finished_req`` (the running state itself is the checkpoint when
   ``F == L``), the partial tail page is freed, and the logits of ``[U, L)`` are compared with
   a full forward over the whole prompt (``torch.testing.assert_close``, default tolerances).

At most ``concurrency`` requests run at once, one segment each in turn, so evictions happen
while other requests hold locks.

With HiCache (``DriverConfig.hicache``, the library's host tier): device evictions demote
backed-up nodes to host memory, and a match that reports host-only tokens
(``host_hit_length``) loads them back (``load_back``) and matches again, so the prefix the
model resumes from has made the round trip device -> host -> device.

Library issues this driver runs into (pinned as strict xfails in ``tests/model/test_model_*.py``):
a sliding-window model with 2 requests in flight (a running request's window rewritten to
another request's tombstone), and HiCache at page size 1 (``cache_*_req`` free slots that
``insert`` just gave to host-only nodes).
"""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from allocators import MambaStatePool
from bench.dev.model.adapter import (
    ARCHITECTURES,
    CacheLayout,
    ModelAdapter,
    ModelPools,
    build_tiny_model,
)
from bench.dev.model.options import model_parser
from hicache import HiCacheConfig
from radix import CacheConfig, CacheRequest, MatchResult, RadixCache, RadixKey

__all__ = [
    "DriverConfig",
    "DriverReport",
    "ModelDriver",
    "RequestCheck",
    "tree_prompts",
]


@dataclass(frozen=True)
class DriverConfig:
    """Sizes and knobs of one run.

    Attributes:
        arch: a name from :data:`bench.dev.model.adapter.ARCHITECTURES`.
        page_size: tokens per KV page (the cache matches and stores whole pages).
        kv_tokens: KV pool size [tokens] (full-attention pool with sliding layers).
        swa_tokens: SWA pool size [tokens] (sliding layers only; default ``kv_tokens``).
        state_slots: recurrent-state pool size [slots] (recurrent layers only).
        chunk_size: prefill chunk [tokens], a multiple of ``page_size``.
        concurrency: requests in flight at most.
        policy: radix eviction policy name (``None``: the default, LRU).
        seed: model weights seed.
        hicache: the host tier's configuration, or ``None`` for a device-only cache.
    """

    arch: str
    page_size: int = 1
    kv_tokens: int = 512
    swa_tokens: int | None = None
    state_slots: int = 10
    chunk_size: int = 32
    concurrency: int = 2
    policy: str | None = None
    seed: int = 0
    hicache: HiCacheConfig | None = None

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"unknown arch {self.arch!r}; known: {sorted(ARCHITECTURES)}")
        if self.chunk_size < 1 or self.chunk_size % self.page_size:
            raise ValueError(f"chunk_size ({self.chunk_size}) must be a positive multiple of "
                             f"page_size ({self.page_size})")
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")


@dataclass(frozen=True)
class RequestCheck:
    """One request's outcome: lengths [tokens] and the largest logit difference seen."""

    rid: int
    prompt_len: int
    prefix_len: int
    kv_hit_len: int
    segments: int
    max_abs_diff: float


@dataclass
class DriverReport:
    """Every request's check plus the cache's and the driver's counters."""

    checks: list[RequestCheck] = field(default_factory=list)
    checkpoints: int = 0
    branch_checkpoints: int = 0
    skipped_checkpoints: int = 0
    loaded_back_tokens: int = 0
    host_hits_not_loaded: int = 0
    seconds: float = 0.0
    cache_stats: dict = field(default_factory=dict)

    @property
    def max_abs_diff(self) -> float:
        return max((c.max_abs_diff for c in self.checks), default=0.0)

    @property
    def reused_tokens(self) -> int:
        return sum(c.prefix_len for c in self.checks)


@dataclass
class _Running:
    rid: int
    prompt: torch.Tensor
    req: CacheRequest
    tail: torch.Tensor            # slots of [F, ceil(L/P)*P): never handed to the cache
    state_slot: int | None        # the request's own running state
    ends: list[int]               # segment ends, ascending, last == L
    checkpoints: set[int]
    branch: int | None            # branching_seqlen when it is a checkpoint
    pos: int
    prefix_len: int
    kv_hit_len: int
    logits: list[torch.Tensor] = field(default_factory=list)


class ModelDriver:
    """Serve prompts with a tiny real model through a :class:`RadixCache` and check each one.

    Raises (from :meth:`run` / :meth:`run_request`): ``AssertionError`` when a request's logits
    differ from the full forward; ``RuntimeError`` when the pools cannot hold the requests in
    flight even after evicting everything evictable.
    """

    def __init__(self, config: DriverConfig) -> None:
        self.config = config
        self.model = build_tiny_model(config.arch, config.seed)
        self.layout = CacheLayout.from_model(self.model)
        self.pools = ModelPools(self.layout, kv_tokens=config.kv_tokens,
                                page_size=config.page_size, state_slots=config.state_slots,
                                swa_tokens=config.swa_tokens)
        self.adapter = ModelAdapter(self.model, self.pools)
        self.cache = RadixCache(
            CacheConfig(page_size=config.page_size, radix_eviction_policy=config.policy,
                        sliding_window_size=self.layout.sliding_window if self.layout.swa_layers else None),
            kv_allocator=self.pools.kv_allocator,
            state_allocator=self.pools.state_pool,
            hicache=config.hicache,
        )
        self.report = DriverReport()
        self._refs: dict[tuple[int, ...], torch.Tensor] = {}
        self._next_rid = 0

    # ================================================================== running
    def run(self, prompts: list[list[int]]) -> DriverReport:
        """Serve ``prompts`` (at most ``concurrency`` at once, one segment each in turn)."""
        t0 = time.perf_counter()
        pending = deque(prompts)
        running: deque[_Running] = deque()
        while pending or running:
            while pending and len(running) < self.config.concurrency:
                running.append(self._admit(pending.popleft()))
            run = running.popleft()
            if not self._step(run):
                running.append(run)
        self.report.seconds += time.perf_counter() - t0
        self.report.cache_stats = self.cache.stats()
        return self.report

    def run_request(self, prompt: list[int]) -> RequestCheck:
        """Serve one prompt alone; return its check."""
        self.run([prompt])
        return self.report.checks[-1]

    # ================================================================== admission
    def _admit(self, prompt: list[int]) -> _Running:
        cfg, cache = self.config, self.cache
        n = len(prompt)
        if n < 2:
            raise ValueError("prompts need at least 2 tokens")
        key = RadixKey(prompt[:-1])
        m = self._match(key)
        lock = cache.inc_lock_ref(m.last_device_node)
        u, ps = m.prefix_len, cfg.page_size
        state_slot = None
        if self.layout.hybrid:
            state_slot = self._alloc_state()
            if state_slot is None:
                raise RuntimeError("state pool too small for the requests in flight")
            if u > 0:
                assert m.state_slot is not None, "a usable hybrid prefix without a state"
                self._state_pool.copy(m.state_slot, state_slot)  # copy-on-write
        full = n // ps * ps
        new = self._alloc_kv(-(-n // ps) * ps - u)
        req = CacheRequest(key=prompt, kv_indices=torch.cat([m.device_indices, new[:full - u]]),
                           cached_len=u, last_node=m.last_device_node, rid=self._next_rid,
                           lock=lock)
        checkpoints = {c for c in range(cfg.chunk_size, n, cfg.chunk_size) if c > u}
        b = m.branching_seqlen if m.branching_seqlen is not None and u < m.branching_seqlen < n else None
        if b is not None:
            checkpoints.add(b)
        if u < full < n:
            checkpoints.add(full)
        run = _Running(self._next_rid, torch.tensor(prompt, dtype=torch.int64), req,
                       new[full - u:], state_slot, sorted(checkpoints | {n}), checkpoints, b,
                       u, u, m.kv_hit_length)
        self._next_rid += 1
        return run

    def _match(self, key: RadixKey) -> MatchResult:
        """``match_prefix``, and with HiCache the host-only part loaded back and matched again."""
        m = self.cache.match_prefix(key)
        if m.host_hit_length > 0:
            assert m.last_host_node is not None
            loaded = self.cache.load_back(m.last_host_node)
            if loaded == 0:  # below the threshold, or no device room even after evicting
                self.report.host_hits_not_loaded += 1
                return m
            self.report.loaded_back_tokens += loaded
            m = self.cache.match_prefix(key)
        return m

    # ================================================================== one segment
    def _step(self, run: _Running) -> bool:
        """Compute the next segment of ``run``; return True when the request finished."""
        end = run.ends[len(run.logits)]
        row = torch.cat([run.req.kv_indices, run.tail])
        run.logits.append(self.adapter.forward(run.prompt[run.pos:end], start=run.pos, row=row,
                                               state_slot=run.state_slot))
        run.pos = end
        if end < len(run.prompt):
            if end in run.checkpoints:
                self._checkpoint(run, end)
            return False
        self._finish(run)
        return True

    def _checkpoint(self, run: _Running, pos: int) -> None:
        slot = None
        if self.layout.hybrid:
            slot = self._alloc_state()
            if slot is None:
                self.report.skipped_checkpoints += 1
                return
            assert run.state_slot is not None
            self._state_pool.copy(run.state_slot, slot)
        if self.cache.swa is not None:
            self.cache.release_swa(run.req, pos)
        self.cache.cache_unfinished_req(run.req, state_slot=slot, upto=pos)
        self.report.checkpoints += 1
        self.report.branch_checkpoints += pos == run.branch

    def _finish(self, run: _Running) -> None:
        cache, req, n = self.cache, run.req, len(run.prompt)
        full = len(req.kv_indices)
        if self.layout.hybrid and full == n:
            cache.cache_finished_req(req, state_slot=run.state_slot, upto=n)  # the tree takes it or frees it
        elif self.layout.hybrid:
            # The state at F was checkpointed (or skipped): keep only what is cached already.
            cache.cache_finished_req(req, upto=req.cached_len)
            assert run.state_slot is not None
            self._state_pool.free(torch.tensor([run.state_slot], dtype=torch.int64))
        else:
            if cache.swa is not None:
                cache.release_swa(req, full)
            cache.cache_finished_req(req, upto=full)
        run.state_slot = None
        if len(run.tail):
            self.pools.kv_allocator.free(run.tail)
        cache.poll_transfers()  # finished device -> host copies release their locks
        cache.sanity_check()
        self._check(run)

    def _check(self, run: _Running) -> None:
        ref = self._reference(run.prompt)[run.prefix_len:]
        got = torch.cat(run.logits)
        diff = float((got - ref).abs().max())
        self.report.checks.append(RequestCheck(run.rid, len(run.prompt), run.prefix_len,
                                               run.kv_hit_len, len(run.logits), diff))
        torch.testing.assert_close(
            got, ref, msg=lambda m: f"request {run.rid} (prompt {len(run.prompt)} tokens, "
                                    f"cached prefix {run.prefix_len}): {m}")

    def _reference(self, prompt: torch.Tensor) -> torch.Tensor:
        key = tuple(prompt.tolist())
        ref = self._refs.get(key)
        if ref is None:
            ref = self._refs[key] = self.adapter.reference_logits(prompt)
        return ref

    # ================================================================== memory
    def _alloc_kv(self, n: int) -> torch.Tensor:
        alloc, cache = self.pools.kv_allocator, self.cache
        while True:
            slots = alloc.alloc(n)
            if slots is not None:
                return slots
            freed = 0
            if cache.swa is not None:
                short = n - alloc.swa_available_size()
                if short > 0:
                    freed += cache.evict_swa(short).num_swa_tokens
                short = n - alloc.full_available_size()
            else:
                short = n - alloc.available_size()
            if short > 0:
                freed += cache.evict(short).num_tokens
            if freed == 0:
                raise RuntimeError(f"KV pool too small: {n} slots wanted, nothing evictable")

    @property
    def _state_pool(self) -> MambaStatePool:
        pool = self.pools.state_pool
        assert pool is not None, "a model without recurrent layers has no state pool"
        return pool

    def _alloc_state(self) -> int | None:
        pool = self._state_pool
        slot = pool.alloc(1)
        if slot is None and self.cache.evict_states(1).num_states:
            slot = pool.alloc(1)
        return None if slot is None else int(slot[0])


# ====================================================================== prompts
def tree_prompts(n: int, *, vocab: int, seed: int = 0, roots: int = 3,
                 min_len: int = 12, max_len: int = 96) -> list[list[int]]:
    """``n`` prompts sharing prefixes in a tree: a few root "system prompts", then each prompt
    extends a prefix of an earlier one (a whole earlier prompt, a cut inside it, or an exact
    repeat). Deterministic in ``seed``."""
    rng = random.Random(seed)

    def fresh(k: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(k)]

    pool = [fresh(rng.randint(min_len, 48)) for _ in range(roots)]
    out: list[list[int]] = []
    while len(out) < n:
        parent = rng.choice(pool)
        kind = rng.random()
        if kind < 0.1 and out:
            prompt = list(rng.choice(out))                      # exact repeat
        elif kind < 0.4:
            prompt = parent + fresh(rng.randint(1, 30))          # extend a whole prompt
        else:
            cut = rng.randint(min(len(parent), 4), len(parent))  # fork inside it
            prompt = parent[:cut] + fresh(rng.randint(4, 40))
        prompt = prompt[:max_len]
        if len(prompt) < min_len:
            prompt += fresh(min_len - len(prompt))
        out.append(prompt)
        pool.append(prompt)
    return out


# ====================================================================== CLI
def main(argv: list[str] | None = None) -> None:
    """Print one row per (architecture, page size): requests, reused tokens, evictions, the
    largest logit difference, seconds; a row that fails says why."""
    args = model_parser().parse_args(argv)
    torch.set_num_threads(1)
    hc = HiCacheConfig(hicache_ratio=4.0, hicache_write_policy=args.hicache) if args.hicache else None
    print(f"{'arch':<12} {'page':>4} {'reqs':>4} {'reused':>6} {'evicted':>7} {'ev.states':>9} "
          f"{'ev.swa':>6} {'loaded':>6} {'max |diff|':>10} {'s':>5}")
    for arch in args.arch:
        for ps in args.page_size:
            try:
                d = ModelDriver(DriverConfig(arch, page_size=ps, seed=args.seed,
                                             concurrency=args.concurrency, hicache=hc))
            except ValueError as exc:  # e.g. HiCache with a sliding-window model
                print(f"{arch:<12} {ps:>4} not run: {exc}")
                continue
            try:
                r = d.run(tree_prompts(args.prompts, vocab=d.model.config.vocab_size, seed=args.seed))
            except (AssertionError, ValueError, RuntimeError) as exc:
                print(f"{arch:<12} {ps:>4} FAIL after {len(d.report.checks)} requests: "
                      f"{type(exc).__name__}: {str(exc).splitlines()[0]}")
                continue
            st = r.cache_stats
            print(f"{arch:<12} {ps:>4} {len(r.checks):>4} {r.reused_tokens:>6} "
                  f"{st['evicted_tokens']:>7} {st['evicted_states']:>9} "
                  f"{st['evicted_swa_tokens']:>6} {r.loaded_back_tokens:>6} "
                  f"{r.max_abs_diff:>10.2e} {r.seconds:>5.1f}")


if __name__ == "__main__":
    main()
