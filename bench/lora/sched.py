"""The LoRA-aware scheduler of the trace replay.

Requests get adapters (:func:`assign_adapters`); the scheduler decides which run together so
that every batch's adapters fit ``max_loras_per_batch`` slots, drives a real
:class:`~allocators.lora.LoraManager` (PEFT adapter directories, host tier, device slots), and feeds the
admitted requests to the prefix-cache engine with their adapter's uid as ``extra_key``.

Time model (simulated seconds; no model runs)::

    arrival = trace timestamp_s        finish = admit + max(1, output_length) * decode_step_s

Prefill time is not modelled. At most ``concurrency`` requests run. At every event (arrivals
and finishes at one instant, finishes first):

1. Drain (``lora_drain_wait_threshold`` > 0, SGLang's rule): an adapter is *starving* when its
   oldest waiting request has waited longer than the threshold and cannot join the batch.
   For each starving adapter (oldest first) not yet served, one running adapter that is not
   draining -- the one whose running requests end soonest -- stops admitting new requests
   until its last request finishes, so its slot frees.
2. Admission, repeated while fewer than ``concurrency`` run: among adapters with waiting
   requests that are not draining and can join the batch (already running, or one more
   distinct adapter fits ``validate_batch``), admit the request that arrived first.
   FIFO among admissible requests; a blocked adapter does not block the others.
3. ``prepare_batch`` over the running adapters (loads and evictions by the LoRA policy).

Host tier: adapters ``0 .. max_loaded_loras-1`` are loaded at start; a request for an adapter
that is not loaded unloads the least recently admitted loaded adapter with nothing running and
reads its directory again -- a new uid, hence a new (empty) prefix namespace, as in a real engine.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from allocators.lora import BASE_MODEL, AdapterId, BaseModel, lora_extra_key
from bench.engine.core import ReplayEngine
from bench.traces.loader import TraceRequest
from radix.lora import LoraArgs, LoraManager, LoraPathSpec

__all__ = [
    "AdapterSkew",
    "LoraCounters",
    "LoraReplayConfig",
    "LoraScheduler",
    "adapter_name",
    "assign_adapters",
    "parse_adapter_skew",
]

AdapterKey = int | BaseModel
"""An adapter index ``0 .. N-1`` or :data:`BASE_MODEL`."""


@dataclass(frozen=True, slots=True)
class AdapterSkew:
    """Adapter popularity: ``zipf`` (adapter ``k`` has weight ``1 / (k+1)**s``) or ``uniform``."""

    kind: Literal["zipf", "uniform"]
    s: float = 0.0

    def probabilities(self, n: int) -> np.ndarray:
        """``[n]`` float64 probabilities summing to 1."""
        w = np.ones(n) if self.kind == "uniform" else 1.0 / np.arange(1, n + 1) ** self.s
        return w / w.sum()

    def __str__(self) -> str:
        return "uniform" if self.kind == "uniform" else f"zipf:{self.s:g}"


def parse_adapter_skew(text: str) -> AdapterSkew:
    """``"uniform"`` or ``"zipf:S"`` with ``S >= 0`` (e.g. ``zipf:1.1``).

    Raises:
        TypeError: not a str.
        ValueError: anything else (the message shows the accepted forms).
    """
    if not isinstance(text, str):
        raise TypeError(f"adapter skew must be a str, got {type(text).__name__}")
    kind, sep, value = text.strip().partition(":")
    if kind == "uniform" and not sep:
        return AdapterSkew("uniform")
    if kind == "zipf" and sep:
        try:
            s = float(value)
        except ValueError:
            s = math.nan
        if math.isfinite(s) and s >= 0:
            return AdapterSkew("zipf", s)
    raise ValueError(f"adapter skew must be 'uniform' or 'zipf:S' with S >= 0, got {text!r}")


@dataclass(frozen=True, slots=True)
class LoraReplayConfig:
    """The LoRA side of one replay (SGLang's argument names where they exist).

    Attributes:
        num_adapters: distinct adapters requests are spread over, ``>= 1``.
        skew: popularity of the adapters.
        max_loras_per_batch: device slots (SGLang's default 8).
        max_loaded_loras: host-tier capacity; ``None`` = every adapter stays loaded.
        eviction_policy: ``lru`` or ``fifo``.
        drain_wait_threshold_s: ``lora_drain_wait_threshold`` [s]; 0 = off.
        base_fraction: share of sessions served by the base model, in ``[0, 1]``.
        decode_step_s: simulated time per decode step [s].
        seed: seeds the adapter assignment and the adapter weights.
        adapter_dirs: real adapter directories (``num_adapters`` of them), or ``()`` for
            generated adapters.
    """

    num_adapters: int
    skew: AdapterSkew = AdapterSkew("zipf", 1.1)
    max_loras_per_batch: int = 8
    max_loaded_loras: int | None = None
    eviction_policy: str = "lru"
    drain_wait_threshold_s: float = 0.0
    base_fraction: float = 0.0
    decode_step_s: float = 0.02
    seed: int = 0
    adapter_dirs: tuple[LoraPathSpec, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.num_adapters, bool) or not isinstance(self.num_adapters, int):
            raise TypeError(f"num_adapters must be an int, got {type(self.num_adapters).__name__}")
        if self.num_adapters < 1:
            raise ValueError(f"num_adapters must be >= 1, got {self.num_adapters}")
        if self.adapter_dirs and len(self.adapter_dirs) != self.num_adapters:
            raise ValueError(
                f"{len(self.adapter_dirs)} adapter_dirs for num_adapters={self.num_adapters}"
            )
        if not isinstance(self.skew, AdapterSkew):
            raise TypeError(f"skew must be an AdapterSkew, got {type(self.skew).__name__}")
        if not 0.0 <= self.base_fraction <= 1.0:
            raise ValueError(f"base_fraction must be in [0, 1], got {self.base_fraction}")
        if not (math.isfinite(self.decode_step_s) and self.decode_step_s > 0):
            raise ValueError(f"decode_step_s must be > 0, got {self.decode_step_s}")
        self.lora_args([])  # validates the SGLang-side arguments (no adapters needed)

    def lora_args(
        self, lora_paths: Sequence[str | LoraPathSpec], max_lora_rank: int | None = None
    ) -> LoraArgs:
        """The serving arguments for this replay with the given initial ``lora_paths``
        (``max_lora_rank``: the largest rank of every adapter, loaded now or later)."""
        return LoraArgs(
            lora_paths=list(lora_paths),
            max_lora_rank=max_lora_rank,
            max_loras_per_batch=self.max_loras_per_batch,
            max_loaded_loras=self.max_loaded_loras,
            lora_eviction_policy=self.eviction_policy,
            lora_target_modules="all",
            lora_drain_wait_threshold=self.drain_wait_threshold_s,
        )


def adapter_name(index: int) -> str:
    """The serving name of adapter ``index`` in the replay."""
    return f"lora{index}"


def assign_adapters(trace: Sequence[TraceRequest], cfg: LoraReplayConfig) -> list[AdapterKey]:
    """One adapter per request, fixed per session so a conversation stays in one namespace.

    The session is ``TraceRequest.session`` when the trace has one, else the first two block
    ids (Mooncake's conversations share them). Each new session draws the base model with
    probability ``base_fraction``, else an adapter by ``skew``; seeded, deterministic.
    """
    rng = np.random.default_rng(cfg.seed)
    probs = cfg.skew.probabilities(cfg.num_adapters)
    by_session: dict[Hashable, AdapterKey] = {}
    out: list[AdapterKey] = []
    for tr in trace:
        key = tr.session if tr.session is not None else tr.block_ids[:2]
        if key not in by_session:
            base = cfg.base_fraction > 0 and rng.random() < cfg.base_fraction
            by_session[key] = BASE_MODEL if base else int(rng.choice(cfg.num_adapters, p=probs))
        out.append(by_session[key])
    return out


@dataclass
class LoraCounters:
    """What the LoRA side did in one replay (counts; waits in simulated seconds)."""

    requests: int = 0
    slot_hits: int = 0  # admitted with its adapter already in a slot or in the running batch
    slot_loads: int = 0  # slot fills (pool.num_loads)
    slot_evictions: int = 0  # pool.eviction_count
    host_loads: int = 0  # adapter directories read after start-up (host tier misses)
    drains: int = 0
    batches: int = 0  # prepare_batch calls
    waits_s: list[float] = field(default_factory=list)

    @property
    def slot_hit_rate(self) -> float:
        return self.slot_hits / self.requests if self.requests else 0.0

    def wait_summary(self) -> dict[str, float]:
        """Queueing delay [s]: mean, p50, p90, max (zeros when nothing ran)."""
        w = np.asarray(self.waits_s or [0.0])
        return {
            "mean": float(w.mean()),
            "p50": float(np.percentile(w, 50)),
            "p90": float(np.percentile(w, 90)),
            "max": float(w.max()),
        }

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "slot_hit_rate": self.slot_hit_rate,
            "slot_loads": self.slot_loads,
            "slot_evictions": self.slot_evictions,
            "host_loads": self.host_loads,
            "drains": self.drains,
            "batches": self.batches,
            "wait_s": self.wait_summary(),
        }


class LoraScheduler:
    """Runs one replay's schedule (see the module docstring) over a fresh :class:`LoraManager`.

    ``adapter_paths[k]`` is the PEFT directory of adapter ``k``, served as ``names[k]``
    (default :func:`adapter_name`); ``base_modules`` the base model's module shapes the
    adapters fit; ``max_lora_rank`` the largest rank among them.
    """

    def __init__(
        self,
        cfg: LoraReplayConfig,
        concurrency: int,
        adapter_paths: Sequence[str],
        base_modules: dict[str, tuple[int, int]],
        max_lora_rank: int,
        names: Sequence[str] | None = None,
    ) -> None:
        if len(adapter_paths) != cfg.num_adapters:
            raise ValueError(f"{len(adapter_paths)} adapter paths for {cfg.num_adapters} adapters")
        self.cfg = cfg
        self.concurrency = concurrency
        self.paths = list(adapter_paths)
        default = [adapter_name(k) for k in range(len(self.paths))]
        self.names = default if names is None else list(names)
        if len(self.names) != len(self.paths):
            raise ValueError(f"{len(self.names)} names for {len(self.paths)} adapter paths")
        first = cfg.num_adapters if cfg.max_loaded_loras is None else cfg.max_loaded_loras
        initial = [LoraPathSpec(self.names[k], p) for k, p in enumerate(self.paths[:first])]
        self.manager = LoraManager(cfg.lora_args(initial, max_lora_rank), base_modules)
        self.pool = self.manager.pool
        self.host_lru: OrderedDict[int, None] = OrderedDict.fromkeys(
            range(min(first, len(self.paths)))
        )
        self.counters = LoraCounters()
        self.waiting: dict[AdapterKey, deque[tuple[float, int]]] = {}
        self.running: dict[int, tuple[AdapterKey, float]] = {}  # rid -> (adapter, finish time)
        self.running_by_key: Counter[AdapterKey] = Counter()
        self.draining: dict[AdapterKey, AdapterKey] = {}  # draining adapter -> starving one
        self._heap: list[tuple[float, int]] = []

    def run(
        self,
        trace: Sequence[TraceRequest],
        adapters: Sequence[AdapterKey],
        engine: ReplayEngine,
        on_admit: Callable[[], None] | None = None,
    ) -> LoraCounters:
        """Schedule every request of ``trace`` (adapter ``adapters[i]``) through ``engine``."""
        i, n, now = 0, len(trace), 0.0
        while i < n or self.running:
            t_arrive = trace[i].timestamp_s if i < n else math.inf
            t_finish = self._heap[0][0] if self._heap else math.inf
            now = max(now, min(t_arrive, t_finish))
            while self._heap and self._heap[0][0] <= now:
                self._finish(heapq.heappop(self._heap)[1], engine)
            while i < n and trace[i].timestamp_s <= now:
                self.waiting.setdefault(adapters[i], deque()).append((trace[i].timestamp_s, i))
                i += 1
            admitted = self._schedule(now, trace)
            for rid, uid in admitted:
                engine.admit(trace[rid], rid=rid, extra_key=lora_extra_key(uid))
                if on_admit is not None:
                    on_admit()
            assert self.running or not any(self.waiting.values()), "waiting with nothing running"
        engine.drain()
        self.counters.slot_loads = self.pool.num_loads
        self.counters.slot_evictions = self.pool.eviction_count
        self.pool.check()
        return self.counters

    # ------------------------------------------------------------------ steps
    def _schedule(self, now: float, trace: Sequence[TraceRequest]) -> list[tuple[int, AdapterId]]:
        if self.cfg.drain_wait_threshold_s > 0:
            self._update_drains(now)
        admitted = []
        while len(self.running) < self.concurrency:
            best: AdapterKey | None = None
            head: tuple[float, int] = (math.inf, 0)
            for key, queue in self.waiting.items():
                if queue and queue[0] < head and key not in self.draining and self._fits(key):
                    best, head = key, queue[0]
            if best is None:
                break
            self.waiting[best].popleft()
            admitted.append(self._start(best, head, now, trace[head[1]]))
        if self.running:
            uids = [self._uid(k) for k in self.running_by_key]
            assert self.pool.validate_batch(uids)
            self.pool.prepare_batch(uids)
            self.counters.batches += 1
        return admitted

    def _fits(self, key: AdapterKey) -> bool:
        """Whether a request of ``key`` can join the running batch (no pins in the replay)."""
        if key in self.running_by_key:
            return True
        return len(self.running_by_key) + 1 <= self.pool.num_unpinned_slots

    def _start(
        self, key: AdapterKey, head: tuple[float, int], now: float, tr: TraceRequest
    ) -> tuple[int, AdapterId]:
        arrival, rid = head
        uid = self._ensure_loaded(key)
        c = self.counters
        c.requests += 1
        c.slot_hits += key in self.running_by_key or self.pool.is_resident(uid)
        c.waits_s.append(now - arrival)
        finish = now + max(1, tr.output_length) * self.cfg.decode_step_s
        self.running[rid] = (key, finish)
        self.running_by_key[key] += 1
        heapq.heappush(self._heap, (finish, rid))
        return rid, uid

    def _finish(self, rid: int, engine: ReplayEngine) -> None:
        key, _ = self.running.pop(rid)
        self.running_by_key[key] -= 1
        if not self.running_by_key[key]:
            del self.running_by_key[key]
            self.draining.pop(key, None)  # fully drained
        engine.finish(rid)

    def _update_drains(self, now: float) -> None:
        threshold = self.cfg.drain_wait_threshold_s
        starving = sorted(
            (queue[0], key)
            for key, queue in self.waiting.items()
            if queue and now - queue[0][0] > threshold and not self._fits(key)
        )
        served = set(self.draining.values())
        for _, key in starving:
            if key in served:
                continue
            eligible = [a for a in self.running_by_key if a not in self.draining]
            if not eligible:
                return
            last_finish: dict[AdapterKey, float] = {}
            for a, finish in self.running.values():
                last_finish[a] = max(last_finish.get(a, 0.0), finish)
            victim = min(eligible, key=lambda a: last_finish[a])
            self.draining[victim] = key
            self.counters.drains += 1

    def _uid(self, key: AdapterKey) -> AdapterId:
        return BASE_MODEL if isinstance(key, BaseModel) else self.manager.uid_of(self.names[key])

    def _ensure_loaded(self, key: AdapterKey) -> AdapterId:
        """The uid of ``key``, reading its directory (and unloading an idle adapter) if needed."""
        if isinstance(key, BaseModel):
            return BASE_MODEL
        name = self.names[key]
        if name in self.manager.name_to_uid:
            self.host_lru.move_to_end(key)
            return self.manager.uid_of(name)
        cap = self.pool.max_loaded_loras
        if cap is not None and len(self.pool.loaded_uids()) >= cap:
            victim = next(a for a in self.host_lru if a not in self.running_by_key)
            self.manager.unload_adapter(self.names[victim])
            del self.host_lru[victim]
        self.host_lru[key] = None
        self.counters.host_loads += 1
        return self.manager.load_adapter(name, self.paths[key])
