"""Authenticated L3 pages (a deployment secret): forged records are misses and never stop our
own backup; the secret is never shown; Redis reached as an ACL user.

The attacker of these tests can write to the shared store and knows everything but the secret:
the tokens, the namespace, the model name and the pool layout, so it computes the very page
keys the engines use (``chain_seed`` + ``page_hashes``) and writes well-formed records under
them, checksummed (no secret) or sealed under a secret of its own.
"""

from __future__ import annotations

import json
import logging
import os
from array import array
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from hicache import HiCacheConfig
from hicache.config import SECRET_ENV
from hicache.storage import (
    CorruptPage,
    FileStore,
    MooncakeOptions,
    RedisStore,
    StorageBackend,
    page_hashes,
    page_key,
    state_key,
)
from hicache.storage.page import (
    HEADER_SIZE,
    KIND_KV,
    KIND_STATE,
    decode,
    encode,
    mac_state,
    tag_digest,
)
from tests.helpers.mooncake_helpers import (
    MOONCAKE_ENV,
    MOONCAKE_META_ENV,
    mooncake_extra,
    need_mooncake,
)
from tests.storage.test_storage_common import (
    L3,
    REDIS_ENV,
    WAIT_S,
    RedisServer,
    assert_same_kv,
    drop_everything,
    fresh_model,
    make,
    need_env,
    put_random,
)

SECRET = "deployment-secret-0123456789abcdef"
OTHER = "attackers-own-secret-9876543210"
KEY = [4000 + 5 * i for i in range(16)]


@pytest.fixture(params=["file", REDIS_ENV, MOONCAKE_ENV], ids=["file", "redis", "mooncake"])
def store_at(request: Any, tmp_path: Any) -> tuple[str, str]:
    if request.param == "file":
        return "file", str(tmp_path / "l3")
    if request.param == MOONCAKE_ENV:
        return "mooncake", need_mooncake()[0]
    return "redis", need_env(REDIS_ENV)


def attacker_client(name: str, where: str, tag: str, secret: str | None) -> StorageBackend:
    raw = None if secret is None else secret.encode()
    if name == "file":
        return FileStore(where, tag=tag, secret=raw)
    if name == "redis":
        return RedisStore(where, tag=tag, secret=raw)
    from hicache.storage.mooncake_store import MooncakeStore

    opts = MooncakeOptions.resolve(where, mooncake_extra(os.environ[MOONCAKE_META_ENV]))
    return MooncakeStore(opts, tag=tag, secret=raw)


def forge(victim: L3, name: str, where: str, key: list[int], secret: str | None,
          ns: Any = None) -> int:
    """Write well-formed records of constant bytes under ``key``'s page keys (and the state
    key at its end); returns the records written."""
    st = victim.cache.storage
    assert st is not None
    seed = st.seed(ns)
    assert seed is not None
    hashes = page_hashes(seed, array("q", key), st.page_size)
    page = b"\x7f" * st.page_sections[0]
    items = [(page_key(h), page, page) for h in hashes]
    if st.end_record_bytes is not None:
        conv, ssm = st.end_record_bytes
        items.append((state_key(hashes[-1]), b"\x7f" * conv, b"\x7f" * ssm))
    client = attacker_client(name, where, st.tag, secret)
    try:
        return client.batch_set(items)
    finally:
        client.close()


def served(h: L3, key: list[int]) -> int:
    m = h.cache.match_prefix(key + [1])
    h.cache.sanity_check()
    return int(m.prefix_len + m.host_hit_length)


@pytest.mark.parametrize("forger_secret", [None, OTHER], ids=["checksummed", "other-secret"])
def test_forged_records_are_misses_under_a_secret(store_at: tuple[str, str], caches: list[L3],
                                                  forger_secret: str | None) -> None:
    name, where = store_at
    model = fresh_model()
    victim = make(name, where=where, model=model, secret=SECRET, page_size=2, states=4)
    caches.append(victim)
    assert forge(victim, name, where, KEY, forger_secret) == 8 + 1
    assert served(victim, KEY) == 0  # no valid MAC: a miss
    st = victim.cache.stats()
    assert st["l3_prefetch_timeouts"] == 0  # the miss is the check's, not the deadline's
    assert st["l3_backend_unverified"] >= 1 and st["l3_prefetch_tokens"] == 0


