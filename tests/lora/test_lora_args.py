"""``lora_paths`` in its three forms, malformed entries, and the other serving arguments."""

from __future__ import annotations

import pytest

from allocators.lora import (
    LoraArgs,
    LoraPathSpec,
    effective_max_loaded_loras,
    parse_lora_path,
    parse_lora_paths,
)


# ---------------------------------------------------------------------- the three forms
def test_path_form_uses_the_path_as_name() -> None:
    assert parse_lora_path("/models/sql-lora") == LoraPathSpec(
        "/models/sql-lora", "/models/sql-lora"
    )
    assert parse_lora_path("  rel/dir  ") == LoraPathSpec("rel/dir", "rel/dir")


def test_name_equals_path_form_splits_at_the_first_equals() -> None:
    assert parse_lora_path("sql=/models/sql") == LoraPathSpec("sql", "/models/sql")
    assert parse_lora_path("a = /p=q") == LoraPathSpec("a", "/p=q")


def test_json_form_text_and_mapping() -> None:
    text = '{"lora_name": "sql", "lora_path": "/m/sql", "pinned": true}'
    assert parse_lora_path(text) == LoraPathSpec("sql", "/m/sql", True)
    assert parse_lora_path({"lora_name": "x", "lora_path": "/p"}) == LoraPathSpec("x", "/p", False)
    spec = LoraPathSpec("y", "/q", True)
    assert parse_lora_path(spec) == spec


def test_parse_lora_paths_mixed_forms() -> None:
    specs = parse_lora_paths(
        ["/a", "b=/b", '{"lora_name": "c", "lora_path": "/c", "pinned": true}']
    )
    assert specs == (
        LoraPathSpec("/a", "/a"),
        LoraPathSpec("b", "/b"),
        LoraPathSpec("c", "/c", True),
    )
    assert parse_lora_paths([]) == ()


# ---------------------------------------------------------------------- malformed
@pytest.mark.parametrize(
    ("entry", "exc", "msg"),
    [
        ("", ValueError, "is empty"),
        ("   ", ValueError, "is empty"),
        ("=/p", ValueError, "needs both a name and a path"),
        ("name=", ValueError, "needs both a name and a path"),
        ('{"lora_name": "a", "lora_path": ', ValueError, "invalid JSON"),
        ('{"lora_name": "a"}', ValueError, r"missing keys \['lora_path'\]"),
        (
            '{"lora_name": "a", "lora_path": "/p", "rank": 8}',
            ValueError,
            r"unknown keys \['rank'\]",
        ),
        (
            '{"lora_name": "a", "lora_path": "/p", "pinned": "yes"}',
            TypeError,
            "pinned must be a bool",
        ),
        ('{"lora_name": 3, "lora_path": "/p"}', TypeError, "lora_name must be a str"),
        ('{"lora_name": " ", "lora_path": "/p"}', ValueError, "lora_name must not be empty"),
        (42, TypeError, "must be a str or mapping"),
        (None, TypeError, "must be a str or mapping"),
    ],
)
def test_malformed_entries_raise_with_the_entry_named(entry, exc, msg) -> None:
    with pytest.raises(exc, match=msg):
        parse_lora_path(entry, "lora_paths[3]")
    with pytest.raises(exc, match=r"lora_paths\[0\]"):
        parse_lora_paths([entry])


def test_only_text_starting_with_a_brace_is_json() -> None:
    assert parse_lora_path("[1, 2]") == LoraPathSpec("[1, 2]", "[1, 2]")  # a (strange) path
    with pytest.raises(ValueError, match="invalid JSON"):
        parse_lora_path("{[1]}")


def test_lora_paths_container_and_duplicates() -> None:
    with pytest.raises(TypeError, match="lora_paths must be a list"):
        parse_lora_paths("a=/p")
    with pytest.raises(
        ValueError, match=r"lora_paths\[1\]: adapter name 'a' already used by lora_paths\[0\]"
    ):
        parse_lora_paths(["a=/p", "a=/q"])


# ---------------------------------------------------------------------- LoraArgs
def test_defaults_follow_sglang() -> None:
    args = LoraArgs(lora_paths=["a=/p"])
    assert args.enable_lora is True
    assert args.max_loras_per_batch == 8
    assert args.lora_eviction_policy == "lru"
    assert args.max_loaded_loras is None
    assert args.lora_drain_wait_threshold == 0.0
    assert args.lora_paths == (LoraPathSpec("a", "/p"),)
    assert LoraArgs().enable_lora is False


