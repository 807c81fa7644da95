"""LoraManager: adapter directories, inference of max_lora_rank / lora_target_modules, dynamic
load / unload / reload by name, and LoraAdapter's validation. Adapters are written to
``tmp_path`` as PEFT directories (``write_peft_adapter``; PEFT's own files are in
``tests/lora/test_lora_peft.py``)."""

from __future__ import annotations

import json

import pytest
import torch

from allocators.lora import (
    BASE_MODEL,
    LoraAdapter,
    LoraArgs,
    LoraFormatError,
    LoraManager,
    LoraUid,
    write_peft_adapter,
)
from tests.helpers.lora_refmodel import SHAPES, make_adapter


@pytest.fixture
def files(tmp_path):
    """``files(name, rank, modules) -> path`` of a freshly written adapter directory."""
    pytest.importorskip("safetensors", reason="PEFT adapter directories are safetensors files")
    gen = torch.Generator().manual_seed(0)

    def write(name: str, rank: int = 2, modules=("q_proj",), scaling: float = 0.5) -> str:
        path = tmp_path / f"{name}.pt"  # a directory, named like the files of old
        write_peft_adapter(path, make_adapter(gen, rank, tuple(modules), scaling))
        return str(path)

    return write


def manager(paths, **kw) -> LoraManager:
    m = LoraManager(LoraArgs(lora_paths=paths, **kw), SHAPES, dtype=torch.float64)
    m.pool.check()
    return m


# ---------------------------------------------------------------------- start-up
def test_three_forms_and_pins_from_lora_paths(files) -> None:
    pa, pb, pc = files("a"), files("b"), files("c")
    m = manager([pa, f"b={pb}", json.dumps({"lora_name": "c", "lora_path": pc, "pinned": True})])
    assert sorted(m.name_to_uid) == sorted([pa, "b", "c"])
    assert m.uid_of("b") == LoraUid("b", 1, m.pool.adapter(m.uid_of("b")).digest())
    assert m.path_of("b") == pb
    assert m.pool.is_pinned(m.uid_of("c")) and m.pool.is_resident(m.uid_of("c"))
    assert not m.pool.is_resident(m.uid_of("b"))


def test_rank_and_target_modules_are_inferred_from_the_initial_adapters(files) -> None:
    m = manager([f"a={files('a', 2, ['q_proj'])}", f"b={files('b', 3, ['v_proj'])}"])
    assert m.pool.max_lora_rank == 3
    assert sorted(m.pool.target_modules) == ["q_proj", "v_proj"]
    assert m.pool.A_buffer["v_proj"].shape == (8, 3, 8)  # [max_loras_per_batch, rank, in]
    with pytest.raises(
        ValueError, match=r"rank 4 > max_lora_rank=3; start with max_lora_rank >= 4"
    ):
        m.load_adapter("wide", files("wide", 4, ["q_proj"]))
    with pytest.raises(
        ValueError, match=r"targets \['o_proj'\], not in lora_target_modules=\['q_proj', 'v_proj'\]"
    ):
        m.load_adapter("o", files("o", 2, ["o_proj"]))
    assert sorted(m.name_to_uid) == ["a", "b"]
    m.pool.check()


def test_explicit_rank_and_all_modules_admit_later_adapters(files) -> None:
    m = manager([f"a={files('a')}"], max_lora_rank=4, lora_target_modules="all")
    assert sorted(m.pool.target_modules) == sorted(SHAPES)
    uid = m.load_adapter("wide", files("wide", 4, ["q_proj", "o_proj"]))
    batch = m.pool.prepare_batch([uid, m.uid_of("a"), BASE_MODEL])
    assert batch.loaded == (uid, m.uid_of("a"), BASE_MODEL)
    m.pool.check_weights()


def test_no_initial_adapters_needs_explicit_rank_and_modules(files) -> None:
    args = LoraArgs(enable_lora=True, max_lora_rank=2, lora_target_modules=["q_proj"])
    m = LoraManager(args, SHAPES)
    assert m.name_to_uid == {}
    uid = m.load_adapter("a", files("a"), pinned=True)
    assert m.pool.is_pinned(uid)
    with pytest.raises(ValueError, match="LoRA is disabled"):
        LoraManager(LoraArgs(), SHAPES)


def test_start_up_errors(files, tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="LoRA adapter directory not found: .*missing.pt"):
        manager([f"a={tmp_path / 'missing.pt'}"])
    with pytest.raises(
        ValueError,
        match=r"lora_target_modules names \['k_proj'\], which are not modules of the base model",
    ):
        manager([files("a")], lora_target_modules=["k_proj"])
    with pytest.raises(ValueError, match="rank 3 > max_lora_rank=2"):
        manager([files("a", 3)], max_lora_rank=2)
    with pytest.raises(TypeError, match="args must be LoraArgs"):
        LoraManager({"lora_paths": []}, SHAPES)
    with pytest.raises(ValueError, match="base_modules must name at least one module"):
        LoraManager(LoraArgs(lora_paths=[files("b")]), {})
    path = tmp_path / "k.pt"
    write_peft_adapter(path, LoraAdapter({"k_proj": (torch.ones(1, 8), torch.ones(4, 1))}))
    with pytest.raises(
        ValueError, match=r"targets \['k_proj'\], which are not modules of the base model"
    ):
        manager([str(path)])


