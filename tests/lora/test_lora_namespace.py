"""Adapter namespaces in the radix tree: a request through an adapter uses its uid as
``extra_key``, so adapters, reloads of one name, the base model and cache salts never share."""

from __future__ import annotations

import pickle

import pytest

from allocators import TokenAllocator
from allocators.lora import BASE_MODEL, BaseModel, LoraUid, lora_extra_key
from radix import RadixCache

PROMPT = list(range(100, 112))


def put(cache: RadixCache, kv: TokenAllocator, extra_key) -> None:
    slots = kv.alloc(len(PROMPT))
    assert slots is not None
    res = cache.insert(PROMPT, slots, extra_key=extra_key)
    if len(res.duplicate_indices):
        kv.free(res.duplicate_indices)
    cache.sanity_check()


def hit(cache: RadixCache, extra_key) -> int:
    return cache.match_prefix(PROMPT, extra_key=extra_key).prefix_len


def test_adapters_reloads_and_base_model_never_share_prefixes() -> None:
    kv = TokenAllocator(256)
    cache = RadixCache(kv_allocator=kv)
    a0, a1, b0 = LoraUid("a", 0), LoraUid("a", 1), LoraUid("b", 2)  # a1: a reload of "a"
    put(cache, kv, lora_extra_key(a0))
    assert hit(cache, lora_extra_key(a0)) == len(PROMPT)
    for other in (a1, b0, BASE_MODEL):
        assert hit(cache, lora_extra_key(other)) == 0
    put(cache, kv, lora_extra_key(BASE_MODEL))  # the base model's namespace is the default one
    assert hit(cache, None) == len(PROMPT)
    assert hit(cache, lora_extra_key(b0)) == 0
    assert kv.used_size() == 2 * len(PROMPT)  # two copies: nothing was shared


def test_a_typed_uid_never_collides_with_a_salt_of_the_same_text() -> None:
    kv = TokenAllocator(256)
    cache = RadixCache(kv_allocator=kv)
    uid = LoraUid("a", 0)
    salt = str(uid)  # "a#0"
    assert salt == "a#0" and uid != salt and lora_extra_key(uid) != salt
    put(cache, kv, salt)
    assert hit(cache, uid) == 0
    put(cache, kv, uid)
    assert hit(cache, uid) == hit(cache, salt) == len(PROMPT)
    assert kv.used_size() == 2 * len(PROMPT)


def test_lora_extra_key_rejects_other_values() -> None:
    assert lora_extra_key(BASE_MODEL) is None
    with pytest.raises(TypeError, match="LoraUid or BASE_MODEL"):
        lora_extra_key(None)
    with pytest.raises(TypeError):
        lora_extra_key("a#0")


def test_base_model_is_a_singleton_that_survives_pickling() -> None:
    assert BaseModel() is BASE_MODEL
    assert pickle.loads(pickle.dumps(BASE_MODEL)) is BASE_MODEL
    assert repr(BASE_MODEL) == "BASE_MODEL"
