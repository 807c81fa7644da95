"""LoRA eviction policies on their own: exact victim order for lru and fifo, counts, errors."""

from __future__ import annotations

import pytest

from allocators.lora import (
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
    with pytest.raises(ValueError, match="not tracked"):
        p.select_victim({"a", "zz"})
    with pytest.raises(ValueError, match="not tracked"):
        p.remove("zz")
    assert p.tracked() == ("a",) and p.eviction_count == 0


def test_registry_and_factory() -> None:
    assert sorted(LORA_EVICTION_POLICIES) == ["fifo", "lru"]
    assert isinstance(make_lora_eviction_policy("lru"), LruLoraPolicy)
    assert make_lora_eviction_policy("fifo").name == "fifo"
    with pytest.raises(ValueError, match=r"lora_eviction_policy must be one of \['fifo', 'lru'\]"):
        make_lora_eviction_policy("lfu")
    with pytest.raises(TypeError, match="lora_eviction_policy must be a str"):
        make_lora_eviction_policy(None)
