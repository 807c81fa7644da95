"""Adapter identity: which adapter a request runs with.

Every load of an adapter gets a fresh :class:`LoraUid` ``(name, serial, digest)``; loading the
same name again gives a different uid, so anything keyed by uid (slots, the radix tree's
``extra_key`` namespace) never confuses the new weights with the old. ``digest`` is a digest
of the adapter's content (``LoraAdapter.digest``): a pool started again, or another engine
sharing the L3 store, that loads *different* weights under the same name and serial gets a
different uid, so its prefixes never meet the old adapter's pages. The base model is the
explicit singleton :data:`BASE_MODEL` (zero weights, rank 0) -- never ``None``, which in
:class:`~allocators.lora.LoraMemoryPool` means only "empty slot".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

__all__ = ["BASE_MODEL", "AdapterId", "BaseModel", "LoraUid", "lora_extra_key"]


@dataclass(frozen=True, slots=True)
class LoraUid:
    """The unique id of one load of an adapter.

    ``serial`` is unique within the pool that issued it (a counter that never goes back), so
    a reload of ``name`` gets a different uid; ``digest`` (``LoraAdapter.digest``, the SHA-256
    of the weights and scaling the pool computes with) ties the uid to the adapter's content
    across pools and restarts, where serials repeat. Equality and hash cover all three and
    the class: a uid never equals a string, so ``extra_key=uid`` cannot collide with a cache
    salt spelled ``"name#serial"``.
    """

    name: str
    serial: int
    digest: str = ""

    def __str__(self) -> str:
        return f"{self.name}#{self.serial}"


class BaseModel:
    """Type of :data:`BASE_MODEL`, the base model's own slot value (zero weights, rank 0)."""

    __slots__ = ()
    _instance: BaseModel | None = None

    def __new__(cls) -> BaseModel:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "BASE_MODEL"

    def __reduce__(self) -> str:
        return "BASE_MODEL"


BASE_MODEL: Final = BaseModel()
"""The base model (no adapter). It occupies a slot like an adapter does, with zero weights."""

AdapterId = LoraUid | BaseModel
"""What a request runs with: one loaded adapter or the base model."""


def lora_extra_key(adapter: AdapterId) -> LoraUid | None:
    """The radix-tree namespace (``extra_key``) for requests run with ``adapter``.

    The base model uses the default namespace ``None`` (its KV is that of a model without
    LoRA); an adapter uses its uid, so prefixes of different adapters, of different loads of
    one name, and of the base model never share nodes.

    Raises:
        TypeError: ``adapter`` is neither a :class:`LoraUid` nor :data:`BASE_MODEL`.
    """
    if isinstance(adapter, BaseModel):
        return None
    if isinstance(adapter, LoraUid):
        return adapter
    raise TypeError(f"adapter must be a LoraUid or BASE_MODEL, got {type(adapter).__name__}")
