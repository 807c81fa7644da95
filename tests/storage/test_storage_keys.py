"""Page keys (the hash chain, computed here again with hashlib) and the record format."""

from __future__ import annotations

import hashlib
import struct
from array import array
from typing import Any

import pytest
import torch
import xxhash

from allocators import KVPool, MambaStatePool
from allocators.lora import LoraUid
from hicache.storage import (
    CorruptPage,
    chain_seed,
    encode_namespace,
    layout_tag,
    page_hashes,
    page_key,
    state_key,
)
from hicache.storage.page import (
    HEADER_SIZE,
    KIND_KV,
    KIND_STATE,
    decode,
    default_checksum,
    encode,
    encode_into,
    mac_state,
    tag_digest,
)
from tests.helpers.isolated import run_python


def ref_seed(tag: str, ns: bytes) -> bytes:
    t = tag.encode()
    return hashlib.sha256(b"hpc-l3/1\x00" + struct.pack("<I", len(t)) + t + ns).digest()


def ref_chain(seed: bytes, tokens: list[int], page: int) -> list[str]:
    out, h = [], seed
    for i in range(0, len(tokens) - len(tokens) % page, page):
        h = hashlib.sha256(h + b"".join(t.to_bytes(8, "little", signed=True)
                                        for t in tokens[i:i + page])).digest()
        out.append(h.hex())
    return out


@pytest.mark.parametrize("page", [1, 4])
def test_chain_values_match_an_independent_computation(page: int) -> None:
    tokens = [7, 0, 2**40, 5, 9, 9, 1, 3, 11, 4]  # 10 tokens: page 4 leaves a partial tail
    seed = chain_seed("model=m;page=4", None)
    assert seed == ref_seed("model=m;page=4", b"N")
    got = [page_key(h) for h in page_hashes(seed, array("q", tokens), page)]  # type: ignore[arg-type]
    assert got == ref_chain(seed, tokens, page)  # type: ignore[arg-type]
    assert len(got) == len(tokens) // page
    # Each key names its whole prefix: continuing from page 1's hash gives the same tail.
    hs = page_hashes(seed, array("q", tokens), page)  # type: ignore[arg-type]
    assert page_hashes(hs[0], array("q", tokens[page:]), page) == hs[1:]
    assert state_key(hs[0]) == hs[0].hex() + ".s"


def test_one_changed_token_changes_that_page_and_every_later_one() -> None:
    seed = chain_seed("t", None)
    assert seed is not None
    a = page_hashes(seed, array("q", [1, 2, 3, 4, 5, 6]), 2)
    b = page_hashes(seed, array("q", [1, 2, 3, 9, 5, 6]), 2)
    assert a[0] == b[0] and a[1] != b[1] and a[2] != b[2]


def test_namespaces_are_typed_and_never_collide() -> None:
    uid = LoraUid("ad", 3)
    spaces = [None, 1, "1", b"1", (1,), ("1",), 1.0, True, 0, False, "", (), uid, ("ad", 3), "ad#3"]
    encoded = [encode_namespace(x) for x in spaces]
    assert None not in encoded
    assert len(set(encoded)) == len(spaces)
    assert encode_namespace(None) == b"N" and encode_namespace(12) == b"I12;"
    assert encode_namespace("ab") == b"S2:ab" and encode_namespace((1, "a")) == b"T2(I1;S1:a)"
    seeds = {chain_seed("tag", x) for x in spaces}
    assert len(seeds) == len(spaces)
    assert chain_seed("tag", "x") == ref_seed("tag", b"S1:x")


def test_a_namespace_without_a_stable_encoding_is_not_storable() -> None:
    assert encode_namespace(object()) is None
    assert encode_namespace((1, object())) is None
    assert chain_seed("t", frozenset({1})) is None


def test_layout_tag_names_model_page_and_pool_shapes() -> None:
    kv = KVPool(8, 3, 2, 4, torch.bfloat16, "cpu")
    sp = MambaStatePool(2, num_layers=3, conv_state_shape=(3,), ssm_state_shape=(2, 2))
    tag = layout_tag("m", 4, kv, sp)
    assert tag == "model=m;page=4;kv=3x2x4:torch.bfloat16;state=3:3/2x2:torch.float32"
    assert layout_tag("m", 4, kv, None) != tag and layout_tag("n", 4, kv, sp) != tag
    assert layout_tag("m", 1, kv, sp) != tag and layout_tag("m", 4, None, None).endswith("kv=none")
    assert chain_seed(tag, None) != chain_seed(layout_tag("m", 4, kv, None), None)


# ===================================================================== records
H = hashlib.sha256(b"page").digest()
TAG = tag_digest("tag")


