"""No library module reads another object's private attributes across modules.

A leading underscore is private to its module (Python's convention): every ``x._name`` in the
library (``radix``, ``components``, ``allocators``, ``hicache``, ``bench``, developer
instruments included) has

* ``x`` = ``self`` or ``cls``, ``super()``, a class defined in the same module, or an imported
  module (``torch._C._nn``: a module's own namespace, another matter); or
* ``_name`` defined by a class of the same module (``out._ids`` in ``radix.tree``, where
  ``RadixKey`` builds ``out``: the module's own private, read on another instance); or
* ``_name`` one of :data:`THIRD_PARTY`: torch's private tensor fields that have no public
  accessor, each with its reason. The test checks that no library class defines one of those
  names, so the allowance can only ever cover torch's.

Counted with ``ast``, so a comment or a string never counts. ``getattr(x, "_name")`` is not
seen (none in the library: the last test checks that too).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("radix", "components", "allocators", "hicache", "bench")

#: torch's private tensor fields the library reads, and why (no public accessor).
THIRD_PARTY = {
    "_base": "torch.Tensor._base: the tensor a view was made from (a host mirror follows "
             "views of a mirrored tensor to it; the simulated device tracks views)",
    "_version": "torch.Tensor._version: the in-place write counter (a host mirror is stale "
                "once its device tensor was written)",
}


def library_files() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def class_privates(tree: ast.AST) -> set[str]:
    """Private names a class of the module defines: methods, class attributes, ``__slots__``
    entries and ``self._x`` / ``cls._x`` assignments."""
    out: set[str] = set()
    for c in ast.walk(tree):
        if not isinstance(c, ast.ClassDef):
            continue
        for n in ast.walk(c):
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef):
                out.add(n.name)
            elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and isinstance(
                    n.value, ast.Name) and n.value.id in ("self", "cls"):
                out.add(n.attr)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                out.add(n.id)
            elif isinstance(n, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == "__slots__" for t in n.targets):
                out |= {e.value for e in ast.walk(n.value)
                        if isinstance(e, ast.Constant) and isinstance(e.value, str)}
    return {n for n in out if n.startswith("_") and not n.startswith("__")}


def private_reads(source: str) -> list[str]:
    """``x._attr`` occurrences the module rule above does not allow (``self.cache._empty``
    counts: the cache's private, unless this module's classes define ``_empty``)."""
    tree = ast.parse(source)
    own = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    modules: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            modules |= {(a.asname or a.name).split(".")[0] for a in n.names}
    defined = class_privates(tree)
    out = []
    for n in ast.walk(tree):
        if not (isinstance(n, ast.Attribute) and n.attr.startswith("_")
                and not n.attr.startswith("__")):
            continue
        v = n.value
        if isinstance(v, ast.Name) and v.id in {"self", "cls"} | own:
            continue
        if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "super":
            continue
        if _is_module_chain(v, modules):
            continue
        if n.attr in defined or n.attr in THIRD_PARTY:
            continue
        out.append(f"{ast.unparse(v)}.{n.attr} (line {n.lineno})")
    return out


def _is_module_chain(node: ast.expr, modules: set[str]) -> bool:
    """``torch._C._nn`` / ``torch.Tensor``: a dotted chain of names from an imported module."""
    while isinstance(node, ast.Attribute):
        node = node.value
    return isinstance(node, ast.Name) and node.id in modules


def test_the_counter_sees_a_private_read_and_ignores_self_modules_and_own_privates() -> None:
    src = ("import torch\nclass A:\n    def __init__(self):\n        self._mine = 0\n"
           "    def f(self, cache, other):\n"
           "        return (self._x, cache._empty, torch._C._nn, A._y, self.cache._cat,\n"
           "                other._mine, super()._z(), other._base)\n")
    assert sorted(private_reads(src)) == ["cache._empty (line 6)", "self.cache._cat (line 6)"]


def test_no_library_module_reads_another_modules_privates() -> None:
    found = {str(f.relative_to(ROOT)): private_reads(f.read_text()) for f in library_files()}
    assert {f: r for f, r in found.items() if r} == {}


def test_the_third_party_allowance_names_nothing_the_library_defines() -> None:
    mine = {f: class_privates(ast.parse(f.read_text())) & set(THIRD_PARTY)
            for f in library_files()}
    assert {str(f.relative_to(ROOT)): d for f, d in mine.items() if d} == {}


def test_no_private_name_is_read_through_getattr() -> None:
    hits = []
    for f in library_files():
        for n in ast.walk(ast.parse(f.read_text())):
            if (isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                    and n.func.id in ("getattr", "hasattr") and len(n.args) >= 2
                    and isinstance(n.args[1], ast.Constant) and isinstance(n.args[1].value, str)
                    and n.args[1].value.startswith("_") and not n.args[1].value.startswith("__")):
                hits.append(f"{f.relative_to(ROOT)}:{n.lineno} {ast.unparse(n)}")
    assert hits == []
