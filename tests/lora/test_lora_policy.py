"""LoRA eviction policies on their own: exact victim order for lru and fifo, counts, errors,
the base model and unknown ids (SGLang's semantics; SGLang's own cases are in
``tests/lora/test_lora_policy_sglang.py``)."""

from __future__ import annotations

import pytest

from allocators.lora import (
    BASE_MODEL,
    LORA_EVICTION_POLICIES,
    FifoLoraPolicy,
    LruLoraPolicy,
    make_lora_eviction_policy,
)


def test_lru_evicts_least_recently_used_candidate() -> None:
    p = LruLoraPolicy()
    for uid in "abc":
        p.mark_used(uid)
    p.mark_used("a")  # order: b, c, a
    assert p.tracked() == ("b", "c", "a")
    assert p.select_victim({"a", "b", "c"}) == "b"
    assert p.select_victim({"a", "c"}) == "c"  # b is not a candidate: next in order
    assert p.select_victim(["a"]) == "a"
    assert p.eviction_count == 3
    p.remove("b")
    assert p.tracked() == ("c", "a") and "b" not in p and len(p) == 2


def test_fifo_ignores_reuse_and_evicts_first_tracked() -> None:
    p = FifoLoraPolicy()
    for uid in "abc":
        p.mark_used(uid)
    p.mark_used("a")  # a tracked: stays first
    assert p.tracked() == ("a", "b", "c")
    assert p.select_victim({"a", "b", "c"}) == "a"
    p.remove("a")
    p.mark_used("a")  # tracked again: now last
    assert p.tracked() == ("b", "c", "a")
    assert p.select_victim({"c", "a"}) == "c"
    assert p.eviction_count == 2


@pytest.mark.parametrize("cls", [LruLoraPolicy, FifoLoraPolicy])
def test_misuse_raises_and_changes_nothing(cls) -> None:
    p = cls()
    p.mark_used("a")
    with pytest.raises(ValueError, match="no candidates"):
        p.select_victim(set())
    with pytest.raises(ValueError, match="none of the candidates .* is tracked"):
        p.select_victim({"zz", "yy"})  # neither tracked nor the base model
    assert p.tracked() == ("a",) and p.eviction_count == 0


@pytest.mark.parametrize("cls", [LruLoraPolicy, FifoLoraPolicy])
@pytest.mark.parametrize("base", [BASE_MODEL, None])
def test_base_model_and_unknown_ids_as_sglang_treats_them(cls, base) -> None:
    # SGLang spells the base model None, this library BASE_MODEL: both are never tracked.
    p = cls()
    p.mark_used(base)
    p.mark_used("a")
    p.mark_used(base)
    assert p.tracked() == ("a",)
    # An untracked candidate ("zz": never used or already removed) is passed over.
    assert p.select_victim({"zz", "a", base}) == "a"
    p.remove("a")
    p.remove("a")  # unknown ids are ignored
    p.remove("zz")
    p.remove(base)
    assert p.tracked() == ()
    # Nothing tracked among the candidates: the base model goes.
    assert p.select_victim({"zz", base}) is base
    assert p.eviction_count == 2


def test_registry_and_factory() -> None:
    assert sorted(LORA_EVICTION_POLICIES) == ["fifo", "lru"]
    assert isinstance(make_lora_eviction_policy("lru"), LruLoraPolicy)
    assert make_lora_eviction_policy("fifo").name == "fifo"
    with pytest.raises(ValueError, match=r"lora_eviction_policy must be one of \['fifo', 'lru'\]"):
        make_lora_eviction_policy("lfu")
    with pytest.raises(TypeError, match="lora_eviction_policy must be a str"):
        make_lora_eviction_policy(None)
