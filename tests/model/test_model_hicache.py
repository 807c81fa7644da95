"""End to end with HiCache (the library's host tier): cached prefixes that were demoted to host
memory and loaded back give the logits of a full forward; corrupting the host copy of one KV
slot or one state makes the check fail (so the data really travels through host memory).

Skipped without the optional extra (``pip install -e .[model]``).
"""

from __future__ import annotations

import pytest
import torch

from bench.dev.model import MIN_TRANSFORMERS

pytest.importorskip("transformers", minversion=MIN_TRANSFORMERS,
                    reason="model tests need the optional extra: pip install -e .[model]")

from bench.dev.model.driver import ModelDriver, tree_prompts  # noqa: E402
from hicache import HiCacheConfig  # noqa: E402
from radix import MatchResult, RadixKey  # noqa: E402
from tests.helpers.model_helpers import (  # noqa: E402, F401  (one_thread: autouse fixture)
    HYBRID,
    NUM_PROMPTS,
    KnownLibraryBug,
    assert_idle_and_leak_free,
    driver,
    known_bug,
    one_thread,
)


def hicache(policy: str) -> HiCacheConfig:
    return HiCacheConfig(hicache_ratio=4.0, hicache_write_policy=policy)


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
@pytest.mark.parametrize("arch", HYBRID)
def test_prefixes_loaded_back_from_host_match_a_full_forward(arch: str, policy: str,
                                                             record_property) -> None:
    d = driver(arch, page_size=16, hicache=hicache(policy))
    report = d.run(tree_prompts(NUM_PROMPTS, vocab=d.model.config.vocab_size, seed=0))
    record_property("max_abs_diff", report.max_abs_diff)
    assert len(report.checks) == NUM_PROMPTS and report.max_abs_diff < 1e-5
    st = report.cache_stats
    assert st["demoted_tokens"] > 0 and report.loaded_back_tokens >= 32
    assert_idle_and_leak_free(d)


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_page_1_run_keeps_revived_host_nodes_slots(policy: str) -> None:
    # Regression: the request helpers no longer free slots the tree took over host-only nodes.
    d = driver("bamba", page_size=1, hicache=hicache(policy))
    report = d.run(tree_prompts(NUM_PROMPTS, vocab=d.model.config.vocab_size, seed=0))
    assert len(report.checks) == NUM_PROMPTS and report.max_abs_diff < 1e-5
    assert_idle_and_leak_free(d)


# ====================================================================== one round trip
def on_host(arch: str, page_size: int) -> tuple[ModelDriver, list[int], MatchResult]:
    """``first`` (48 tokens) served and backed up, then every device copy evicted: the tree
    holds it on host only. Returns the driver, ``second`` (sharing 32 tokens) and its match."""
    d = driver(arch, page_size, concurrency=1, hicache=hicache("write_through"))
    g = torch.Generator().manual_seed(7)
    first = torch.randint(0, 256, (48,), generator=g).tolist()
    second = first[:32] + torch.randint(0, 256, (12,), generator=g).tolist()
    d.run_request(first)
    d.cache.evict(d.cache.total_size())
    assert d.cache.total_size() == 0 and d.cache.host_size() == 48
    m = d.cache.match_prefix(RadixKey(second[:-1]))
    assert (m.prefix_len, m.host_hit_length) == (0, 32)
    return d, second, m


def host_slots(m: MatchResult) -> torch.Tensor:
    path, n = [], m.last_host_node
    while n is not None and n.parent is not None:
        path.append(n.host_value)
        n = n.parent
    return torch.cat(path[::-1])


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("arch", HYBRID)
def test_one_host_round_trip_resumes_exactly(arch: str, page_size: int) -> None:
    d, second, _ = on_host(arch, page_size)
    check = d.run_request(second)
    assert check.prefix_len == 32 and check.max_abs_diff < 1e-5
    assert d.report.loaded_back_tokens == 32
    assert_idle_and_leak_free(d)


@pytest.mark.parametrize("arch", HYBRID)
def test_negative_control_one_corrupt_host_kv_slot_fails(arch: str) -> None:
    d, second, m = on_host(arch, 16)
    host = d.cache.hicache.host_kv.pool
    slot = host_slots(m)[20:21]
    k, v = host.get_kv(0, slot)
    host.set_kv(0, slot, k + 0.5, v + 0.5)
    with pytest.raises(AssertionError, match="cached prefix 32"):
        d.run_request(second)


@pytest.mark.parametrize("arch", HYBRID)
def test_negative_control_one_corrupt_host_state_fails(arch: str) -> None:
    d, second, m = on_host(arch, 16)
    slot = m.last_host_node.host_state_slot
    assert slot is not None
    d.cache.hicache.host_state.ssm[0, slot] += 0.1
    with pytest.raises(AssertionError, match="cached prefix 32"):
        d.run_request(second)