def test_target_modules_forms() -> None:
    assert LoraArgs(lora_paths=["/p"], lora_target_modules="all").lora_target_modules == "all"
    assert LoraArgs(lora_paths=["/p"], lora_target_modules=["all"]).lora_target_modules == "all"
    got = LoraArgs(lora_paths=["/p"], lora_target_modules=["q_proj", "v_proj"])
    assert got.lora_target_modules == frozenset({"q_proj", "v_proj"})
    with pytest.raises(ValueError, match="'all' cannot be combined"):
        LoraArgs(lora_paths=["/p"], lora_target_modules=["all", "q_proj"])
    with pytest.raises(ValueError, match="lora_target_modules must be 'all' or non-empty"):
        LoraArgs(lora_paths=["/p"], lora_target_modules=[])
    with pytest.raises(TypeError, match="lora_target_modules must be 'all' or a list"):
        LoraArgs(lora_paths=["/p"], lora_target_modules=3)


def test_all_linear_is_taken_as_all_as_sglang_does() -> None:
    assert LoraArgs(lora_paths=["/p"], lora_target_modules="all-linear").lora_target_modules == "all"
    with pytest.raises(ValueError, match="'all' cannot be combined"):
        LoraArgs(lora_paths=["/p"], lora_target_modules=["all-linear", "q_proj"])


@pytest.mark.parametrize(
    ("kwargs", "exc", "msg"),
    [
        ({"lora_paths": ["/p"], "enable_lora": False}, ValueError, "enable_lora=False"),
        ({"enable_lora": True}, ValueError, "give max_lora_rank and lora_target_modules"),
        ({"enable_lora": True, "max_lora_rank": 8}, ValueError, "lora_target_modules"),
        (
            {"lora_paths": ["/p"], "max_loras_per_batch": 0},
            ValueError,
            "max_loras_per_batch must be >= 1",
        ),
        (
            {"lora_paths": ["/p"], "max_loras_per_batch": 2.0},
            TypeError,
            "max_loras_per_batch must be an int",
        ),
        (
            {"lora_paths": ["/p"], "max_loaded_loras": 4},
            ValueError,
            r"max_loaded_loras \(4\) must be >= max_loras_per_batch \(8\)",
        ),
        (
            {"lora_paths": ["/p"], "lora_eviction_policy": "mru"},
            ValueError,
            "lora_eviction_policy must be one of",
        ),
        ({"lora_paths": ["/p"], "max_lora_rank": 0}, ValueError, "max_lora_rank must be >= 1"),
        (
            {"lora_paths": ["/p"], "lora_drain_wait_threshold": -1},
            ValueError,
            "lora_drain_wait_threshold must be finite and >= 0",
        ),
        ({"lora_paths": ["/p"], "lora_drain_wait_threshold": "1s"}, TypeError, "number of seconds"),
        (
            {"lora_paths": ["/p"], "enable_lora_overlap_loading": 1},
            TypeError,
            "enable_lora_overlap_loading must be a bool",
        ),
        (
            {"lora_paths": ["a=/p", "b=/q"], "max_loras_per_batch": 1, "max_loaded_loras": 1},
            ValueError,
            r"lists 2 adapters > max_loaded_loras=1",
        ),
        (
            {
                "lora_paths": [{"lora_name": n, "lora_path": "/p", "pinned": True} for n in "ab"],
                "max_loras_per_batch": 2,
            },
            ValueError,
            r"pins 2 adapters > max_loras_per_batch - 1 = 1",
        ),
        ({"lora_paths": "a=/p"}, TypeError, "lora_paths must be a list"),
    ],
)
def test_bad_arguments_are_named(kwargs, exc, msg) -> None:
    with pytest.raises(exc, match=msg):
        LoraArgs(**kwargs)


def test_no_paths_needs_rank_and_modules_explicitly() -> None:
    args = LoraArgs(enable_lora=True, max_lora_rank=16, lora_target_modules="all")
    assert args.lora_paths == () and args.max_lora_rank == 16


def test_overlap_loading_caps_max_loaded_loras_at_twice_the_slots() -> None:
    assert LoraArgs(lora_paths=["/p"], enable_lora_overlap_loading=True).max_loaded_loras == 16
    ok = LoraArgs(
        lora_paths=["/p"],
        max_loras_per_batch=4,
        max_loaded_loras=8,
        enable_lora_overlap_loading=True,
    )
    assert ok.max_loaded_loras == 8
    with pytest.raises(
        ValueError,
        match=r"must be <= 2 \* max_loras_per_batch \(8\) with enable_lora_overlap_loading",
    ):
        LoraArgs(
            lora_paths=["/p"],
            max_loras_per_batch=4,
            max_loaded_loras=9,
            enable_lora_overlap_loading=True,
        )
    assert effective_max_loaded_loras(4, None, False) is None
    assert effective_max_loaded_loras(4, 100, False) == 100
    with pytest.raises(TypeError, match="max_loaded_loras must be an int"):
        effective_max_loaded_loras(4, "8", False)
