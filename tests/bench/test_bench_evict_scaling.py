"""``python -m bench evict-scaling`` on a small tree: the tree it builds has exactly the
nodes the module describes, each ``evict(64)`` frees exactly 8 leaves of 8 tokens, and a
measurement that would evict more leaves than the tree has is refused; SGLang's side (when the
anchor venv is built and the SGLang-side bench script given) frees the same leaves, and without
the venv only ours runs."""

from __future__ import annotations

import json

import pytest

from bench.dev.compare import evict_scaling
from tests.helpers.sglang_anchor import anchor_missing


def sglang_side_missing() -> str | None:
    """Why SGLang's side cannot run here, or ``None``: the anchor venv, and the SGLang-side
    bench script (not part of this repository: ``HPC_SGLANG_ANCHOR_SCRIPT``)."""
    if (why := anchor_missing()) is not None:
        return why
    if not evict_scaling.DEFAULT_ANCHOR_SCRIPT:
        return ("no SGLang-side bench script (it is not part of this repository; set "
                "HPC_SGLANG_ANCHOR_SCRIPT to run this test)")
    return None


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


def test_refuses_a_measurement_larger_than_the_tree(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:  # an argument error, before any tree is built
        evict_scaling.main(["--nodes", "4000"])
    assert exc.value.code == 2
    assert "evicts about 4000 leaves" in capsys.readouterr().err


def test_leaf_tokens_are_the_tree_keys() -> None:
    """The formula the SGLang child repeats (``ANCHOR_CHILD``) is the one the tree is built from:
    leaf 130 of 8 tokens is prefix 130 mod 64 = 2, then 64 + 130 // 64 = 66, then 130 x 7."""
    assert evict_scaling.leaf_tokens(130, 8) == [2] * 16 + [66] + [130] * 7
    assert "[p] * prefix_len + [prefixes + i // prefixes] + [i] * (leaf_len - 1)" in (
        evict_scaling.ANCHOR_CHILD)


def test_without_the_anchor_only_ours_runs(capsys: pytest.CaptureFixture[str]) -> None:
    assert evict_scaling.main(["--nodes", "300", "--calls", "5", "--blocks", "3", "--sglang",
                               "radix", "--anchor-python", "/nonexistent/python"]) == 0
    out = capsys.readouterr()
    lines = [json.loads(x) for x in out.out.splitlines()]
    assert [x["impl"] for x in lines] == ["ours"]
    assert "SGLang anchor venv not found: /nonexistent/python" in out.err


@pytest.mark.skipif(sglang_side_missing() is not None, reason=str(sglang_side_missing()))
def test_sglang_side_frees_the_same_leaves(capsys: pytest.CaptureFixture[str]) -> None:
    """SGLang's caches on the same small tree free 8 whole leaves per ``evict(64)``, as ours;
    a size above ``--sglang-max-nodes`` runs ours only."""
    assert evict_scaling.main(["--nodes", "300", "400", "--calls", "5", "--blocks", "3",
                               "--sglang", "radix", "unified-rust",
                               "--sglang-max-nodes", "300"]) == 0
    out = capsys.readouterr()
    lines = [json.loads(x) for x in out.out.splitlines()]
    assert [(x["impl"], x["nodes"]) for x in lines] == [
        ("ours", 300), ("radix", 300), ("unified-rust", 300), ("ours", 400)]
    for x in lines:
        assert x["nodes_per_call"] == 8.0 and len(x["blocks_us_per_node"]) == 3
    assert lines[1]["ours_speedup"] == round(lines[1]["us_per_node"] / lines[0]["us_per_node"], 2)
    assert "at 400 leaves skipped" in out.err