def _sha256_16(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()[:16]


def _xxh3_128(data: bytes) -> bytes:
    return xxhash.xxh3_128(data).digest()  # canonical: big-endian, 16 bytes


@pytest.mark.parametrize(("checksum", "version", "seal"), [
    ("sha256", 1, _sha256_16), ("xxh3_128", 3, _xxh3_128)])
def test_record_header_layout_and_round_trip(checksum: str, version: int, seal: Any) -> None:
    rec = encode(KIND_KV, TAG, H, b"K" * 10, b"V" * 6, checksum=checksum)
    assert len(rec) == HEADER_SIZE + 16 == 104
    assert rec[:4] == b"HPC3" and struct.unpack_from("<HH", rec, 4) == (version, KIND_KV)
    assert rec[8:24] == TAG and rec[24:56] == H
    assert struct.unpack_from("<QQ", rec, 56) == (10, 6)
    assert rec[72:88] == seal(rec[:72] + rec[88:])
    a, b = decode(rec, KIND_KV, TAG, H)  # a client reads either checksum: the record says
    assert bytes(a) == b"K" * 10 and bytes(b) == b"V" * 6
    out = bytearray(200)
    assert encode_into(memoryview(out), KIND_KV, TAG, H, b"K" * 10, b"V" * 6,
                       checksum=checksum) == 104 and bytes(out[:104]) == rec


def test_records_are_written_with_xxh3_when_installed_and_refused_checksums() -> None:
    assert default_checksum() == "xxh3_128"
    rec = encode(KIND_KV, TAG, H, b"K", b"V")
    assert struct.unpack_from("<H", rec, 4) == (3,)
    with pytest.raises(ValueError, match="checksum"):
        encode(KIND_KV, TAG, H, b"K", b"V", checksum="crc32")
    # a MAC client: the seal is the MAC whatever the checksum; checksummed records are foreign
    mac = mac_state(b"s" * 16)
    sealed = encode(KIND_KV, TAG, H, b"K", b"V", mac=mac, checksum="xxh3_128")
    assert struct.unpack_from("<H", sealed, 4) == (2,)
    for version_rec in (rec, encode(KIND_KV, TAG, H, b"K", b"V", checksum="sha256")):
        with pytest.raises(CorruptPage, match="not authenticated") as e:
            decode(version_rec, KIND_KV, TAG, H, mac)
        assert e.value.foreign
    # the algorithm a record names is the one checked: a seal swapped to the other fails
    swapped = bytearray(rec)
    struct.pack_into("<H", swapped, 4, 1)
    with pytest.raises(CorruptPage, match="checksum mismatch"):
        decode(bytes(swapped), KIND_KV, TAG, H)


def test_without_xxhash_records_are_sha256_and_xxh3_ones_are_foreign() -> None:
    xxh3_rec = encode(KIND_KV, TAG, H, b"K" * 3, b"V").hex()
    code = f"""
import sys
sys.modules['xxhash'] = None
from hicache.storage.page import (KIND_KV, CorruptPage, decode, default_checksum, encode)
tag, h = bytes.fromhex({TAG.hex()!r}), bytes.fromhex({H.hex()!r})
assert default_checksum() == 'sha256'
rec = encode(KIND_KV, tag, h, b'K' * 3, b'V')
assert rec[4] == 1 and bytes(decode(rec, KIND_KV, tag, h)[0]) == b'KKK'
try:
    decode(bytes.fromhex({xxh3_rec!r}), KIND_KV, tag, h)
except CorruptPage as e:
    print('foreign' if e.foreign else 'damaged', e)
try:
    encode(KIND_KV, tag, h, b'K', b'V', checksum='xxh3_128')
except ValueError as e:
    print('refused:', e)
"""
    out = run_python(code)
    assert "foreign XXH3-128 checksum" in out
    assert "refused: checksum='xxh3_128' needs the xxhash package" in out


def test_every_damaged_or_misfiled_record_is_refused() -> None:
    rec = encode(KIND_STATE, TAG, H, b"conv", b"ssm!")
    bad: dict[str, bytes] = {
        "truncated": rec[:-1],
        "header only": rec[:HEADER_SIZE - 1],
        "padded": rec + b"\0",
        "empty": b"",
    }
    for i in range(len(rec)):  # one flipped bit anywhere
        flipped = bytearray(rec)
        flipped[i] ^= 0x10
        bad[f"bit {i}"] = bytes(flipped)
    for name, r in bad.items():
        with pytest.raises(CorruptPage):
            decode(r, KIND_STATE, TAG, H)
        assert name
    with pytest.raises(CorruptPage, match="kind"):
        decode(rec, KIND_KV, TAG, H)
    with pytest.raises(CorruptPage, match="layout tag"):
        decode(rec, KIND_STATE, tag_digest("other"), H)
    with pytest.raises(CorruptPage, match="another key"):
        decode(rec, KIND_STATE, TAG, hashlib.sha256(b"x").digest())
