"""SGLang's unit tests of its LoRA eviction policies, reproduced against this library.

Same calls (``mark_used`` in order, then ``select_victim(candidates)``; ``remove``), same
expected victims, with SGLang's spelling of the base model (``None``). SGLang's factory is
``get_eviction_policy(name)``; this library's is :func:`make_lora_eviction_policy`.
"""

from __future__ import annotations

import pytest

from allocators.lora import make_lora_eviction_policy

CASES = [
    # (policy, access sequence, candidates, expected victim)
    pytest.param("lru", ["lora1", "lora2", "lora3", "lora4"], {"lora1", "lora2", "lora3", "lora4"},
                 "lora1", id="lru_basic"),
    pytest.param("lru", ["lora1", "lora2", "lora3", "lora4", "lora1"],
                 {"lora1", "lora2", "lora3", "lora4"}, "lora2", id="lru_with_reuse"),
    pytest.param("lru", ["lora1", "lora2", "lora3", "lora1", "lora2"], {"lora1", "lora2", "lora3"},
                 "lora3", id="lru_multiple_reuse"),
    pytest.param("lru", ["lora1", "lora2", "lora3", "lora4"], {"lora2", "lora3", "lora4"},
                 "lora2", id="lru_with_subset_candidates"),
    pytest.param("lru", ["lora1", "lora2", "lora3"], {None, "lora1", "lora2", "lora3"}, "lora1",
                 id="lru_base_model_evicted_last"),
    pytest.param("fifo", ["lora1", "lora2", "lora3", "lora4"], {"lora1", "lora2", "lora3", "lora4"},
                 "lora1", id="fifo_basic"),
    pytest.param("fifo", ["lora1", "lora2", "lora3", "lora4", "lora4", "lora3", "lora2", "lora1"],
                 {"lora1", "lora2", "lora3", "lora4"}, "lora1", id="fifo_ignores_reuse"),
    pytest.param("fifo", ["lora1", "lora2", "lora3", "lora4"], {"lora2", "lora3", "lora4"},
                 "lora2", id="fifo_with_subset_candidates"),
    pytest.param("fifo", ["lora1", "lora2", "lora3"], {None, "lora1", "lora2", "lora3"}, "lora1",
                 id="fifo_base_model_evicted_last"),
]  # fmt: skip


@pytest.mark.parametrize(("policy", "accesses", "candidates", "expected"), CASES)
def test_victim(policy: str, accesses: list[str], candidates: set, expected: str) -> None:
    p = make_lora_eviction_policy(policy)
    for uid in accesses:
        p.mark_used(uid)
    assert p.select_victim(candidates) == expected


def test_policy_remove() -> None:
    lru = make_lora_eviction_policy("lru")
    for uid in ("lora1", "lora2", "lora3"):
        lru.mark_used(uid)
    lru.remove("lora1")  # lora2 becomes least recent; lora1, still a candidate, is passed over
    assert lru.select_victim({"lora1", "lora2", "lora3"}) == "lora2"


def test_eviction_policy_factory() -> None:
    assert make_lora_eviction_policy("lru") is not None
    assert make_lora_eviction_policy("fifo") is not None
    with pytest.raises(ValueError):
        make_lora_eviction_policy("invalid_policy")


def test_lru_vs_fifo_behavior() -> None:
    accesses, candidates = ["lora1", "lora2", "lora3", "lora1"], {"lora1", "lora2", "lora3"}
    victims = {}
    for name in ("lru", "fifo"):
        p = make_lora_eviction_policy(name)
        for uid in accesses:
            p.mark_used(uid)
        victims[name] = p.select_victim(candidates)
    assert victims["lru"] != victims["fifo"]
    assert victims == {"lru": "lora2", "fifo": "lora1"}


def test_base_model_only_candidate_is_the_victim() -> None:
    # SGLang's fallback: an all-adapter batch leaves only the base model (never marked used,
    # since mark_used(None) is ignored) as a candidate.
    for name in ("lru", "fifo"):
        p = make_lora_eviction_policy(name)
        for uid in (None, "lora1", None):
            p.mark_used(uid)
        assert p.tracked() == ("lora1",)
        assert p.select_victim({None}) is None
        assert p.eviction_count == 1
