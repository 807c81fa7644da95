"""Set-up shared by the cache tests: random keys, the caller's side of an insert, pool views.

The random tests draw keys over the tokens 1..3 (a small alphabet, so keys share prefixes and
nodes split, branch and chain), usually by extending a prefix of an earlier key. Every draw
goes through the caller's ``random.Random``, in a fixed order, so a seed replays a run.
"""

from __future__ import annotations

import random
from typing import Any

import torch

from allocators import MambaStatePool
from components.kv import slot_tensor


def draw_tokens(rng: random.Random, keys: list[list[int]], *, min_cut: int,
                grow: tuple[int, int], fresh: tuple[int, int], reuse: float = 0.7) -> list[int]:
    """A key (appended to ``keys``): with probability ``reuse`` a prefix of an earlier key, at
    least ``min_cut`` tokens long, plus ``grow`` (inclusive range) new tokens; otherwise
    ``fresh`` (inclusive range) new tokens."""
    if keys and rng.random() < reuse:
        base = rng.choice(keys)
        key = base[: rng.randint(min_cut, len(base))] + [rng.randint(1, 3) for _ in range(rng.randint(*grow))]
    else:
        key = [rng.randint(1, 3) for _ in range(rng.randint(*fresh))]
    keys.append(key)
    return key


def draw_key(rng: random.Random, keys: list[tuple[list[int], Any]], *, recent: int,
             grow: tuple[int, int], fresh: tuple[int, int], cap: int, extras: list[Any],
             switch: float = 0.0) -> tuple[list[int], Any]:
    """A ``(tokens, extra_key)`` pair (appended to ``keys``), at most ``cap`` tokens.

    With probability 0.8 (when ``keys`` has one) it revisits one of the ``recent`` latest keys:
    at least half of its tokens, plus ``grow`` (inclusive range) new ones, in the same
    namespace, moved with probability ``switch`` to ``None`` or ``"lora"`` (a namespace change
    on a shared prefix). Otherwise ``fresh`` (inclusive range) new tokens in a namespace drawn
    from ``extras``.
    """
    if keys and rng.random() < 0.8:
        base, extra = rng.choice(keys[-recent:])
        cut = rng.randint(len(base) // 2, len(base))
        toks = base[:cut] + [rng.randint(1, 3) for _ in range(rng.randint(*grow))]
        if switch and rng.random() < switch:
            extra = rng.choice([None, "lora"])
    else:
        toks = [rng.randint(1, 3) for _ in range(rng.randint(*fresh))]
        extra = rng.choice(extras)
    toks = toks[:cap]
    keys.append((toks, extra))
    return toks, extra


def free_leftovers(alloc: Any, res: Any, fresh: torch.Tensor, need: int) -> None:
    """The caller's side of an insert: free the duplicates (slots the tree already had), the
    remainder past the last whole page and the part of ``fresh`` past the ``need`` used."""
    if len(res.duplicate_indices):
        alloc.free(res.duplicate_indices)
    tail = torch.cat([res.remainder_indices, fresh[need:]])
    if len(tail):
        alloc.free(tail)


def alloc_request(cache: Any, kv: Any, states: Any, need: int, *,
                  swa: bool = False) -> tuple[torch.Tensor, int | None] | None:
    """An engine's allocation for a request's ``need`` new tokens: the KV slots (evicting
    ``need`` tokens, and with ``swa`` ``need`` SWA tokens, on a shortfall) and, with a state
    pool ``states``, one state slot (evicting a state on a shortfall). ``(fresh, slot)``, or
    ``None`` with nothing held when either cannot be had."""
    fresh = kv.alloc(need)
    if fresh is None:
        cache.evict(need)
        if swa:
            cache.evict_swa(need)
        fresh = kv.alloc(need)
    slot = None
    if states is not None:
        got = states.alloc(1)
        if got is None:
            cache.evict_states(1)
            got = states.alloc(1)
        slot = None if got is None else int(got[0])
    if fresh is None or (states is not None and slot is None):
        if fresh is not None:
            kv.free(fresh)
        return None
    return fresh, slot


def free_slots(alloc: Any) -> list[int]:
    """An allocator's free list as slot ids (pages expanded), front first."""
    ps = alloc.page_size
    return [p * ps + i for p in alloc.snapshot().free_ids() for i in range(ps)]


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Uniformly random bit patterns (NaN payloads, infinities, -0.0...) as ``dtype`` (2 or 4
    bytes wide), drawn from ``gen``: a copy that goes through any float arithmetic shows."""
    width = torch.empty((), dtype=dtype).element_size()
    int_dtype = {2: torch.int16, 4: torch.int32}[width]
    lo, hi = -(2 ** (8 * width - 1)), 2 ** (8 * width - 1)
    return torch.randint(lo, hi, shape, generator=gen, dtype=torch.int64).to(int_dtype).view(dtype)


def bits(x: torch.Tensor) -> torch.Tensor:
    """``x`` viewed as same-width integers, so ``torch.equal`` compares bit patterns."""
    width = x.element_size()
    return x.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[width])


def tiny_state_pool(states: int) -> MambaStatePool:
    """A state pool of ``states`` slots, one layer, one-element conv and SSM states (the random
    tests follow slot ids, not contents)."""
    return MambaStatePool(states, num_layers=1, conv_state_shape=(1,), ssm_state_shape=(1,))


def node_slots(node: Any) -> torch.Tensor:
    """A device node's KV slots as a 1-D int64 CPU tensor, read through the KV component's
    accessor (``components.kv.slot_tensor``, what ``KVComponent.slots`` returns on the CPU; on
    a device ``slots`` uploads it): the tests read node slots only this way, whatever
    ``node.kv_value`` holds (an ``array('q')`` on the host)."""
    assert node.kv_value is not None, f"node without device KV: {node}"
    return slot_tensor(node.kv_value)


class FailAllocs:
    """Fault injection: make the ``k``-th ``alloc`` call across ``pools`` (name -> allocator)
    return ``None`` (``mode="once"``) or the ``k``-th and every later one (``mode="from"``);
    ``k=0`` never fails. Records every call as ``(pool name, n, failed)`` in ``calls``."""

    def __init__(self, pools: dict[str, Any], k: int = 0, mode: str = "from") -> None:
        assert mode in ("once", "from")
        self.pools = pools
        self.k = k
        self.mode = mode
        self.calls: list[tuple[str, int, bool]] = []

    def _wrap(self, name: str, real: Any) -> Any:
        def alloc(n: int) -> torch.Tensor | None:
            i = len(self.calls) + 1
            fail = self.k > 0 and (i == self.k or (self.mode == "from" and i > self.k))
            self.calls.append((name, n, fail))
            if fail:
                self.on_fail(name)
                return None
            return real(n)

        return alloc

    def __enter__(self) -> FailAllocs:
        for name, a in self.pools.items():
            a.alloc = self._wrap(name, a.alloc)
        return self

    def __exit__(self, *exc: object) -> None:
        for a in self.pools.values():
            del a.alloc  # back to the class method

    def on_fail(self, name: str) -> None:
        """Called for each ``alloc`` made to fail (of pool ``name``); a subclass counts them."""

    @property
    def names(self) -> list[str]:
        return [name for name, _, _ in self.calls]
