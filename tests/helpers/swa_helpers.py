"""Helpers shared by the SWA cache tests: a self-checking cache wrapper and tensor shorthands."""

from __future__ import annotations

import torch

from radix import RadixCache

_MUTATORS = frozenset({
    "match_prefix", "insert", "inc_lock_ref", "dec_lock_ref", "evict", "evict_swa",
    "evict_states", "release_swa", "cache_unfinished_req", "cache_finished_req", "reset",
})


class Checked:
    """A cache whose every call that may mutate it (refused ones too) is followed by
    ``sanity_check()``; everything else is forwarded as is."""

    def __init__(self, cache: RadixCache) -> None:
        self._cache = cache

    def __getattr__(self, name: str):
        attr = getattr(self._cache, name)
        if name not in _MUTATORS:
            return attr

        def call(*args, **kwargs):
            try:
                return attr(*args, **kwargs)
            finally:
                self._cache.sanity_check()

        return call


def t64(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


def ids(x: torch.Tensor) -> list[int]:
    assert x.dtype == torch.int64 and x.dim() == 1
    return x.tolist()
