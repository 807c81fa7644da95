"""A discrete-event engine simulator over the replay's cache-driving engine (one GPU).

:class:`bench.engine.core.ReplayEngine` decides what the cache sees (match, lock, allocate, chunk
and branch checkpoints, finish); this module decides *when*, and so adds time: TTFT,
queueing delay and throughput beside the cache metrics.

Time model (simulated seconds)::

    arrival_i      = timestamp_i * time_scale               (--arrivals trace)
                     or: the moment one of `concurrency` clients is free (--arrivals closed)
    prefill step   = sum over its chunks of cost(a, b)      [s]   (a, b: token positions)
    decode step    = decode_ms / 1000                       [s]   (one token for every decoding request)
    TTFT_i         = end of the step holding i's last prefill chunk - arrival_i
    queueing_i     = start of i's first prefill step - arrival_i

``cost(a, b) = d*(b - a) + e*(b*b - a*a)/2e5`` is the GDS cost model of ``components.eviction.gds`` with the same
``d``, ``e``; its unit is **seconds of the GLM prefill fit** (d = 18.6 us per token, i.e. about
54K tokens/s, plus the attention term). A chunk from position ``a`` to ``b`` of a request
whose usable cached prefix is ``U`` starts at ``a >= U``: cache hits shorten prefill exactly
by ``cost(0, U)``.

Sessions (trace arrivals): a request whose session's previous request (``TraceRequest.session``,
set by TraceLab and the generated workloads) has not finished when its timestamp comes waits
and arrives the moment that one finishes: a client sends its next turn, or an agent its next
step, only after the answer came back. Traces without sessions are unaffected.

Scheduler (SGLang's default loop, without mixed prefill/decode batches): at each step
boundary arrivals join a FIFO queue; if there is prefill work, one *prefill step* runs, else
one *decode step* (consecutive decode steps with nothing to change are taken in one jump).
A prefill step has a budget of ``max_prefill_tokens`` (default: ``chunk_size``): requests
already in prefill continue first, in admission order; what is left of the budget admits
requests from the head of the queue while fewer than ``max_running_requests`` run and memory
fits. *Memory fits* is checked before the cache is touched, conservatively: the KV pool's free
plus evictable tokens hold the whole prompt plus output (pages), and a state slot is free or
two unlocked states exist (the match may lock one). Otherwise the head waits (head-of-line
blocking: memory is short, requests queue) until a running request finishes. A request that
does not fit with nothing running is skipped. Over a unified arena (``EngineConfig.arena``)
the check sees the pages KV owns now and not the free state chunks the arena would move to
KV on a shortfall: it errs the same way, towards waiting. Admission calls ``ReplayEngine.admit`` (which
allocates prompt and output KV and places every checkpoint at once; prefill is FIFO, so no
later request computes on KV before its producer); the first output token comes with the
last prefill chunk, the other ``output_length - 1`` take one decode step each; then
``ReplayEngine.finish``. Checkpoint positions follow the engine model (every ``chunk_size``
tokens from ``U``, and the branch point), not the step boundaries of the budget.

Policies: every ``components.eviction.registry`` name, plus the replay baselines ``marconi``, ``seglen``,
``belady`` and ``belady_state`` (run on the ``gds`` policy with a replay-side state walk;
``marconi``, ``seglen`` and ``belady`` also order the KV leaves: :mod:`bench.policies.strategies`,
:mod:`bench.dev.policies.utility`, :mod:`bench.dev.policies.offline`).
Marconi's alpha is tuned as in the paper: alpha 0 until the first state eviction, at request
``k``; the first ``W = min(10 (k+1), max(k+1, n/4))`` requests are then replayed once per alpha
of the grid, the alpha with the highest token hit rate wins (ties: the smaller), and the run
uses it from request ``W`` on (alpha 0 before, as the online system would).
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np

from bench.engine.arena import make_engine
from bench.engine.core import EngineConfig, EngineCounters
from bench.engine.metrics import COST_D, COST_E, ReplayMetrics, prefill_cost, summarize
from bench.engine.presets import get_preset
from bench.policies import baselines
from bench.policies.baselines import BaselineContext
from bench.policies.strategies import (
    MarconiStrategy,
    NextUseIndex,
    StateStrategy,
    state_walk_factory,
)
from bench.traces.loader import TraceRequest

__all__ = [
    "MARCONI_ALPHAS",
    "MarconiTuning",
    "SimConfig",
    "SimResult",
    "Simulator",
    "TimingMetrics",
    "run_policy",
    "tune_marconi",
]

Arrivals = Literal["trace", "closed"]

MARCONI_ALPHAS = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0)
"""Grid searched for Marconi's alpha."""


