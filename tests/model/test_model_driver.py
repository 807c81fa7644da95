"""End to end: a real hybrid model served through our cache. For every request the logits of
the suffix computed from the cached prefix (KV gathered from our pool, the matched state copied
into the request's own slot) equal those of a full forward over the whole prompt
(``torch.testing.assert_close``, float32 defaults: rtol 1.3e-6, atol 1e-5), with evictions
forced by small KV and state pools, for page sizes 1 and 16. Negative controls: corrupting one
cached KV slot or one state makes the check fail.

Skipped without the optional extra (``pip install -e .[model]``).
"""

from __future__ import annotations

import pytest
import torch

from bench.dev.model import MIN_TRANSFORMERS

pytest.importorskip("transformers", minversion=MIN_TRANSFORMERS,
                    reason="model tests need the optional extra: pip install -e .[model]")

from bench.dev.model.driver import DriverConfig, ModelDriver, tree_prompts  # noqa: E402
from radix import RadixKey  # noqa: E402
from tests.helpers.model_helpers import (  # noqa: E402, F401  (one_thread: autouse fixture)
    ARCHS,
    HYBRID,
    NUM_PROMPTS,
    KnownLibraryBug,
    assert_idle_and_leak_free,
    driver,
    known_bug,
    one_thread,
)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("arch", ARCHS)
def test_every_request_matches_a_full_forward(arch: str, page_size: int, record_property) -> None:
    d = driver(arch, page_size)
    prompts = tree_prompts(NUM_PROMPTS, vocab=d.model.config.vocab_size, seed=0)
    report = d.run(prompts)  # raises AssertionError on the first request that differs
    record_property("max_abs_diff", report.max_abs_diff)
    assert len(report.checks) == NUM_PROMPTS
    assert report.max_abs_diff < 1e-5
    # The run really reused cached data and really ran short of memory.
    st = report.cache_stats
    reused = [c for c in report.checks if c.prefix_len > 0]
    assert len(reused) >= 8 and report.reused_tokens >= 160
    assert all(c.prefix_len % page_size == 0 for c in report.checks)
    assert st["evicted_tokens"] > 0
    assert report.checkpoints > 0
    if arch in HYBRID:
        assert st["evicted_states"] > 0
        assert report.branch_checkpoints > 0
        assert any(c.kv_hit_len > c.prefix_len for c in report.checks)  # state misses
    else:
        assert st["evicted_swa_tokens"] > 0
    assert_idle_and_leak_free(d)


def two_prompts(vocab: int) -> tuple[list[int], list[int]]:
    g = torch.Generator().manual_seed(7)
    first = torch.randint(0, vocab, (48,), generator=g).tolist()
    second = first[:32] + torch.randint(0, vocab, (12,), generator=g).tolist()
    return first, second


def warmed(arch: str) -> tuple[ModelDriver, list[int], list[int]]:
    """A driver whose tree holds ``first``; ``second`` shares its first 32 tokens."""
    d = driver(arch, page_size=16, concurrency=1)
    first, second = two_prompts(d.model.config.vocab_size)
    d.run_request(first)
    return d, first, second


@pytest.mark.parametrize("arch", ARCHS)
def test_negative_control_clean_run_passes(arch: str) -> None:
    d, _, second = warmed(arch)
    check = d.run_request(second)
    assert check.prefix_len == 32 and check.max_abs_diff < 1e-5


@pytest.mark.parametrize("arch", ARCHS)
def test_negative_control_one_corrupt_kv_slot_fails(arch: str) -> None:
    d, _, second = warmed(arch)
    m = d.cache.match_prefix(RadixKey(second[:-1]))
    assert m.prefix_len == 32
    slot = m.device_indices[20:21]
    k, v = d.pools.kv_pool.get_kv(0, slot)
    d.pools.kv_pool.set_kv(0, slot, k + 0.5, v + 0.5)
    with pytest.raises(AssertionError, match="cached prefix 32"):
        d.run_request(second)


@pytest.mark.parametrize("arch", HYBRID)
@pytest.mark.parametrize("how", ["conv", "ssm", "zeroed"])
def test_negative_control_one_corrupt_state_fails(arch: str, how: str) -> None:
    """One layer's conv or SSM state nudged by 0.1, or the whole slot zeroed (as if the
    matched state had not been copied into the request's slot)."""
    d, _, second = warmed(arch)
    m = d.cache.match_prefix(RadixKey(second[:-1]))
    assert m.prefix_len == 32 and m.state_slot is not None
    pool = d.pools.state_pool
    if how == "zeroed":
        pool.conv[:, m.state_slot] = 0
        pool.ssm[:, m.state_slot] = 0
    else:
        getattr(pool, how)[0, m.state_slot] += 0.1
    with pytest.raises(AssertionError, match="cached prefix 32"):
        d.run_request(second)


def test_negative_control_swa_slot_inside_the_window_fails_outside_does_not() -> None:
    d, _, second = warmed("qwen2_swa")
    m = d.cache.match_prefix(RadixKey(second[:-1]))
    assert m.prefix_len == 32
    swa, alloc = d.pools.swa_pool, d.pools.kv_allocator
    outside = alloc.translate(m.device_indices[17:18])  # live, but outside [21, 32)
    assert int(outside) != 0
    k, v = swa.get_kv(0, outside)
    swa.set_kv(0, outside, k + 0.5, v + 0.5)
    assert d.run_request(second).max_abs_diff < 1e-5
    inside = alloc.translate(m.device_indices[30:31])
    k, v = swa.get_kv(0, inside)
    swa.set_kv(0, inside, k + 0.5, v + 0.5)
    with pytest.raises(AssertionError, match="cached prefix 32"):
        d.run_request(second)


def test_swa_concurrent_chunked_prefill_keeps_its_window() -> None:
    # Regression: a running request keeps its own live SWA copies where the tree only holds a
    # tombstone another request locks, so its window survives cache_unfinished_req.
    d = driver("qwen2_swa", page_size=16, concurrency=2)
    report = d.run(tree_prompts(NUM_PROMPTS, vocab=d.model.config.vocab_size, seed=0))
    assert len(report.checks) == NUM_PROMPTS and report.max_abs_diff < 1e-5


def test_driver_config_is_validated() -> None:
    with pytest.raises(ValueError, match="unknown arch"):
        DriverConfig("jamba")
    with pytest.raises(ValueError, match="multiple of page_size"):
        DriverConfig("bamba", page_size=16, chunk_size=24)
    with pytest.raises(ValueError, match="concurrency"):
        DriverConfig("bamba", concurrency=0)


def test_tree_prompts_are_deterministic_and_share_prefixes() -> None:
    a, b = tree_prompts(20, vocab=64, seed=3), tree_prompts(20, vocab=64, seed=3)
    assert a == b and a != tree_prompts(20, vocab=64, seed=4)
    assert all(12 <= len(p) <= 96 and all(0 <= t < 64 for t in p) for p in a)
    shared = sum(any(q[:8] == p[:8] for q in a[:i]) for i, p in enumerate(a))
    assert shared >= 10
