"""KV events on the wire, as SGLang's and vLLM's publishers send them (needs ``msgspec``: the
``events`` extra).

The engines publish one msgpack message per batch of events (:func:`encode_batch`). Two shapes:

``"map"`` (SGLang 0.5.23, current vLLM, NVIDIA Dynamo's decoder)
    The batch is a positional array ``[ts, events, dp_rank]`` (``ts``: seconds since the
    epoch, a float; ``dp_rank``: the data-parallel rank, nil when none). Each event is a map
    whose ``type`` key is the class name::

        {"type": "BlockStored", "block_hashes": [...], "parent_block_hash": int | nil,
         "token_ids": [...], "block_size": int, "lora_id": int | nil, "medium": str,
         "lora_name": str | nil, "cache_salt": str (when set), "group_idx": int}
        {"type": "BlockRemoved", "block_hashes": [...], "medium": str, "group_idx": int}
        {"type": "AllBlocksCleared"}

    ``lora_id``, ``medium`` and ``lora_name`` are always written (nil when unset): the engines
    declare them without a default, so their decoders require the key. A decoder ignores the
    keys its schema lacks (SGLang has no ``group_idx``, vLLM no ``cache_salt``).

    Recurrent-state checkpoints (``group_idx == STATE_GROUP``) are written only with
    ``state_group=True`` (the default): a consumer whose schema has no ``group_idx``
    (SGLang's) would read a checkpoint's store and removal as its KV page's, so for it pass
    ``state_group=False``.

``"array"`` (vLLM before the map shape)
    Each event is a tagged positional array: ``["BlockStored", block_hashes,
    parent_block_hash, token_ids, block_size, lora_id, medium]``, ``["BlockRemoved",
    block_hashes, medium]``, ``["AllBlocksCleared"]``; the batch ``[ts, events]`` (plus
    ``dp_rank`` when given). The schema has no ``lora_name``, ``cache_salt`` or group:
    recurrent-state checkpoints (``group_idx == STATE_GROUP``) are left out, since a router
    reading this shape would count them as KV pages.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

try:
    import msgspec
except ImportError as _e:  # the optional dependency: a clear error, only when used
    raise ImportError(
        "components.event_wire needs msgspec (pip install 'hybrid-prefix-cache[events]')"
    ) from _e

from components import events as lib
from components.events import STATE_GROUP, KVEvent

__all__ = ["SHAPES", "AllBlocksCleared", "BlockRemoved", "BlockStored", "KVEventBatch",
           "encode_batch", "to_wire"]

#: The wire shapes :func:`encode_batch` writes.
SHAPES = ("map", "array")


# ------------------------------------------------------------------ the map shape
class KVCacheEvent(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """An event in the map shape: SGLang 0.5.23's and vLLM's ``KVCacheEvent`` (a msgspec
    struct tagged by its class name), so an engine's own msgspec encoder writes it as theirs."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    cache_salt: str | None = None
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, gc=False):
    """A batch in the map shape: ``[ts, events, dp_rank]``."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    dp_rank: int | None = None


# ---------------------------------------------------------------- the array shape
class _ArrayEvent(msgspec.Struct, tag=True, array_like=True, gc=False):
    pass


class _ArrayStored(_ArrayEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class _ArrayRemoved(_ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class _ArrayCleared(_ArrayEvent, tag="AllBlocksCleared"):
    pass


_ENCODER = msgspec.msgpack.Encoder()


def to_wire(ev: KVEvent, shape: str = "map", state_group: bool = True) -> msgspec.Struct | None:
    """The wire struct of one event in ``shape`` (``None``: a state checkpoint left out, in
    ``"array"`` or without ``state_group``).

    Raises:
        TypeError: ``ev`` is not a ``components.events`` event.
        ValueError: unknown ``shape``.
    """
    _check_shape(shape)
    if isinstance(ev, (lib.BlockStored, lib.BlockRemoved)) and ev.group_idx == STATE_GROUP and (
            shape == "array" or not state_group):
        return None
    if isinstance(ev, lib.BlockStored):
        if shape == "map":
            return BlockStored(list(ev.block_hashes), ev.parent_block_hash, list(ev.token_ids),
                              ev.block_size, ev.lora_id, ev.medium, ev.lora_name, ev.cache_salt,
                              ev.group_idx)
        return _ArrayStored(list(ev.block_hashes), ev.parent_block_hash, list(ev.token_ids),
                            ev.block_size, ev.lora_id, ev.medium)
    if isinstance(ev, lib.BlockRemoved):
        if shape == "map":
            return BlockRemoved(list(ev.block_hashes), ev.medium, ev.group_idx)
        return _ArrayRemoved(list(ev.block_hashes), ev.medium)
    if isinstance(ev, lib.AllBlocksCleared):
        return AllBlocksCleared() if shape == "map" else _ArrayCleared()
    raise TypeError(f"events must hold BlockStored / BlockRemoved / AllBlocksCleared, "
                    f"got {type(ev).__name__}")


def encode_batch(events: Sequence[KVEvent], *, ts: float | None = None,
                 dp_rank: int | None = None, shape: str = "map",
                 state_group: bool = True) -> bytes:
    """One batch of events as the msgpack message an engine's publisher sends (the payload
    frame; see the module docstring for the shapes).

    Args:
        events: events from ``RadixCache.take_events()``, oldest first.
        ts: the batch's timestamp, seconds since the epoch (``None``: now).
        dp_rank: the data-parallel rank written in the batch (``None``: nil / omitted).
        shape: ``"map"`` (SGLang 0.5.23, current vLLM) or ``"array"`` (vLLM's older schema).
        state_group: write recurrent-state checkpoints (``"map"`` only; ``False`` for a
            consumer without ``group_idx``, SGLang's).

    Returns:
        The msgpack bytes.

    Raises:
        TypeError / ValueError: a bad argument, naming it.
    """
    _check_shape(shape)
    if isinstance(events, (str, bytes)) or not isinstance(events, Sequence):
        raise TypeError(f"events must be a sequence of KV events, got {type(events).__name__}")
    if ts is None:
        ts = time.time()
    elif isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise TypeError(f"ts must be a float (seconds since the epoch) or None, got {ts!r}")
    if dp_rank is not None and (isinstance(dp_rank, bool) or not isinstance(dp_rank, int)
                                or dp_rank < 0):
        raise ValueError(f"dp_rank must be an int >= 0 or None, got {dp_rank!r}")
    if not isinstance(state_group, bool):
        raise TypeError(f"state_group must be a bool, got {state_group!r}")
    wire: list[Any] = [w for w in (to_wire(e, shape, state_group) for e in events)
                       if w is not None]
    if shape == "map":
        return _ENCODER.encode(KVEventBatch(float(ts), wire, dp_rank))
    # the older schema's batch had no rank: write one only when given
    return _ENCODER.encode([float(ts), wire] + ([] if dp_rank is None else [dp_rank]))


def _check_shape(shape: str) -> None:
    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {SHAPES}, got {shape!r}")
