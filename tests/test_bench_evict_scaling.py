"""``python -m bench evict-scaling`` on a small tree: the tree it builds has exactly the
nodes the module describes, each ``evict(64)`` frees exactly 8 leaves of 8 tokens, and a
measurement that would evict more leaves than the tree has is refused."""

from __future__ import annotations

import json

import pytest

from bench.compare import evict_scaling


def test_small_run_frees_whole_leaves(capsys: pytest.CaptureFixture[str]) -> None:
    assert evict_scaling.main(["--nodes", "300", "--calls", "5", "--blocks", "3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["nodes"] == 300 and out["tree_nodes"] == 64 + 300  # 64 prefixes + the leaves
    assert out["nodes_per_call"] == 8.0  # 64 tokens asked, leaves of 8
    assert len(out["blocks_us_per_node"]) == 3 and out["us_per_node"] > 0


def test_tree_layout() -> None:
    cache, kv = evict_scaling.build_tree(130, 4, "lru")
    assert cache.core.tree.num_nodes == 64 + 130
    assert cache.total_size() == kv.used_size() == 64 * 16 + 130 * 4
    assert kv.available_size() == 0  # the pool is sized to the tree
    cache.sanity_check()


def test_refuses_a_measurement_larger_than_the_tree() -> None:
    with pytest.raises(SystemExit, match="evicts about 4000 leaves"):
        evict_scaling.main(["--nodes", "4000"])
