"""One tenant in the tree is one tenant in L3: ``radix.tree.namespace_key`` (the tree's typed
namespace) and ``hicache.storage.keys.encode_namespace`` (L3's) agree, and a namespace L3
cannot encode unambiguously is not stored there at all (a miss, never another tenant's data).

* Frozen dataclasses: the tree tells types apart by identity; L3, shared between processes,
  can only name a type by ``module.qualname``. So L3 stores a dataclass namespace only when
  that name leads back to the very type (a class defined at module level, in a module still
  loaded): two factory-made types of one name (``<locals>``), and the old class of a reloaded
  module, are two tenants in the tree and never stored.
* ``IntEnum`` members (and other ``int`` subclasses except ``bool``) are their integer value,
  ``StrEnum`` members their string, in the tree and in L3 alike: ``Color.RED`` and ``1`` are one
  tenant, as Python's ``==`` and ``hash`` say. ``bool`` stays apart from ``int``.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import sys
from typing import Any

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from allocators.lora import LoraMemoryPool
from allocators.lora.identity import LoraUid
from hicache.storage.keys import encode_namespace
from radix.tree import namespace_key
from tests.helpers.lora_refmodel import SHAPES, make_adapter
from tests.storage.test_storage_common import L3, WAIT_S, fresh_model, make, put_random


def factory() -> type:
    @dataclasses.dataclass(frozen=True)
    class Tenant:
        name: str

    return Tenant


TenantA, TenantB = factory(), factory()  # same module, same qualname, two types


@dataclasses.dataclass(frozen=True)
class Canonical:
    """A module-level namespace type: its name leads back to it."""

    name: str


class Color(enum.IntEnum):
    RED = 1
    GREEN = 2


class Word(enum.StrEnum):
    HELLO = "hello"


KEY = [900 + i for i in range(16)]


def engines(tmp_path: Any, caches: list[L3]) -> tuple[L3, L3]:
    where, model = str(tmp_path / "l3"), fresh_model()
    a = make("file", where=where, model=model)
    b = make("file", where=where, model=model)
    caches += [a, b]
    return a, b


def served(b: L3, ns: Any) -> int:
    """Tokens of ``KEY`` engine ``b`` (empty) is served under ``ns`` (wait_complete)."""
    m = b.cache.match_prefix(KEY + [1], ns)
    b.cache.sanity_check()
    return int(m.prefix_len + m.host_hit_length)


def test_factory_made_types_of_one_name_are_two_tenants_and_never_stored(
        tmp_path: Any, caches: list[L3]) -> None:
    ns_a, ns_b = TenantA("x"), TenantB("x")
    assert type(ns_a).__qualname__ == type(ns_b).__qualname__
    assert namespace_key(ns_a) != namespace_key(ns_b)  # two tenants in the tree
    a, b = engines(tmp_path, caches)
    put_random(a, KEY, torch.Generator().manual_seed(1), extra_key=ns_a)
    assert a.cache.match_prefix(KEY, ns_b).kv_hit_length == 0
    assert a.cache.flush_storage(WAIT_S)
    assert served(b, ns_b) == 0  # tenant B is never served tenant A's tokens
    assert served(b, ns_a) == 0  # nor A its own: not stored, a miss
    st_a = a.cache.stats()
    assert st_a["l3_backup_written"] == 0 and st_a["l3_unkeyable"] > 0
    assert encode_namespace(ns_a) is None and encode_namespace(ns_b) is None


def test_the_old_class_of_a_reloaded_module_is_not_stored(tmp_path: Any, caches: list[L3],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "ns_reload_mod.py").write_text(
        "import dataclasses\n\n@dataclasses.dataclass(frozen=True)\nclass Ns:\n    name: str\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    mod = importlib.import_module("ns_reload_mod")
    try:
        old = mod.Ns("x")
        assert encode_namespace(old) is not None  # canonical until the reload
        mod = importlib.reload(mod)
        new = mod.Ns("x")
        assert type(old) is not type(new)
        assert namespace_key(old) != namespace_key(new)
        assert encode_namespace(old) is None  # its name now leads to the new class
        assert encode_namespace(new) is not None
        a, b = engines(tmp_path, caches)
        put_random(a, KEY, torch.Generator().manual_seed(2), extra_key=old)
        assert a.cache.flush_storage(WAIT_S)
        assert served(b, new) == 0
    finally:
        sys.modules.pop("ns_reload_mod", None)


def test_module_level_dataclasses_are_still_shared_through_l3(tmp_path: Any,
                                                              caches: list[L3]) -> None:
    a, b = engines(tmp_path, caches)
    for i, ns in enumerate((Canonical("x"), LoraUid("adapter-1", 1))):
        key = [k + 100 * i for k in KEY]
        put_random(a, key, torch.Generator().manual_seed(3 + i), extra_key=ns)
        assert a.cache.flush_storage(WAIT_S)
        m = b.cache.match_prefix(key + [1], ns)
        assert m.host_hit_length == 16, ns
    assert served(b, Canonical("y")) == 0


def test_int_and_str_enum_members_are_their_values_in_the_tree_and_in_l3(
        tmp_path: Any, caches: list[L3]) -> None:
    assert namespace_key(Color.RED) == namespace_key(1)
    assert encode_namespace(Color.RED) == encode_namespace(1)
    assert namespace_key(Word.HELLO) == namespace_key("hello")
    assert encode_namespace(Word.HELLO) == encode_namespace("hello")
    assert namespace_key(True) != namespace_key(1)
    assert encode_namespace(True) != encode_namespace(1)
    a, b = engines(tmp_path, caches)
    put_random(a, KEY, torch.Generator().manual_seed(4), extra_key=Color.RED)
    assert a.cache.match_prefix(KEY, 1).prefix_len == 16  # one tenant in the tree
    assert a.cache.flush_storage(WAIT_S)
    assert served(b, 1) == 16  # and in L3
    assert served(b, Color.GREEN) == 0 and served(b, True) == 0


# ---------------------------------------------------------------- agreement property
class Plain:  # hashable by identity: refused as a namespace (no value to compare)
    pass


_PLAIN = Plain()
ATOMS = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 3), st.sampled_from(list(Color)),
    st.sampled_from(["", "a", "1", "hello"]), st.sampled_from(list(Word)),
    st.sampled_from([b"", b"a"]), st.sampled_from([0.0, -0.0, 1.0, float("nan")]),
    st.sampled_from([Canonical("a"), Canonical("1"), TenantA("a"), TenantB("a"),
                     LoraUid("a", 1)]),
)
NAMESPACES = st.recursive(ATOMS, lambda inner: st.lists(inner, max_size=3).map(tuple),
                          max_leaves=6)


@settings(max_examples=400, deadline=None)
@given(NAMESPACES, NAMESPACES)
@example(TenantA("a"), TenantB("a"))
@example((TenantA("a"), 1), (TenantB("a"), 1))
@example(Color.RED, 1)
@example(True, 1)
def test_the_tree_and_l3_agree_on_what_is_one_tenant(a: Any, b: Any) -> None:
    ea, eb = encode_namespace(a), encode_namespace(b)
    same_tree = namespace_key(a) == namespace_key(b)
    if ea is not None and eb is not None:
        assert (ea == eb) == same_tree, (a, b)
    if same_tree:  # one tenant: both storable or neither, with one encoding
        assert ea == eb, (a, b)


def test_a_different_adapter_under_a_reused_name_and_serial_is_never_served_the_old_pages(
        tmp_path: Any, caches: list[L3]) -> None:
    """Engine ``a`` stores pages under its first adapter ``a`` (serial 0); engine ``b`` (a
    restart on the same store) loads different weights under the same name, serial 0 again:
    0 tokens served. The same weights are served all 16. Before: 16 served either way."""
    old = make_adapter(torch.Generator().manual_seed(21), 2)
    new = make_adapter(torch.Generator().manual_seed(22), 2)

    def uid_of(adapter: Any) -> LoraUid:
        return LoraMemoryPool(SHAPES, 4, 2, dtype=torch.float64).add_adapter("a", adapter)

    a, b = engines(tmp_path, caches)
    put_random(a, KEY, torch.Generator().manual_seed(5), extra_key=uid_of(old))
    assert a.cache.flush_storage(WAIT_S)
    assert uid_of(new).serial == uid_of(old).serial == 0
    assert served(b, uid_of(new)) == 0
    assert served(b, uid_of(old)) == 16