# ---------------------------------------------------------------------- dynamic loading
def test_load_unload_reload_by_name(files) -> None:
    m = manager([f"a={files('a')}"], max_lora_rank=4, max_loras_per_batch=2)
    a0 = m.uid_of("a")
    m.pool.prepare_batch([a0])
    with pytest.raises(ValueError, match="'a' is already loaded .*use reload_adapter"):
        m.load_adapter("a", files("a2"))
    a1 = m.reload_adapter("a", files("a3", 4))
    assert a1 != a0 and a1.name == "a" and m.uid_of("a") == a1 and m.path_of("a").endswith("a3.pt")
    assert not m.pool.is_loaded(a0) and not m.pool.is_resident(a1)
    a2 = m.reload_adapter("a")  # same path again: still a new id
    assert a2 not in (a0, a1)
    assert m.unload_adapter("a") == a2
    with pytest.raises(ValueError, match=r"adapter 'a' is not loaded \(loaded: \[\]\)"):
        m.unload_adapter("a")
    a3 = m.load_adapter("a", files("a4"))
    assert a3.serial == 3
    m.pool.check()


def test_failed_loads_change_nothing(files, tmp_path) -> None:
    m = manager([f"a={files('a')}"], max_loras_per_batch=2, max_loaded_loras=2)
    m.load_adapter("b", files("b"))
    before = (dict(m.name_to_uid), m.pool.snapshot())
    with pytest.raises(ValueError, match="max_loaded_loras=2 adapters are loaded"):
        m.load_adapter("c", files("c"))
    with pytest.raises(FileNotFoundError, match="nope.pt"):
        m.load_adapter("d", tmp_path / "nope.pt")
    with pytest.raises(FileNotFoundError):
        m.reload_adapter("a", tmp_path / "nope.pt")
    junk = write_peft_adapter(tmp_path / "junk", make_adapter(torch.Generator(), 2, ("q_proj",)))
    (junk / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(LoraFormatError, match="junk.*not a readable safetensors file"):
        m.reload_adapter("a", junk)
    (tmp_path / "file.pt").write_bytes(b"a file, not a directory")
    with pytest.raises(LoraFormatError, match="file.pt' is not a directory"):
        m.reload_adapter("a", tmp_path / "file.pt")
    with pytest.raises(TypeError, match="path must be a str or path"):
        m.load_adapter("e", 3)
    with pytest.raises(TypeError, match="name must be a str"):
        m.load_adapter(None, files("e"))
    assert (dict(m.name_to_uid), m.pool.snapshot()) == before


def test_pin_and_unpin_by_name(files) -> None:
    m = manager([f"a={files('a')}", f"b={files('b')}"], max_loras_per_batch=2)
    m.pin_adapter("a")
    with pytest.raises(ValueError, match="max_loras_per_batch - 1 = 1"):
        m.pin_adapter("b")
    m.unpin_adapter("a")
    m.pin_adapter("b")
    # A pinned reload keeps its pin and counts once.
    b2 = m.reload_adapter("b")
    assert m.pool.is_pinned(b2) and m.pool.num_pinned == 1
    m.pool.check()


def test_overlap_loading_caps_and_fills(files) -> None:
    m = manager([f"a={files('a')}"], max_loras_per_batch=2, enable_lora_overlap_loading=True)
    assert m.pool.overlap_loading and m.pool.max_loaded_loras == 4
    for n in "bcd":
        m.load_adapter(n, files(n))
    with pytest.raises(ValueError, match="max_loaded_loras=4"):
        m.load_adapter("e", files("e"))
    m.pool.prepare_batch([m.uid_of("c"), m.uid_of("d")])
    m.pool.check_weights()


# ---------------------------------------------------------------------- adapters
@pytest.mark.parametrize(
    ("weights", "scaling", "exc", "msg"),
    [
        ({}, 1.0, ValueError, "at least one module"),
        (
            {"q": (torch.ones(2, 3), torch.ones(4, 3))},
            1.0,
            ValueError,
            r"A is \[rank, in\] and B is \[out, rank\]",
        ),
        ({"q": (torch.ones(2, 3), torch.ones(4, 2).double())}, 1.0, ValueError, "one dtype"),
        ({"q": (torch.ones(2, 3, 1), torch.ones(4, 2))}, 1.0, ValueError, "must be 2-D"),
        (
            {"q": (torch.ones(2, 3, dtype=torch.int64), torch.ones(4, 2))},
            1.0,
            TypeError,
            "floating point",
        ),
        ({"q": (torch.ones(2, 3),)}, 1.0, TypeError, r"must be a pair \(A, B\)"),
        (
            {"q": (torch.ones(2, 3), torch.ones(4, 2))},
            float("nan"),
            ValueError,
            "scaling must be finite",
        ),
        ({"q": (torch.ones(2, 3), torch.ones(4, 2))}, "1", TypeError, "scaling must be a float"),
        ([("q", None)], 1.0, TypeError, "weights must be a mapping"),
    ],
)
def test_adapter_validation(weights, scaling, exc, msg) -> None:
    with pytest.raises(exc, match=msg):
        LoraAdapter(weights, scaling)


def test_modules_may_have_their_own_rank() -> None:
    # PEFT's rank_pattern: ranks differ per module; the adapter's rank is the largest.
    a = LoraAdapter({"q": (torch.ones(2, 3), torch.ones(4, 2)), "v": (torch.ones(1, 3), torch.ones(4, 1))})
    assert a.rank == 2 and a.rank_of("v") == 1 and a.nbytes == 4 * (6 + 8 + 3 + 4)
