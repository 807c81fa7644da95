"""The stored record of one page (or of the state at a page's end), with its checksum.

Layout (little-endian; ``HEADER_SIZE`` = 88 bytes, then the body)::

    offset size  field
     0      4    magic      b"HPC3"
     4      2    version    1, 2 or 3 (the seal's kind, below)
     6      2    kind       1 = KV page, 2 = state record
     8     16    tag        first 16 bytes of SHA-256(layout tag)
    24     32    key        the page hash the record belongs to
    56      8    len_a      KV page: K bytes of every layer; state: conv bytes
    64      8    len_b      KV page: V bytes of every layer; state: SSM bytes
    72     16    seal       over bytes [0, 72) and the body: version 3: XXH3-128 (a
                            checksum, the 16 bytes of its canonical big-endian digest);
                            version 1: SHA-256 (a checksum); version 2: HMAC-SHA256 under
                            the deployment secret (a MAC); SHA-256's cut to 16 bytes
    88   a + b   body       section a, then section b

A KV page's sections are ``k[:, page_slots]`` and ``v[:, page_slots]`` of the host pool
(``[num_layers, page_size, num_heads, head_dim]``, C order); a state record's are ``conv[:, slot]``
and ``ssm[:, slot]`` (``[num_layers, *shape]``). :func:`decode` refuses a record whose length,
magic, version, kind, tag, key or checksum is not exactly right (:class:`CorruptPage`): a
truncated, torn, bit-flipped or misfiled record is never handed to the engine.

Checksums (no secret): a record says which it carries. Records are written with XXH3-128
(version 3) when the ``xxhash`` package is installed (the ``checksums`` extra; about 20-30x
SHA-256's throughput on 64 KiB - 1 MiB pages), else with SHA-256 (version 1); every client
reads both, and one without ``xxhash`` refuses a version-3 record as ``foreign`` (well formed,
left in place for the clients that can check it). A checksum detects damage, not forgery: the
page keys stay SHA-256 chains (:mod:`hicache.storage.keys`) and the MAC HMAC-SHA256.

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
from collections.abc import Callable
from typing import Any

_xxh3_128: Callable[[bytes], Any] | None
try:
    from xxhash import xxh3_128

    _xxh3_128 = xxh3_128
except ImportError:  # the optional dependency: records are checksummed with SHA-256
    _xxh3_128 = None

MAGIC = b"HPC3"
#: The version of a record checksummed with SHA-256.
VERSION = 1
#: The version of a record sealed with a keyed MAC instead of the checksum.
VERSION_MAC = 2
#: The version of a record checksummed with XXH3-128.
VERSION_XXH3 = 3
#: Checksum name -> record version.
CHECKSUMS = {"sha256": VERSION, "xxh3_128": VERSION_XXH3}
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


def default_checksum() -> str:
    """The checksum records are written with when no secret is set: ``"xxh3_128"`` with the
    ``xxhash`` package installed, else ``"sha256"``."""
    return "sha256" if _xxh3_128 is None else "xxh3_128"


def _version(mac: Any, checksum: str | None) -> int:
    if mac is not None:
        return VERSION_MAC
    if checksum is None:
        return VERSION if _xxh3_128 is None else VERSION_XXH3
    version = CHECKSUMS.get(checksum)
    if version is None:
        raise ValueError(f"checksum must be one of {sorted(CHECKSUMS)} or None, got {checksum!r}")
    if version == VERSION_XXH3 and _xxh3_128 is None:
        raise ValueError("checksum='xxh3_128' needs the xxhash package "
                         "(pip install 'hybrid-prefix-cache[checksums]')")
    return version


def _seal(version: int, head: bytes, a: bytes | memoryview, b: bytes | memoryview,
          mac: Any) -> bytes:
    # XXH3-128: a non-cryptographic checksum at memory speed; SHA-256: hardware-accelerated in
    # OpenSSL (about 1.5x BLAKE2b, measured); HMAC-SHA256 costs the same pass over the bytes
    # plus one short outer hash.
    if version == VERSION_XXH3:
        assert _xxh3_128 is not None
        x = _xxh3_128(head)
        x.update(a)
        x.update(b)
        return x.digest()
    h = hashlib.sha256(head) if mac is None else mac.copy()
    if mac is not None:
        h.update(head)
    h.update(a)
    h.update(b)
    return h.digest()[:CHECKSUM_SIZE]


def encode(kind: int, tag: bytes, page_hash: bytes, a: bytes, b: bytes, mac: Any = None,
           checksum: str | None = None) -> bytes:
    """One record: header, seal (the checksum, or the MAC under ``mac``: :func:`mac_state`),
    sections ``a`` and ``b``. ``checksum``: ``"xxh3_128"`` / ``"sha256"`` (``None``:
    :func:`default_checksum`; ignored under ``mac``).

    Raises:
        ValueError: an unknown ``checksum``, or ``"xxh3_128"`` without the xxhash package.
    """
    version = _version(mac, checksum)
    head = _HEAD.pack(MAGIC, version, kind, tag, page_hash, len(a), len(b))
    return b"".join((head, _seal(version, head, a, b, mac), a, b))


def encode_into(out: memoryview, kind: int, tag: bytes, page_hash: bytes, a: bytes | memoryview,
                b: bytes | memoryview, mac: Any = None, checksum: str | None = None) -> int:
    """Write the record of :func:`encode` into ``out`` (writable, at least
    ``HEADER_SIZE + len(a) + len(b)`` bytes) without building it first; returns its length."""
    la, lb = len(a), len(b)
    n = HEADER_SIZE + la + lb
    if len(out) < n:
        raise ValueError(f"record of {n} bytes does not fit a buffer of {len(out)}")
    version = _version(mac, checksum)
    head = _HEAD.pack(MAGIC, version, kind, tag, page_hash, la, lb)
    out[: _HEAD.size] = head
    out[HEADER_SIZE : HEADER_SIZE + la] = a
    out[HEADER_SIZE + la : n] = b
    out[_HEAD.size : HEADER_SIZE] = _seal(version, head, a, b, mac)
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
    if mac is not None and version != VERSION_MAC:
        if version in (VERSION, VERSION_XXH3):
            raise CorruptPage("not authenticated (no MAC; written without the deployment secret)",
                              foreign=True)
        raise CorruptPage(f"version {version}, expected {VERSION_MAC}")
    if mac is None and version not in (VERSION, VERSION_XXH3):
        if version == VERSION_MAC:
            raise CorruptPage("authenticated record (MAC); this client has no secret to check it",
                              foreign=True)
        raise CorruptPage(f"version {version}, expected {VERSION} or {VERSION_XXH3}")
    if version == VERSION_XXH3 and _xxh3_128 is None:
        raise CorruptPage("XXH3-128 checksum; this client has no xxhash package to check it",
                          foreign=True)
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
    seal = _seal(version, view[: _HEAD.size].tobytes(), a, b, mac)
    if mac is None:
        if seal != record[_HEAD.size : HEADER_SIZE]:
            raise CorruptPage("checksum mismatch")
    elif not hmac.compare_digest(seal, bytes(view[_HEAD.size : HEADER_SIZE])):
        raise CorruptPage("MAC mismatch (forged, or sealed under another secret)", foreign=True)
    return a, b