def test_without_a_secret_a_well_formed_forgery_is_served(tmp_path: Any, caches: list[L3]) -> None:
    """What the checksum does not do (the reason for the secret): a record written by anyone
    who knows the tokens, namespace and model is indistinguishable from a real one."""
    where, model = str(tmp_path / "l3"), fresh_model()
    victim = make("file", where=where, model=model, page_size=2)
    caches.append(victim)
    assert forge(victim, "file", where, KEY, None) == 8
    assert served(victim, KEY) == 16


@pytest.mark.parametrize("forger_secret", [None, OTHER], ids=["checksummed", "other-secret"])
def test_a_forged_record_under_our_key_does_not_stop_our_backup(
        store_at: tuple[str, str], caches: list[L3], forger_secret: str | None) -> None:
    name, where = store_at
    model = fresh_model()
    a = make(name, where=where, model=model, secret=SECRET, page_size=2)
    caches.append(a)
    assert forge(a, name, where, KEY, forger_secret) == 8  # planted before A computes KEY
    w = put_random(a, KEY, torch.Generator().manual_seed(5))
    assert a.cache.flush_storage(WAIT_S)
    st = a.cache.stats()
    assert st["l3_backup_unverified"] == 8 and st["l3_backup_written"] == 8
    b = make(name, where=where, model=model, secret=SECRET, page_size=2)
    caches.append(b)
    m = b.cache.match_prefix(KEY + [1])
    assert m.host_hit_length == 16
    assert b.cache.load_back(m.last_host_node) == 16
    m = b.cache.match_prefix(KEY + [1])
    assert_same_kv(b, m.device_indices, w, 16)  # A's bytes, not the forger's


def test_engines_with_and_without_the_secret_never_serve_each_other(tmp_path: Any,
                                                                    caches: list[L3]) -> None:
    where, model = str(tmp_path / "l3"), fresh_model()
    plain = make("file", where=where, model=model)
    sealed = make("file", where=where, model=model, secret=SECRET)
    other = make("file", where=where, model=model, secret=OTHER)
    caches += [plain, sealed, other]
    put_random(plain, KEY, torch.Generator().manual_seed(1))
    assert plain.cache.flush_storage(WAIT_S)
    assert served(sealed, KEY) == 0  # a checksummed record is not authenticated
    key2 = [k + 1 for k in KEY]
    put_random(sealed, key2, torch.Generator().manual_seed(2))
    assert sealed.cache.flush_storage(WAIT_S)
    drop_everything(plain)
    assert served(plain, key2) == 0  # a sealed record cannot be checked without the secret
    assert served(other, key2) == 0  # nor under another secret
    fresh = make("file", where=where, model=model, secret=SECRET)
    caches.append(fresh)
    assert served(fresh, key2) == 16


def test_a_tampered_sealed_record_is_refused() -> None:
    mac = mac_state(SECRET.encode())
    tag, h = tag_digest("t"), bytes(range(32))
    rec = encode(KIND_KV, tag, h, b"ab", b"cd", mac)
    assert [bytes(x) for x in decode(rec, KIND_KV, tag, h, mac)] == [b"ab", b"cd"]
    for pos in (4, 30, HEADER_SIZE - 1, HEADER_SIZE, len(rec) - 1):
        bad = bytearray(rec)
        bad[pos] ^= 1
        with pytest.raises(CorruptPage):
            decode(bytes(bad), KIND_KV, tag, h, mac)
    with pytest.raises(CorruptPage, match="no secret"):
        decode(rec, KIND_KV, tag, h)
    with pytest.raises(CorruptPage, match="not authenticated"):
        decode(encode(KIND_KV, tag, h, b"ab", b"cd"), KIND_KV, tag, h, mac)
    with pytest.raises(CorruptPage, match="MAC mismatch"):
        decode(rec, KIND_KV, tag, h, mac_state(OTHER.encode()))


