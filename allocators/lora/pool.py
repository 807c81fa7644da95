"""The LoRA adapter memory pool: ``uids -> slots`` (after SGLang's LoRA memory pool).

Two tiers, one owner::

    host tier   uid -> LoraAdapter     at most max_loaded_loras adapters in CPU memory
                                       (pinned memory when overlap loading on CUDA)
    device      K = max_loras_per_batch slots of real weights (:class:`LoraSlots`:
                A_buffer / B_buffer / scaling, slot_to_uid, uid_to_slot; None = empty slot,
                BASE_MODEL = the base model's own zero-weight slot value)

A slot holds exactly its occupant's weights (zero-padded, zeros for missing modules, all
zero for the base model), never leftovers of a previous occupant; unloading a resident
adapter zeroes its slot.

Pinning: a pinned adapter is resident from the moment it is pinned until it is unpinned or
unloaded, and is never a victim. At most ``K - 1`` adapters may be pinned (one slot must stay
free for everything else). Hence ``K - num_pinned`` slots are "unpinned slots", and a batch
is valid when its distinct unpinned adapters (the base model counts as one) fit them.

Eviction (``prepare_batch`` and ``pin``): an empty slot (lowest index) is used first; else the
policy chooses among resident adapters that are neither pinned nor needed by the batch.
The base-model slot is chosen only when no adapter is a candidate (the batch is all
adapters), as SGLang does. The policy tracks exactly the resident unpinned adapters (never
the base model).

Errors: a bad argument raises ``TypeError`` / ``ValueError`` naming it; an id that is not
loaded raises ``ValueError``; a batch that cannot fit raises :class:`LoraBatchError`. A call
that raises changes nothing (``snapshot()`` and the buffers are unchanged).

Slot indices returned by ``prepare_batch`` stay valid until the next call that can move
adapters: ``prepare_batch``, ``pin``, ``add_adapter(pinned=True)``, ``replace_adapter``,
``remove_adapter``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, cast

import torch

from .._checks import check_device, check_float_dtype, check_int, check_positive_int
from .eviction_policy import LoraEvictionPolicy, make_lora_eviction_policy
from .identity import AdapterId, BaseModel, LoraUid
from .invariants import check_pool, check_pool_weights
from .modules import check_module_shapes
from .slots import LoraSlots
from .weights import LoraAdapter

__all__ = ["LoraBatch", "LoraBatchError", "LoraMemoryPool"]



def effective_max_loaded_loras(
    max_loras_per_batch: int, max_loaded_loras: object, overlap_loading: bool
) -> int | None:
    """The host-tier capacity: ``max_loaded_loras`` checked against ``max_loras_per_batch``.

    ``None`` means unlimited, except with overlap loading, where the pinned host memory is
    capped at ``2 * max_loras_per_batch`` adapters (``None`` then becomes that cap).

    Raises:
        TypeError: not an int or ``None``.
        ValueError: below ``max_loras_per_batch``, or above ``2 * max_loras_per_batch`` with
            overlap loading.
    """
    cap = 2 * max_loras_per_batch
    if max_loaded_loras is None:
        return cap if overlap_loading else None
    value = check_int(max_loaded_loras, "max_loaded_loras", minimum=1)
    if value < max_loras_per_batch:
        raise ValueError(
            f"max_loaded_loras ({value}) must be >= max_loras_per_batch ({max_loras_per_batch})"
        )
    if overlap_loading and value > cap:
        raise ValueError(
            f"max_loaded_loras ({value}) must be <= 2 * max_loras_per_batch ({cap}) with "
            "enable_lora_overlap_loading (pinned host memory)"
        )
    return value

class LoraBatchError(ValueError):
    """A batch needs more unpinned slots than the pool has; nothing was changed."""


@dataclass(frozen=True, slots=True)
class LoraBatch:
    """What :meth:`LoraMemoryPool.prepare_batch` did, and where each row's weights are.

    Attributes:
        weight_indices: ``[num_rows]`` ``torch.int64`` on the pool's device: the slot of
            each row's adapter (row ``i`` of the ``uids`` given), for :meth:`apply`.
        uid_to_slot: the batch's distinct adapters -> slot.
        loaded: adapters written into a slot by this call, in batch order.
        evicted: adapters that lost their slot to this call, in eviction order.
    """

    weight_indices: torch.Tensor
    uid_to_slot: Mapping[AdapterId, int]
    loaded: tuple[AdapterId, ...]
    evicted: tuple[AdapterId, ...]

    @property
    def num_hits(self) -> int:
        """Distinct adapters of the batch that were already resident."""
        return len(self.uid_to_slot) - len(self.loaded)


class LoraMemoryPool:
    """Host tier of loaded adapters + ``max_loras_per_batch`` device slots of real weights.

    Args:
        target_modules: module name -> ``(in_features, out_features)`` of the base model's
            layers that adapters may target (SGLang's ``lora_target_modules``, resolved to
            shapes): linear layers (``lm_head``: ``(hidden, vocab)``) and embeddings
            (``embed_tokens``: ``(vocab, hidden)``, applied to token ids).
        max_lora_rank: rank of every slot buffer, ``>= 1``; adapters of rank up to this.
        max_loras_per_batch: device slots ``K``, ``>= 1`` (SGLang's default 8).
        max_loaded_loras: host-tier capacity, ``>= K``, or ``None`` (unlimited; ``2 * K``
            with ``overlap_loading``, which also refuses a value above ``2 * K``).
        eviction_policy: ``"lru"`` (SGLang's default) or ``"fifo"``.
        dtype: floating-point dtype of the buffers; host copies are converted to it.
        device: device of the buffers (CPU default; CUDA when asked and available).
        overlap_loading: SGLang's ``enable_lora_overlap_loading``: host copies kept in pinned
            memory when ``device`` is CUDA, and slot fills issued as ``non_blocking`` copies
            (asynchronous on CUDA, ordered on the current stream before any later kernel).

    Raises:
        TypeError / ValueError: a bad argument, naming it.
    """

    def __init__(
        self,
        target_modules: Mapping[str, tuple[int, int]],
        max_lora_rank: int,
        max_loras_per_batch: int = 8,
        *,
        max_loaded_loras: int | None = None,
        eviction_policy: str = "lru",
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        overlap_loading: bool = False,
    ) -> None:
        self.target_modules = check_module_shapes(target_modules)
        self.max_lora_rank = check_positive_int(max_lora_rank, "max_lora_rank")
        self.max_loras_per_batch = check_positive_int(max_loras_per_batch, "max_loras_per_batch")
        if not isinstance(overlap_loading, bool):
            raise TypeError(f"overlap_loading must be a bool, got {type(overlap_loading).__name__}")
        self.max_loaded_loras = effective_max_loaded_loras(
            self.max_loras_per_batch, max_loaded_loras, overlap_loading
        )
        self.policy: LoraEvictionPolicy = make_lora_eviction_policy(eviction_policy, "eviction_policy")
        self.dtype = check_float_dtype(dtype, "dtype")
        # Resolved through a tensor so that "cuda" becomes "cuda:0", as tensors report it.
        self.device = torch.empty(0, device=check_device(device, "device")).device
        self.overlap_loading = overlap_loading
        self._pin_host = overlap_loading and self.device.type == "cuda"
        self.slots = LoraSlots(
            self.target_modules,
            self.max_lora_rank,
            self.max_loras_per_batch,
            self.dtype,
            self.device,
            non_blocking=overlap_loading,
        )
        self.A_buffer = self.slots.A_buffer
        """module -> ``[K, max_lora_rank, in_features]`` (the slots' tensors, shared)."""
        self.B_buffer = self.slots.B_buffer
        """module -> ``[K, out_features, max_lora_rank]``."""
        self.scaling = self.slots.scaling
        """``[K]``: each slot's scaling (0 for base-model and empty slots)."""
        self._adapters: dict[LoraUid, LoraAdapter] = {}
        self._pinned: set[LoraUid] = set()
        self._next_serial = 0
        self.num_loads = 0
        """Slot fills so far (adapter weights copied in, or a base-model slot zeroed)."""

    # ------------------------------------------------------------------ queries
    @property
    def slot_to_uid(self) -> tuple[AdapterId | None, ...]:
        """Occupant of each slot (``None`` = empty). O(K)."""
        return tuple(self.slots.slot_to_uid)

    @property
    def uid_to_slot(self) -> Mapping[AdapterId, int]:
        """Resident id -> slot (a read-only view)."""
        return MappingProxyType(self.slots.uid_to_slot)

    @property
    def eviction_count(self) -> int:
        """Adapters (or the base model) evicted from a slot to make room so far."""
        return self.policy.eviction_count

    @property
    def num_pinned(self) -> int:
        return len(self._pinned)

    @property
    def num_unpinned_slots(self) -> int:
        """Slots a batch's unpinned adapters may use: ``K - num_pinned``."""
        return self.max_loras_per_batch - len(self._pinned)

    def pinned_uids(self) -> frozenset[LoraUid]:
        """The pinned adapters (resident until unpinned)."""
        return frozenset(self._pinned)

    @property
    def next_serial(self) -> int:
        """The serial the next added adapter gets (every loaded one's is below it)."""
        return self._next_serial

    def loaded_uids(self) -> tuple[LoraUid, ...]:
        """Every adapter in the host tier, in load order."""
        return tuple(self._adapters)

    def adapter(self, uid: LoraUid) -> LoraAdapter:
        """The host copy of a loaded adapter (pool dtype). Raises ``ValueError`` if not loaded."""
        return self._adapters[self._check_loaded(uid)]

    def is_loaded(self, uid: object) -> bool:
        return uid in self._adapters

    def is_resident(self, uid: object) -> bool:
        return uid in self.slots.uid_to_slot

    def is_pinned(self, uid: object) -> bool:
        return uid in self._pinned

    # ------------------------------------------------------------------ host tier
    def add_adapter(self, name: str, adapter: LoraAdapter, *, pinned: bool = False) -> LoraUid:
        """Put ``adapter`` in the host tier under a fresh uid; pin it (load it now) if asked.

        Raises:
            TypeError: a bad ``name`` / ``adapter`` / ``pinned`` type.
            ValueError: rank above ``max_lora_rank``, a module outside ``lora_target_modules``
                or of another shape, ``max_loaded_loras`` reached, or the pin limit reached.
        """
        name = _check_name(name)
        self.slots.check_compatible(name, adapter)
        pinned = _check_bool(pinned, "pinned")
        cap = self.max_loaded_loras
        if cap is not None and len(self._adapters) >= cap:
            raise ValueError(
                f"cannot load adapter {name!r}: max_loaded_loras={cap} adapters are loaded; "
                "unload one first or raise max_loaded_loras"
            )
        if pinned:
            self._check_pin_room(name, 1)
        return self._insert(name, adapter, pinned)

    def replace_adapter(
        self, uid: LoraUid, adapter: LoraAdapter, *, pinned: bool | None = None
    ) -> LoraUid:
        """Swap a loaded adapter for new weights under the same name and a new uid (a reload).

        The old uid is removed exactly as :meth:`remove_adapter` does. ``pinned=None`` keeps
        the old pin state. An adapter re-pinned in place counts once against the pin limit,
        and the reload does not count against ``max_loaded_loras``.

        Raises:
            ValueError: ``uid`` not loaded, or as :meth:`add_adapter` (nothing changed).
        """
        uid = self._check_loaded(uid)
        self.slots.check_compatible(uid.name, adapter)
        was_pinned = uid in self._pinned
        pin_new = was_pinned if pinned is None else _check_bool(pinned, "pinned")
        if pin_new:
            self._check_pin_room(uid.name, 1 - int(was_pinned))
        self.remove_adapter(uid)
        return self._insert(uid.name, adapter, pin_new)

    def remove_adapter(self, uid: LoraUid) -> None:
        """Unload: drop ``uid`` from the host tier, its slot (zeroed), the maps and the policy.

        The caller must not run requests with ``uid`` afterwards (weight indices that point at
        its slot become stale). Raises ``ValueError`` if ``uid`` is not loaded. O(slot size).
        """
        uid = self._check_loaded(uid)
        if uid in self.slots.uid_to_slot:
            self.slots.clear(uid)
            if uid not in self._pinned:
                self.policy.remove(uid)
        self._pinned.discard(uid)
        del self._adapters[uid]

    # ------------------------------------------------------------------ pinning
    def pin(self, uid: LoraUid) -> AdapterId | None:
        """Pin a loaded adapter: load it into a slot now if needed; never evict it.

        Pinning a pinned adapter changes nothing. Returns the id evicted to make room, if any.

        Raises:
            ValueError: ``uid`` not loaded, or ``max_loras_per_batch - 1`` adapters are
                already pinned (more would starve every other request).
        """
        uid = self._check_loaded(uid)
        if uid in self._pinned:
            return None
        self._check_pin_room(uid.name, 1)
        victim = None
        if uid in self.slots.uid_to_slot:
            self.policy.remove(uid)
        else:
            slot, victim = self._take_slot({uid})
            self._fill(uid, slot)
        self._pinned.add(uid)
        return victim

    def unpin(self, uid: LoraUid) -> None:
        """Make a pinned adapter evictable again (it stays resident, tracked as just used).
        Unpinning an unpinned adapter changes nothing. Raises ``ValueError`` if not loaded."""
        uid = self._check_loaded(uid)
        if uid in self._pinned:
            self._pinned.remove(uid)
            self.policy.mark_used(uid)

    # ------------------------------------------------------------------ batches
    def validate_batch(self, uids: Iterable[AdapterId]) -> bool:
        """Whether the batch's distinct unpinned ids fit the ``K - num_pinned`` unpinned slots.

        Raises:
            TypeError / ValueError: an id that is neither :data:`BASE_MODEL` nor loaded.
        """
        rows = self._check_rows(uids)
        return self._unpinned_need(rows) <= self.num_unpinned_slots

    def prepare_batch(self, uids: Iterable[AdapterId]) -> LoraBatch:
        """Make every adapter of the batch resident; return each row's slot.

        Args:
            uids: one id per row (request), :data:`BASE_MODEL` for base-model rows; repeats
                allowed.

        Loads missing ids in batch order, each into an empty slot or the policy's victim among
        resident ids that are not pinned and not in the batch; then marks the batch's
        unpinned ids used, in batch order.

        Raises:
            TypeError / ValueError: an id that is neither :data:`BASE_MODEL` nor loaded.
            LoraBatchError: the batch's unpinned ids do not fit the unpinned slots.
            Nothing changes when it raises.

        Complexity: O(rows + K * distinct) plus one slot fill per load.
        """
        rows = self._check_rows(uids)
        distinct = list(dict.fromkeys(rows))
        need = self._unpinned_need(distinct)
        if need > self.num_unpinned_slots:
            raise LoraBatchError(
                f"batch needs {need} unpinned slots but only {self.num_unpinned_slots} of "
                f"max_loras_per_batch={self.max_loras_per_batch} are unpinned "
                f"({self.num_pinned} pinned); split the batch (check validate_batch first)"
            )
        protect = set(distinct)
        loaded: list[AdapterId] = []
        evicted: list[AdapterId] = []
        for uid in distinct:
            if uid in self.slots.uid_to_slot:
                continue
            slot, victim = self._take_slot(protect)
            if victim is not None:
                evicted.append(victim)
            self._fill(uid, slot)
            loaded.append(uid)
        for uid in distinct:
            if uid not in self._pinned:
                self.policy.mark_used(uid)
        where = {uid: self.slots.uid_to_slot[uid] for uid in distinct}
        indices = torch.tensor([where[u] for u in rows], dtype=torch.int64, device=self.device)
        return LoraBatch(indices, MappingProxyType(where), tuple(loaded), tuple(evicted))

    def apply(self, module: str, x: torch.Tensor, weight_indices: torch.Tensor) -> torch.Tensor:
        """The batched LoRA delta of ``module``: row ``t`` gets its own slot's adapter.

        ``out[t] = scaling[s] * B[s] @ (A[s] @ x[t])`` with ``s = weight_indices[t]``; a
        base-model (or empty) slot gives zeros. One pair of matmuls per distinct slot
        (segmented, like SGMV), so memory stays ``O(T * (rank + out))``.

        Args:
            module: a target module name.
            x: ``[T, in_features]`` of the pool's dtype and device; or, for an embedding
                module (``embed_tokens``, ``in_features`` = vocabulary size), ``[T]``
                ``torch.int64`` token ids in ``[0, in_features)``: ``A[s] @ x[t]`` is then the
                lookup ``A[s][:, x[t]]`` (PEFT's and SGLang's embedding LoRA).
            weight_indices: ``[T]`` ``torch.int64`` slots (from :meth:`prepare_batch`).

        Returns:
            ``[T, out_features]`` tensor of the pool's dtype and device.

        Raises:
            TypeError / ValueError: a module that is not a str (TypeError) or unknown, or a wrong shape, dtype, device or slot.
        """
        return self.slots.apply(module, x, weight_indices)

    # ------------------------------------------------------------------ checking
    def check(self) -> None:
        """Recompute every bookkeeping invariant (weights: :meth:`check_weights`).

        Each slot holds one id or nothing and no id sits in two slots; ``uid_to_slot`` and
        ``slot_to_uid`` agree both ways; residents are loaded (or the base model); pinned ids
        are loaded and resident, at most ``K - 1``; the policy tracks exactly the resident
        unpinned adapters; the host tier is within ``max_loaded_loras``.

        Raises:
            AssertionError: with a dump of the state. O(K + loaded).
        """
        check_pool(self)

    def check_weights(self) -> None:
        """Every slot's buffers equal its occupant's weights exactly, zero-padded; base-model
        and empty slots are all zero. Raises ``AssertionError``. O(buffer size)."""
        check_pool_weights(self)

    def snapshot(self) -> tuple[Any, ...]:
        """The bookkeeping state as a hashable value (buffers excluded); for tests."""
        return (
            tuple(self.slots.slot_to_uid),
            tuple(sorted(self.slots.uid_to_slot.items(), key=lambda kv: kv[1])),
            frozenset(self._pinned),
            tuple(self._adapters),
            self.policy.tracked(),
            self.policy.eviction_count,
            self._next_serial,
            self.num_loads,
        )

    def __repr__(self) -> str:
        return (
            f"LoraMemoryPool(slots={self.slots.slot_to_uid}, pinned={sorted(map(str, self._pinned))}, "
            f"loaded={len(self._adapters)}, policy={self.policy!r})"
        )

    # ------------------------------------------------------------------ internals
    def _insert(self, name: str, adapter: LoraAdapter, pinned: bool) -> LoraUid:
        host = self._host_copy(adapter)
        uid = LoraUid(name, self._next_serial, host.digest())
        self._next_serial += 1
        self._adapters[uid] = host
        if pinned:
            self.pin(uid)
        return uid

    def _host_copy(self, adapter: LoraAdapter) -> LoraAdapter:
        def host(w: torch.Tensor) -> torch.Tensor:
            w = w.to(self.dtype, copy=True)
            return w.pin_memory() if self._pin_host else w

        return LoraAdapter(
            {m: (host(a), host(b)) for m, (a, b) in adapter.weights.items()}, adapter.scaling
        )

    def _take_slot(self, protect: set[AdapterId]) -> tuple[int, AdapterId | None]:
        """The lowest empty slot, or the slot of the policy's victim (evicted here)."""
        slot = self.slots.first_empty()
        if slot is not None:
            return slot, None
        candidates = [
            u for u in self.slots.slot_to_uid if u not in protect and u not in self._pinned
        ]
        # The policy prefers tracked adapters and falls back to the base model, so an
        # adapter goes first and the base model's slot only when the batch is all adapters.
        chosen = self.policy.select_victim(candidates)
        assert chosen in candidates, f"policy returned {chosen!r}, not a candidate"
        victim = cast(AdapterId, chosen)
        self.policy.remove(victim)
        return self.slots.vacate(victim), victim

    def _fill(self, uid: AdapterId, slot: int) -> None:
        adapter = self._adapters[uid] if isinstance(uid, LoraUid) else None
        self.slots.fill(slot, uid, adapter)
        self.num_loads += 1

    def _unpinned_need(self, ids: Iterable[AdapterId]) -> int:
        return len({u for u in ids if u not in self._pinned})

    def _check_pin_room(self, name: str, extra: int) -> None:
        limit = self.max_loras_per_batch - 1
        if len(self._pinned) + extra > limit:
            raise ValueError(
                f"cannot pin adapter {name!r}: {len(self._pinned)} adapters are pinned and at "
                f"most max_loras_per_batch - 1 = {limit} may be (more would starve every "
                "other request); unpin one or raise max_loras_per_batch"
            )

    def _check_loaded(self, uid: object, name: str = "uid") -> LoraUid:
        if not isinstance(uid, LoraUid):
            raise TypeError(f"{name} must be a LoraUid, got {type(uid).__name__} {uid!r}")
        if uid not in self._adapters:
            raise ValueError(f"{name}: adapter {uid} is not loaded (unloaded or never loaded)")
        return uid

    def _check_rows(self, uids: Iterable[AdapterId]) -> list[AdapterId]:
        if isinstance(uids, str | bytes) or not isinstance(uids, Iterable):
            raise TypeError(f"uids must be an iterable of ids, got {type(uids).__name__}")
        rows = list(uids)
        for i, uid in enumerate(rows):
            if not isinstance(uid, BaseModel):
                self._check_loaded(uid, f"uids[{i}]")
        return rows


def _check_name(name: object) -> str:
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    if not name or name != name.strip():
        raise ValueError(f"name must be non-empty without surrounding spaces, got {name!r}")
    return name


def _check_bool(value: object, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value
