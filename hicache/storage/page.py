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
    72     16    checksum   SHA-256 over bytes [0, 72) and the body, first 16 bytes
    88   a + b   body       section a, then section b

A KV page's sections are ``k[:, page_slots]`` and ``v[:, page_slots]`` of the host pool
(``[num_layers, page_size, num_heads, head_dim]``, C order); a state record's are ``conv[:, slot]``
and ``ssm[:, slot]`` (``[num_layers, *shape]``). :func:`decode` refuses a record whose length,
magic, version, kind, tag, key or checksum is not exactly right (:class:`CorruptPage`): a
truncated, torn, bit-flipped or misfiled record is never handed to the engine.
"""

from __future__ import annotations

import hashlib
import struct

MAGIC = b"HPC3"
VERSION = 1
KIND_KV = 1
KIND_STATE = 2

_HEAD = struct.Struct("<4sHH16s32sQQ")  # everything before the checksum
CHECKSUM_SIZE = 16
HEADER_SIZE = _HEAD.size + CHECKSUM_SIZE
assert HEADER_SIZE == 88


class CorruptPage(ValueError):
    """A stored record failed verification; ``reason`` says which check."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def tag_digest(tag: str) -> bytes:
    """The 16 bytes of a layout tag that every record carries."""
    return hashlib.sha256(tag.encode("utf-8")).digest()[:16]


def _checksum(head: bytes, a: bytes | memoryview, b: bytes | memoryview) -> bytes:
    # SHA-256: hardware-accelerated in OpenSSL on current CPUs (about 1.5x BLAKE2b, measured)
    h = hashlib.sha256(head)
    h.update(a)
    h.update(b)
    return h.digest()[:CHECKSUM_SIZE]


def encode(kind: int, tag: bytes, page_hash: bytes, a: bytes, b: bytes) -> bytes:
    """One record: header, checksum, sections ``a`` and ``b``."""
    head = _HEAD.pack(MAGIC, VERSION, kind, tag, page_hash, len(a), len(b))
    return b"".join((head, _checksum(head, a, b), a, b))


def encode_into(out: memoryview, kind: int, tag: bytes, page_hash: bytes, a: bytes | memoryview,
                b: bytes | memoryview) -> int:
    """Write the record of :func:`encode` into ``out`` (writable, at least
    ``HEADER_SIZE + len(a) + len(b)`` bytes) without building it first; returns its length."""
    la, lb = len(a), len(b)
    n = HEADER_SIZE + la + lb
    if len(out) < n:
        raise ValueError(f"record of {n} bytes does not fit a buffer of {len(out)}")
    head = _HEAD.pack(MAGIC, VERSION, kind, tag, page_hash, la, lb)
    out[: _HEAD.size] = head
    out[HEADER_SIZE : HEADER_SIZE + la] = a
    out[HEADER_SIZE + la : n] = b
    out[_HEAD.size : HEADER_SIZE] = _checksum(head, a, b)
    return n


def decode(record: bytes | memoryview, kind: int, tag: bytes, page_hash: bytes) -> tuple[memoryview, memoryview]:
    """Sections ``(a, b)`` of a verified record.

    Raises:
        CorruptPage: too short, a length that does not add up (truncated or padded), wrong
            magic / version / kind / tag / key, or a checksum mismatch.
    """
    n = len(record)
    if n < HEADER_SIZE:
        raise CorruptPage(f"truncated: {n} bytes, header needs {HEADER_SIZE}")
    magic, version, rkind, rtag, rkey, len_a, len_b = _HEAD.unpack_from(record, 0)
    if magic != MAGIC:
        raise CorruptPage("bad magic")
    if version != VERSION:
        raise CorruptPage(f"version {version}, expected {VERSION}")
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
    if _checksum(view[: _HEAD.size].tobytes(), a, b) != record[_HEAD.size : HEADER_SIZE]:
        raise CorruptPage("checksum mismatch")
    return a, b