def test_the_secret_is_checked_and_never_shown(tmp_path: Any, caches: list[L3],
                                               caplog: pytest.LogCaptureFixture,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    for bad, err in (("short", ValueError), (b"x" * 15, ValueError), (5, TypeError)):
        with pytest.raises(err, match="hicache_storage_secret") as info:
            HiCacheConfig(hicache_storage_secret=bad)
        assert "short" not in str(info.value)
    monkeypatch.setenv(SECRET_ENV, "env-short")
    with pytest.raises(ValueError, match=SECRET_ENV) as info:
        HiCacheConfig()
    assert "env-short" not in str(info.value)
    monkeypatch.setenv(SECRET_ENV, SECRET)
    assert HiCacheConfig().storage_secret == SECRET.encode()
    assert HiCacheConfig(hicache_storage_secret=OTHER).storage_secret == OTHER.encode()
    caplog.set_level(logging.DEBUG)
    where = str(tmp_path / "l3")
    h = make("file", where=where, page_size=2)  # the secret from the environment
    caches.append(h)
    assert h.cache.storage is not None and h.cache.storage.backend.authenticated
    put_random(h, KEY, torch.Generator().manual_seed(3))
    forge(h, "file", where, [k + 9 for k in KEY], None)
    served(h, [k + 9 for k in KEY])  # refused records: logged
    assert h.cache.flush_storage(WAIT_S)
    cfg = h.cache.hicache.config  # type: ignore[union-attr]
    assert "refused" in caplog.text
    for text in (repr(cfg), str(cfg), repr(h.cache.storage), repr(h.cache.storage.backend),
                 json.dumps(h.cache.stats(), default=str), caplog.text):
        assert SECRET not in text and SECRET.encode().hex() not in text


@pytest.fixture
def acl_server(tmp_path: Any) -> Iterator[RedisServer]:
    need_env(REDIS_ENV)
    server = RedisServer(str(tmp_path))
    yield server
    server.kill()


def test_redis_reached_as_an_acl_user_with_only_the_commands_it_needs(
        acl_server: RedisServer, caches: list[L3], caplog: pytest.LogCaptureFixture) -> None:
    """``ACL SETUSER``: a user allowed its own key prefix and the commands the backend sends
    (presence, reads, set-if-absent, the compare-and-delete script, the cluster probe); the
    default user is switched off. Two engines share pages as that user; a wrong password is a
    counted miss and never shows up in the logs."""
    import redis

    admin = redis.Redis(port=acl_server.port)
    admin.execute_command("ACL", "SETUSER", "engine", "on", ">engine-acl-pw", "resetkeys",
                          "~hpc:*", "resetchannels", "-@all", "+get", "+mget", "+set",
                          "+exists", "+eval", "+info", "+ping", "+client")
    admin.execute_command("ACL", "SETUSER", "default", "off")
    admin.close()
    url = f"redis://engine:engine-acl-pw@127.0.0.1:{acl_server.port}/0"
    model = fresh_model()
    caplog.set_level(logging.DEBUG)
    a = make("redis", where=url, model=model, page_size=2, states=4, secret=SECRET)
    b = make("redis", where=url, model=model, page_size=2, states=4, secret=SECRET)
    caches += [a, b]
    w = put_random(a, KEY, torch.Generator().manual_seed(8))
    assert a.cache.flush_storage(WAIT_S)
    assert a.cache.stats()["l3_backup_written"] == 8 + 1
    m = b.cache.match_prefix(KEY + [1])
    assert m.host_hit_length == 16 and b.cache.load_back(m.last_host_node) == 16
    assert_same_kv(b, b.cache.match_prefix(KEY + [1]).device_indices, w, 16)
    assert b.cache.stats()["l3_backend_errors"] == 0
    wrong = make("redis", where=url.replace("engine-acl-pw", "not-the-pw"), model=model,
                 page_size=2, states=4, secret=SECRET)
    caches.append(wrong)
    assert served(wrong, KEY) == 0
    assert wrong.cache.stats()["l3_backend_errors"] >= 1
    assert "engine-acl-pw" not in caplog.text and "not-the-pw" not in caplog.text


def test_a_header_only_relabelling_of_a_sealed_record_is_refused() -> None:
    """An attacker with write access moves a sealed record to another key, namespace / layout
    tag or kind by rewriting only the header, consistently with what the reader will ask for:
    the header checks pass, the MAC (over the header too) refuses it."""
    mac = mac_state(SECRET.encode())
    tag, h = tag_digest("t"), bytes(range(32))
    rec = encode(KIND_KV, tag, h, b"ab", b"cd", mac)
    other_h, other_tag = bytes(range(1, 33)), tag_digest("u")
    edits = [
        (24, other_h, KIND_KV, tag, other_h),  # the key (page hash)
        (8, other_tag, KIND_KV, other_tag, h),  # the layout tag
        (6, KIND_STATE.to_bytes(2, "little"), KIND_STATE, tag, h),  # the kind
    ]
    for at, new, kind, want_tag, want_h in edits:
        bad = bytearray(rec)
        bad[at:at + len(new)] = new
        with pytest.raises(CorruptPage, match="MAC mismatch"):
            decode(bytes(bad), kind, want_tag, want_h, mac)
