"""Page keys: a SHA-256 chain over pages, seeded by the layout tag and the namespace.

A prompt's tokens are cut into pages of ``page_size`` tokens (a partial last page is never
stored). Page ``i``'s hash covers the hash of page ``i - 1`` and page ``i``'s token ids, so it
names the whole prefix ``[0, (i + 1) * page_size)``::

    seed  = SHA-256(b"hpc-l3/1\\0" + len(tag) + tag + encode_namespace(extra_key))
    h[0]  = SHA-256(seed   + tokens[0:P]   as int64 little-endian)
    h[i]  = SHA-256(h[i-1] + tokens[iP:(i+1)P] as int64 little-endian)
    key i = h[i].hex()                                      (64 characters)

The layout tag (:func:`layout_tag`) names the model and the pool layout (page size, layers,
heads, head dim, dtypes, state shapes): caches whose pages are not interchangeable never share
a key. The namespace is encoded with its type (``1``, ``"1"``, ``(1,)`` and ``None`` give
different seeds), so namespaces never collide. A namespace of a type with no stable encoding
(:func:`encode_namespace` returns ``None``) is not stored in L3 at all.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
import sys
from array import array
from collections.abc import Sequence
from typing import Any

SEED_PREFIX = b"hpc-l3/1\x00"

#: Suffix of the key of the record at a page's end (the end sections of the components that
#: keep one there: the recurrent state valid at the page's end, a plug-in's per-node value).
END_SUFFIX = ".s"
#: The same suffix under its first name (only the state component kept an end record then).
STATE_SUFFIX = END_SUFFIX


def encode_namespace(extra_key: Any) -> bytes | None:
    """A typed, process-independent encoding of ``extra_key``, or ``None`` when it has none.

    Supported: ``None``, ``bool``, ``int``, ``str``, ``bytes``, ``float``, tuples of these,
    and frozen dataclasses of these (a ``LoraUid``): their qualified type name and fields,
    only for a type that name leads back to (:func:`names_itself`). Subclasses of ``int``
    (``IntEnum`` members; ``bool`` aside), ``str`` (``StrEnum``), ``bytes`` and ``float`` are
    their plain values, and a named tuple is a tuple: as ``radix.tree.namespace_key`` types
    them, so L3 and the tree agree on what is one tenant.

    >>> encode_namespace(None), encode_namespace(1), encode_namespace("1")
    (b'N', b'I1;', b'S1:1')
    """
    if extra_key is None:
        return b"N"
    if isinstance(extra_key, bool):
        return b"B1" if extra_key else b"B0"
    if isinstance(extra_key, int):
        return b"I%d;" % extra_key
    if isinstance(extra_key, str):
        raw = extra_key.encode("utf-8", "surrogatepass")
        return b"S%d:" % len(raw) + raw
    if isinstance(extra_key, bytes):
        return b"Y%d:" % len(extra_key) + extra_key
    if isinstance(extra_key, float):
        return b"F" + extra_key.hex().encode() + b";"
    if isinstance(extra_key, tuple):
        parts: list[bytes] = []
        for x in extra_key:
            part = encode_namespace(x)
            if part is None:
                return None
            parts.append(part)
        return b"T%d(" % len(parts) + b"".join(parts) + b")"
    if dataclasses.is_dataclass(extra_key) and not isinstance(extra_key, type):
        t = type(extra_key)
        params = getattr(t, "__dataclass_params__", None)
        if params is None or not params.frozen or not names_itself(t):
            return None
        name = f"{t.__module__}.{t.__qualname__}".encode()
        fields = tuple(getattr(extra_key, f.name) for f in dataclasses.fields(extra_key))
        body = encode_namespace(fields)
        if body is None:
            return None
        return b"D%d:" % len(name) + name + body
    return None


def names_itself(t: type) -> bool:
    """Whether ``module.qualname`` of ``t`` leads back to ``t`` itself in this process: the
    only types L3 can name unambiguously. Not for a class made inside a function (two calls
    make two types of one name) or the old class of a reloaded module (its name now leads to
    the new class): the tree tells those apart by identity, L3 could not.

    >>> names_itself(int), names_itself(type("Made", (), {}))
    (True, False)
    """
    obj: Any = sys.modules.get(t.__module__)
    for part in t.__qualname__.split("."):
        if obj is None or part == "<locals>":
            return False
        obj = getattr(obj, part, None)
    return obj is t


def chain_seed(tag: str, extra_key: Any) -> bytes | None:
    """The hash before the first page: layout tag and namespace (``None``: not storable)."""
    ns = encode_namespace(extra_key)
    if ns is None:
        return None
    t = tag.encode("utf-8")
    return hashlib.sha256(SEED_PREFIX + struct.pack("<I", len(t)) + t + ns).digest()


def _le_bytes(tokens: array) -> bytes:
    if sys.byteorder == "little":
        return tokens.tobytes()
    swapped = array("q", tokens)
    swapped.byteswap()
    return swapped.tobytes()


def page_hashes(prev: bytes, tokens: array, page_size: int) -> list[bytes]:
    """Chain hashes of the whole pages of ``tokens`` (``array('q')``), after hash ``prev``.

    Complexity: one SHA-256 per page over ``32 + 8 * page_size`` bytes.
    """
    raw = _le_bytes(tokens)
    step = 8 * page_size
    out: list[bytes] = []
    h = prev
    sha = hashlib.sha256
    for off in range(0, len(tokens) // page_size * step, step):
        h = sha(h + raw[off : off + step]).digest()
        out.append(h)
    return out


def page_key(h: bytes) -> str:
    """The storage key of a page hash (lowercase hex)."""
    return h.hex()


def end_key(h: bytes) -> str:
    """The storage key of the record at the end of page ``h`` (the components' end sections:
    the recurrent state valid there, any plug-in's)."""
    return h.hex() + END_SUFFIX


#: :func:`end_key` under its first name (the state was the only end section then).
state_key = end_key


def kv_layout(kv_pool: Any) -> str:
    """The layout tag part of a KV pool's pages (``kv=none``: index-only, empty pages)."""
    if kv_pool is None:
        return "kv=none"
    return f"kv={kv_pool.num_layers}x{kv_pool.num_heads}x{kv_pool.head_dim}:{kv_pool.dtype}"


def state_layout(state_pool: Any) -> str:
    """The layout tag part of a recurrent-state pool's records (a ``MambaStatePool``)."""
    conv = "x".join(map(str, state_pool.conv_state_shape))
    ssm = "x".join(map(str, state_pool.ssm_state_shape))
    return f"state={state_pool.num_layers}:{conv}/{ssm}:{state_pool.dtype}"


def layout_tag_of(model: str, page_size: int, parts: Sequence[str]) -> str:
    """A layout tag from each stored component's part (its ``l3_layout``), primary first.

    Raises:
        ValueError: a part holds ``;`` (the separator) or is empty.
    """
    for p in parts:
        if not p or ";" in p:
            raise ValueError(f"a layout tag part must be non-empty and hold no ';', got {p!r}")
    return ";".join([f"model={model}", f"page={page_size}", *parts])


def layout_tag(model: str, page_size: int, kv_pool: Any, state_pool: Any) -> str:
    """A readable tag naming the model and the layout of one page's bytes.

    ``kv_pool``: a :class:`~allocators.KVPool` or ``None`` (index-only replays store empty
    pages); ``state_pool``: a :class:`~allocators.MambaStatePool` or ``None``. (The tag of a
    cache whose components are KV and state; :func:`layout_tag_of` for any components.)
    """
    parts = [kv_layout(kv_pool)]
    if state_pool is not None:
        parts.append(state_layout(state_pool))
    return layout_tag_of(model, page_size, parts)