@dataclass(frozen=True, slots=True)
class SimConfig:
    """One simulated run.

    Attributes:
        engine: the cache and engine sizes; ``engine.concurrency`` is the scheduler's
            ``max_running_requests`` (and the number of clients with closed arrivals).
        policy: the reported policy: a ``components.eviction.registry`` name (then ``engine.policy``) or a
            replay-only baseline, ``marconi`` / ``belady`` (then ``engine.policy == "gds"``).
        time_scale: arrival time = trace timestamp x this (2.0 halves the request rate).
        decode_ms: one decode step [ms].
        max_prefill_tokens: token budget of one prefill step (``None``: ``chunk_size``).
        arrivals: ``trace`` (timestamps) or ``closed`` (``concurrency`` clients).
        cost_d, cost_e: prefill cost model [s of the GLM fit] (``components.eviction.gds``).
        model: preset whose bytes Marconi's FLOP efficiency uses.
        marconi_alpha: fixed alpha (``None``: tuned on a prefix of the trace).
        marconi_alphas: the tuning grid.
    """

    engine: EngineConfig
    policy: str = ""
    time_scale: float = 1.0
    decode_ms: float = 20.0
    max_prefill_tokens: int | None = None
    arrivals: Arrivals = "trace"
    cost_d: float = COST_D
    cost_e: float = COST_E
    model: str = "marconi-7b"
    marconi_alpha: float | None = None
    marconi_alphas: tuple[float, ...] = MARCONI_ALPHAS

    def __post_init__(self) -> None:
        if not self.policy:
            object.__setattr__(self, "policy", self.engine.policy)
        if baselines.get(self.policy) is not None:
            if self.engine.policy != "gds":
                raise ValueError(f"policy {self.policy!r} runs on engine.policy 'gds'")
            if not self.engine.state_slots:
                raise ValueError(f"policy {self.policy!r} needs state slots (a hybrid model)")
        elif self.policy != self.engine.policy:
            raise ValueError(f"policy {self.policy!r} != engine.policy {self.engine.policy!r}")
        if not (math.isfinite(self.time_scale) and self.time_scale > 0):
            raise ValueError(f"time_scale must be > 0, got {self.time_scale!r}")
        if not (math.isfinite(self.decode_ms) and self.decode_ms >= 0):
            raise ValueError(f"decode_ms must be >= 0, got {self.decode_ms!r}")
        if self.max_prefill_tokens is not None and self.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {self.max_prefill_tokens}")
        if self.arrivals not in ("trace", "closed"):
            raise ValueError(f"arrivals must be 'trace' or 'closed', got {self.arrivals!r}")
        for name in ("cost_d", "cost_e"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be finite and >= 0, got {v!r}")
        get_preset(self.model)

    @classmethod
    def of(cls, policy: str, **kw: Any) -> SimConfig:
        """``SimConfig`` for ``policy`` with engine fields and simulator fields mixed in ``kw``
        (``marconi`` / ``belady`` get the ``gds`` engine policy)."""
        eng_fields = set(EngineConfig.__dataclass_fields__)
        eng = {k: v for k, v in kw.items() if k in eng_fields}
        sim = {k: v for k, v in kw.items() if k not in eng_fields}
        eng["policy"] = "gds" if baselines.get(policy) is not None else policy
        return cls(EngineConfig(**eng), policy, **sim)

    @property
    def budget(self) -> int:
        return self.max_prefill_tokens or self.engine.chunk_size


@dataclass(frozen=True, slots=True)
class TimingMetrics:
    """What the clock says (seconds unless named otherwise), over the served requests."""

    ttft_mean: float
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    queue_mean: float
    queue_p50: float
    queue_p90: float
    queue_p99: float
    e2e_mean: float
    makespan_s: float
    prefill_busy_s: float
    requests_per_s: float
    output_tokens: int
    output_tokens_per_s: float
    output_tokens_per_min_per_gpu: float

    @classmethod
    def of(cls, arrival: np.ndarray, admitted: np.ndarray, first: np.ndarray,
           finished: np.ndarray, output: np.ndarray, prefill_busy: float) -> TimingMetrics:
        served = ~np.isnan(finished)
        ttft = (first - arrival)[served]
        queue = (admitted - arrival)[served]
        e2e = (finished - arrival)[served]

        def pct(x: np.ndarray) -> tuple[float, float, float]:
            if not x.size:
                return 0.0, 0.0, 0.0
            p50, p90, p99 = (float(v) for v in np.percentile(x, [50, 90, 99]))
            return p50, p90, p99

        def mean(x: np.ndarray) -> float:
            return float(x.mean()) if x.size else 0.0

        span = float(finished[served].max() - arrival[served].min()) if served.any() else 0.0
        out = int(output[served].sum())
        per_s = out / span if span > 0 else 0.0
        t50, t90, t99 = pct(ttft)
        q50, q90, q99 = pct(queue)
        return cls(
            ttft_mean=mean(ttft), ttft_p50=t50, ttft_p90=t90, ttft_p99=t99,
            queue_mean=mean(queue), queue_p50=q50, queue_p90=q90, queue_p99=q99,
            e2e_mean=mean(e2e), makespan_s=span, prefill_busy_s=prefill_busy,
            requests_per_s=int(served.sum()) / span if span > 0 else 0.0,
            output_tokens=out, output_tokens_per_s=per_s,
            output_tokens_per_min_per_gpu=per_s * 60.0,
        )


@dataclass(frozen=True, slots=True)
class MarconiTuning:
    """How Marconi's alpha was chosen: first state eviction at request ``first_eviction``,
    tuning window of ``window`` requests, token hit rate per alpha, the winner."""

    alpha: float
    window: int
    first_eviction: int | None
    hit_rates: dict[float, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class SimResult:
    """One simulated run: its config, cache metrics, timing, counters and costs."""

    config: SimConfig
    metrics: ReplayMetrics
    timing: TimingMetrics
    counters: EngineCounters
    wall_s: float
    cache_stats: dict[str, Any]
    tuning: MarconiTuning | None = None

    @property
    def label(self) -> str:
        return self.config.policy


@dataclass(slots=True)
class _Job:
    """A request in prefill: computed up to ``pos`` of ``end`` prompt tokens."""

    idx: int
    pos: int
    end: int


class Simulator:
    """Runs one :class:`SimConfig` over a trace (see the module docstring).

    Args:
        trace: requests in trace order (timestamps non-decreasing).
        config: the run.
        next_use: a prebuilt :class:`NextUseIndex` for ``belady`` (built here if ``None``).
        alpha_switch: ``(W, alpha)``: Marconi uses ``alpha`` from request ``W`` on.
    """

    def __init__(self, trace: Sequence[TraceRequest], config: SimConfig, *,
                 next_use: NextUseIndex | None = None,
                 alpha_switch: tuple[int, float] | None = None) -> None:
        self.trace = trace
        self.cfg = config
        self._walks: list[StateStrategy] = []
        self.engine = make_engine(config.engine, state_walk=self._state_walk(next_use))
        self._order_kv_leaves()
        self._alpha_switch = alpha_switch
        n = len(trace)
        ts = np.fromiter((r.timestamp_s for r in trace), np.float64, n)
        self.arrival = ts * config.time_scale if config.arrivals == "trace" else np.full(n, np.nan)
        self.admitted = np.full(n, np.nan)
        self.first_token = np.full(n, np.nan)
        self.finished = np.full(n, np.nan)
        self.prefill_busy = 0.0
        self.t = 0.0
        self._waiting: deque[int] = deque()
        self._prefilling: deque[_Job] = deque()
        self._decoding: list[tuple[int, int]] = []  # (decode step that ends it, request)
        self._decode_steps = 0
        self._running: set[int] = set()
        self._next = 0  # next request to arrive
        self.admit_count = 0  # requests taken from the queue (admitted or skipped)
        self._released = min(config.engine.concurrency, n)  # closed arrivals: issued so far
        if config.arrivals == "closed":
            self.arrival[: self._released] = 0.0
        self._pred = _session_predecessors(trace) if config.arrivals == "trace" else None
        self._done = np.zeros(n, dtype=bool)  # finished or skipped
        self._blocked: dict[int, int] = {}  # unfinished request -> its session's next one

    def _order_kv_leaves(self) -> None:
        """A baseline that orders KV leaves too (``belady``, ``seglen``, ``marconi``) installs
        its order on the cache."""
        base = baselines.get(self.cfg.policy)
        if base is not None and base.order_kv is not None and self.strategy is not None:
            base.order_kv(self.engine.cache, self.strategy)

    def _state_walk(self, next_use: NextUseIndex | None
                    ) -> Callable[[Callable[[Any], bool]], StateStrategy] | None:
        """The ``state_walk=`` factory of a baseline run (``None`` for a library policy; the
        baselines are registered by name in :mod:`bench.policies.baselines`)."""
        cfg = self.cfg
        base = baselines.get(cfg.policy)
        if base is None:
            return None
        built: list[NextUseIndex] = [next_use] if next_use is not None else []

        def index() -> NextUseIndex:
            if not built:
                built.append(NextUseIndex(self.trace, cfg.engine.page_size))
            return built[0]

        ctx = BaselineContext(self.trace, cfg.engine.page_size, cfg.model, cfg.cost_d,
                              cfg.cost_e, cfg.marconi_alpha, index)
        return state_walk_factory(base.walk(ctx), self._walks)

    @property
    def strategy(self) -> StateStrategy | None:
        """The replay-side state walk the cache uses now (``None`` for a library policy)."""
        return self._walks[-1] if self._walks else None

    # ------------------------------------------------------------------ loop
    def run(self, stop: Callable[[Simulator], bool] | None = None,
            on_admit: Callable[[], None] | None = None) -> bool:
        """Simulate until every request finished (``True``) or ``stop(self)`` held after an
        admission (``False``; the cache is then left mid-run)."""
        decode_s = self.cfg.decode_ms / 1000.0
        while True:
            self._arrive()
            before = self.admit_count
            if self._prefill_step():
                if on_admit is not None:
                    for _ in range(self.admit_count - before):
                        on_admit()
                if stop is not None and stop(self):
                    return False
                continue
            if self._decoding:
                self._decode_jump(decode_s)
                continue
            nxt = self._next_arrival()
            if math.isinf(nxt):
                break
            self.t = max(self.t, nxt)
        self._check_done()
        return True

    def _arrive(self) -> None:
        n = len(self.trace)
        limit = self._released if self.cfg.arrivals == "closed" else n
        pred = self._pred
        while self._next < limit and self.arrival[self._next] <= self.t:
            i = self._next
            self._next += 1
            if pred is not None and pred[i] >= 0 and not self._done[pred[i]]:
                self._blocked[int(pred[i])] = i  # arrives when its predecessor is done
            else:
                self._waiting.append(i)

    def _unblock(self, i: int) -> None:
        """Request ``i`` is done: its session's next request, if it came early, arrives now."""
        self._done[i] = True
        k = self._blocked.pop(i, None)
        if k is not None:
            self.arrival[k] = max(self.arrival[k], self.t)
            self._waiting.append(k)

    def _next_arrival(self) -> float:
        if self.cfg.arrivals == "closed" or self._next >= len(self.trace):
            return math.inf
        return float(self.arrival[self._next])

    def _release(self) -> None:
        """Closed arrivals: a client is free, it issues the next request now."""
        if self.cfg.arrivals == "closed" and self._released < len(self.trace):
            self.arrival[self._released] = self.t
            self._released += 1

    def _prefill_step(self) -> bool:
        """Run one prefill step if there is prefill work; False if there is none."""
        budget = self.cfg.budget
        chunks: list[tuple[_Job, int]] = []
        for job in self._prefilling:
            take = min(job.end - job.pos, budget)
            chunks.append((job, take))
            budget -= take
            if budget == 0:
                break
        while budget > 0 and self._waiting and len(self._running) < self.cfg.engine.concurrency:
            new = self._admit_head()
            if new is None:
                break  # memory short: the head waits
            if new.pos == new.end:
                continue  # skipped
            take = min(new.end - new.pos, budget)
            chunks.append((new, take))
            budget -= take
        if not chunks:
            return False
        step = 0.0
        for job, take in chunks:
            step += float(prefill_cost(job.pos, job.pos + take, self.cfg.cost_d, self.cfg.cost_e))
            job.pos += take
        self.t += step
        self.prefill_busy += step
        # the budget is handed out in admission order, so the jobs done form a prefix
        while self._prefilling and self._prefilling[0].pos == self._prefilling[0].end:
            self._first_token(self._prefilling.popleft().idx)
        assert all(j.pos < j.end for j in self._prefilling)
        return True

    def _admit_head(self) -> _Job | None:
        """Admit the head of the queue: its job, a finished dummy if skipped, or ``None``
        when memory is short and requests are running (the head waits)."""
        i = self._waiting[0]
        tr = self.trace[i]
        if self._running and not self._fits(tr):
            return None
        self._waiting.popleft()
        if self.strategy is not None:
            if self._alpha_switch is not None and i == self._alpha_switch[0]:
                assert isinstance(self.strategy, MarconiStrategy)  # only Marconi tunes alpha
                self.strategy.alpha = self._alpha_switch[1]
            self.strategy.before_admit(i)
        forced = self.engine.counters.forced_finishes
        ok = self.engine.admit(tr, rid=i)
        assert self.engine.counters.forced_finishes == forced, "admission finished a request"
        self.admit_count += 1
        if not ok:
            self._unblock(i)
            self._release()
            return _Job(i, 0, 0)
        log = self.engine.log
        self.admitted[i] = self.t
        self._running.add(i)
        job = _Job(i, log.usable_len[-1], log.prompt_len[-1])
        self._prefilling.append(job)
        return job

    def _fits(self, tr: TraceRequest) -> bool:
        """Whether admitting ``tr`` now cannot need to finish a running request."""
        eng = self.engine
        ps = eng.config.page_size
        need = -(-tr.input_length // ps) * ps + -(-tr.output_length // ps) * ps
        if eng.kv_allocator.available_size() + eng.cache.evictable_size() < need:
            return False
        pool = eng.state_pool
        return pool is None or pool.available_size() >= 1 or eng.cache.state_evictable_size() >= 2

    def _first_token(self, i: int) -> None:
        self.first_token[i] = self.t
        left = max(1, self.trace[i].output_length) - 1
        if left == 0:
            self._finish(i)
        else:
            heapq.heappush(self._decoding, (self._decode_steps + left, i))

    def _decode_jump(self, decode_s: float) -> None:
        """Decode steps until the next request finishes or the next arrival, whichever first."""
        steps = self._decoding[0][0] - self._decode_steps
        nxt = self._next_arrival()
        if decode_s > 0 and not math.isinf(nxt):
            steps = min(steps, max(1, math.ceil((nxt - self.t) / decode_s - 1e-9)))
        self._decode_steps += steps
        self.t += steps * decode_s
        while self._decoding and self._decoding[0][0] <= self._decode_steps:
            self._finish(heapq.heappop(self._decoding)[1])

    def _finish(self, i: int) -> None:
        assert self.engine.finish(i), f"request {i} was not running"
        self.finished[i] = self.t
        self._running.discard(i)
        self._unblock(i)
        self._release()

    def _check_done(self) -> None:
        assert not self._running and not self._waiting and not self._blocked, \
            "requests left behind"
        cache = self.engine.cache
        cache.sanity_check()
        if cache.protected_size():
            raise AssertionError(f"{cache.protected_size()} KV tokens still locked after the run")

    # --------------------------------------------------------------- results
    def timing(self) -> TimingMetrics:
        out = np.fromiter((r.output_length for r in self.trace), np.int64, len(self.trace))
        return TimingMetrics.of(self.arrival, self.admitted, self.first_token, self.finished,
                                out, self.prefill_busy)

    def result(self, wall_s: float, tuning: MarconiTuning | None = None) -> SimResult:
        eng = self.engine
        return SimResult(self.cfg, summarize(eng.log, self.cfg.cost_d, self.cfg.cost_e),
                         self.timing(), eng.counters, wall_s, eng.cache.stats(), tuning)


def _session_predecessors(trace: Sequence[TraceRequest]) -> np.ndarray:
    """For each request, the index of the previous request of its session (-1: none)."""
    pred = np.full(len(trace), -1, dtype=np.int64)
    last: dict[str, int] = {}
    for i, r in enumerate(trace):
        if r.session is not None:
            pred[i] = last.get(r.session, -1)
            last[r.session] = i
    return pred


def tune_marconi(trace: Sequence[TraceRequest], config: SimConfig) -> MarconiTuning:
    """Marconi's bootstrap (module docstring): probe with alpha 0 up to the first state
    eviction, then grid-search alpha on the first ``W`` requests by token hit rate."""
    probe = Simulator(trace, replace(config, marconi_alpha=0.0))
    strategy = probe.strategy
    assert isinstance(strategy, MarconiStrategy)
    probe.run(stop=lambda _: strategy.first_eviction_index is not None)
    k = strategy.first_eviction_index
    n = len(trace)
    if k is None:  # never evicts a state: alpha cannot matter
        return MarconiTuning(0.0, n, None, {})
    window = min(10 * (k + 1), max(k + 1, n // 4))
    rates: dict[float, float] = {}
    for alpha in config.marconi_alphas:
        sim = Simulator(trace[:window], replace(config, marconi_alpha=alpha))
        sim.run()
        rates[alpha] = summarize(sim.engine.log).token_hit_rate
    best = max(rates, key=lambda a: (rates[a], -a))
    return MarconiTuning(best, window, k, rates)


def run_policy(trace: Sequence[TraceRequest], config: SimConfig, *,
               next_use: NextUseIndex | None = None,
               on_admit: Callable[[], None] | None = None) -> SimResult:
    """Simulate ``config`` over ``trace`` (tuning Marconi's alpha first when not fixed)."""
    start = time.perf_counter()
    tuning = None
    switch = None
    if config.policy == "marconi" and config.marconi_alpha is None:
        tuning = tune_marconi(trace, config)
        switch = (tuning.window, tuning.alpha)
        config = replace(config, marconi_alpha=0.0)
    sim = Simulator(trace, config, next_use=next_use, alpha_switch=switch)
    sim.run(on_admit=on_admit)
    result = sim.result(time.perf_counter() - start, tuning)
    return replace(result, config=replace(result.config, marconi_alpha=None)) if tuning else result
