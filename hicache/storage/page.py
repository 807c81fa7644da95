"""The stored record of one page (or of the state at a page's end), with its checksum.

Layout (little-endian; ``HEADER_SIZE`` = 88 bytes, then the body)::

    offset size  field
     0      4    magic      b"HPC3"
     4      2    version    1
     6      2    kind       1 = KV page, 2 = state record
     8     16    tag        first 16 bytes of SHA-256(layout tag)
    24     32    key        the page hash the record belongs to
    56      8    len_a      KV page: K bytes of every layer; state: conv bytes
    64      8    len_b      KV page: V bytes of every layer; state: SSM bytes
    72     16    seal       version 1: SHA-256 over bytes [0, 72) and the body (a checksum);
                            version 2: HMAC-SHA256 under the deployment secret over the same
                            bytes (a MAC), both cut to their first 16 bytes
    88   a + b   body       section a, then section b

A KV page's sections are ``k[:, page_slots]`` and ``v[:, page_slots]`` of the host pool
(``[num_layers, page_size, num_heads, head_dim]``, C order); a state record's are ``conv[:, slot]``
and ``ssm[:, slot]`` (``[num_layers, *shape]``). :func:`decode` refuses a record whose length,
magic, version, kind, tag, key or checksum is not exactly right (:class:`CorruptPage`): a
truncated, torn, bit-flipped or misfiled record is never handed to the engine.

Authenticated records (version 2, :func:`mac_state`): a client with a deployment secret writes
and accepts only records whose seal is the HMAC of header and body under that secret (RFC 2104,
truncated to 128 bits as RFC 4868 does); the header holds the page hash, which chains the
namespace and the layout tag from the seed (:mod:`hicache.storage.keys`), so the MAC binds the
bytes to their key, namespace, model and layout. A client without the secret refuses version-2
records, one with it refuses version-1 records.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from typing import Any

MAGIC = b"HPC3"
VERSION = 1
#: The version of a record sealed with a keyed MAC instead of the checksum.
VERSION_MAC = 2
#: Shortest deployment secret accepted [bytes].
MIN_SECRET_BYTES = 16
KIND_KV = 1
KIND_STATE = 2

_HEAD = struct.Struct("<4sHH16s32sQQ")  # everything before the checksum
CHECKSUM_SIZE = 16
HEADER_SIZE = _HEAD.size + CHECKSUM_SIZE
assert HEADER_SIZE == 88


class CorruptPage(ValueError):
    """A stored record failed verification; ``reason`` says which check. ``foreign``: the
    record is well formed but this client cannot accept it (sealed under another secret or
    forged, sealed where this client has no secret, or not sealed where it needs a MAC): it
    may be another deployment's, so a reader leaves it in place; every other failure is
    damage no client could use."""

    def __init__(self, reason: str, foreign: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.foreign = foreign


def tag_digest(tag: str) -> bytes:
    """The 16 bytes of a layout tag that every record carries."""
    return hashlib.sha256(tag.encode("utf-8")).digest()[:16]


def mac_state(secret: bytes) -> Any:
    """The keyed HMAC-SHA256 state of a deployment secret (at least ``MIN_SECRET_BYTES``),
    copied for every record; pass it as ``mac`` to :func:`encode` / :func:`decode`. It holds
    the key inside OpenSSL: its ``repr`` shows nothing of it.

    Raises:
        TypeError / ValueError: not bytes, or shorter than ``MIN_SECRET_BYTES``.
    """
    if not isinstance(secret, bytes):
        raise TypeError(f"the storage secret must be bytes, got {type(secret).__name__}")
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"the storage secret must be at least {MIN_SECRET_BYTES} bytes")
    return hmac.new(secret, digestmod=hashlib.sha256)


def _seal(head: bytes, a: bytes | memoryview, b: bytes | memoryview, mac: Any) -> bytes:
    # SHA-256: hardware-accelerated in OpenSSL on current CPUs (about 1.5x BLAKE2b, measured);
    # HMAC-SHA256 costs the same pass over the bytes plus one short outer hash.
    h = hashlib.sha256(head) if mac is None else mac.copy()
    if mac is not None:
        h.update(head)
    h.update(a)
    h.update(b)
    return h.digest()[:CHECKSUM_SIZE]


def encode(kind: int, tag: bytes, page_hash: bytes, a: bytes, b: bytes, mac: Any = None) -> bytes:
    """One record: header, seal (checksum, or the MAC under ``mac``: :func:`mac_state`),
    sections ``a`` and ``b``."""
    head = _HEAD.pack(MAGIC, VERSION if mac is None else VERSION_MAC, kind, tag, page_hash,
                      len(a), len(b))
    return b"".join((head, _seal(head, a, b, mac), a, b))


def encode_into(out: memoryview, kind: int, tag: bytes, page_hash: bytes, a: bytes | memoryview,
                b: bytes | memoryview, mac: Any = None) -> int:
    """Write the record of :func:`encode` into ``out`` (writable, at least
    ``HEADER_SIZE + len(a) + len(b)`` bytes) without building it first; returns its length."""
    la, lb = len(a), len(b)
    n = HEADER_SIZE + la + lb
    if len(out) < n:
        raise ValueError(f"record of {n} bytes does not fit a buffer of {len(out)}")
    head = _HEAD.pack(MAGIC, VERSION if mac is None else VERSION_MAC, kind, tag, page_hash, la, lb)
    out[: _HEAD.size] = head
    out[HEADER_SIZE : HEADER_SIZE + la] = a
    out[HEADER_SIZE + la : n] = b
    out[_HEAD.size : HEADER_SIZE] = _seal(head, a, b, mac)
    return n


def decode(record: bytes | memoryview, kind: int, tag: bytes, page_hash: bytes,
           mac: Any = None) -> tuple[memoryview, memoryview]:
    """Sections ``(a, b)`` of a verified record (with ``mac``: an authenticated one).

    Raises:
        CorruptPage: too short, a length that does not add up (truncated or padded), wrong
            magic / version / kind / tag / key, a checksum or MAC mismatch, a record without a
            MAC where ``mac`` is given, or one with a MAC where it is not.
    """
    n = len(record)
    if n < HEADER_SIZE:
        raise CorruptPage(f"truncated: {n} bytes, header needs {HEADER_SIZE}")
    magic, version, rkind, rtag, rkey, len_a, len_b = _HEAD.unpack_from(record, 0)
    if magic != MAGIC:
        raise CorruptPage("bad magic")
    want = VERSION if mac is None else VERSION_MAC
    if version != want:
        if version == VERSION and mac is not None:
            raise CorruptPage("not authenticated (no MAC; written without the deployment secret)",
                              foreign=True)
        if version == VERSION_MAC and mac is None:
            raise CorruptPage("authenticated record (MAC); this client has no secret to check it",
                              foreign=True)
        raise CorruptPage(f"version {version}, expected {want}")
    if rkind != kind:
        raise CorruptPage(f"kind {rkind}, expected {kind}")
    if rtag != tag:
        raise CorruptPage("layout tag differs (another model or pool layout)")
    if rkey != page_hash:
        raise CorruptPage("record belongs to another key")
    if n != HEADER_SIZE + len_a + len_b:
        raise CorruptPage(f"length {n}, header says {HEADER_SIZE + len_a + len_b}")
    view = memoryview(record)
    a = view[HEADER_SIZE : HEADER_SIZE + len_a]
    b = view[HEADER_SIZE + len_a :]
    seal = _seal(view[: _HEAD.size].tobytes(), a, b, mac)
    if mac is None:
        if seal != record[_HEAD.size : HEADER_SIZE]:
            raise CorruptPage("checksum mismatch")
    elif not hmac.compare_digest(seal, bytes(view[_HEAD.size : HEADER_SIZE])):
        raise CorruptPage("MAC mismatch (forged, or sealed under another secret)", foreign=True)
    return a, b
