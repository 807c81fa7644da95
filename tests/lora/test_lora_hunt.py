"""Regression tests from a bug hunt over the LoRA pool and the PEFT reader (one per bug).

Every expected value is computed here from the file's own tensors, not by the library.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from allocators.lora import LoraAdapter
from radix.lora import LoraArgs, LoraFormatError, LoraManager, write_peft_adapter
from tests.helpers.lora_refmodel import SHAPES, make_adapter

F8 = torch.float8_e4m3fn


def _fp8_directory(tmp_path: Path, name: str) -> tuple[str, dict[str, torch.Tensor]]:
    """A PEFT directory whose tensors are float8 (e4m3fn); returns it and its tensors."""
    st = pytest.importorskip("safetensors.torch")
    gen = torch.Generator().manual_seed(5)
    d = write_peft_adapter(tmp_path / name, make_adapter(gen, 2, ("q_proj",), 0.5, torch.float32))
    weights = d / "adapter_model.safetensors"
    tensors = {k: v.to(F8) for k, v in st.load_file(str(weights)).items()}
    st.save_file(tensors, str(weights))
    return str(d), tensors


def test_a_float8_adapter_file_loads_with_its_exact_values(tmp_path: Path) -> None:
    # Before: torch.isfinite has no float8 kernel on the CPU, so reading an fp8 adapter
    # raised NotImplementedError (neither loaded nor refused as a format error).
    path, tensors = _fp8_directory(tmp_path, "f8")
    m = LoraManager(LoraArgs(lora_paths=[f"f8={path}"], max_loras_per_batch=2), SHAPES,
                    dtype=torch.float32)
    uid = m.uid_of("f8")
    batch = m.pool.prepare_batch([uid])
    slot = batch.uid_to_slot[uid]
    a = tensors["base_model.model.q_proj.lora_A.weight"].to(torch.float32)  # [2, 8]
    b = tensors["base_model.model.q_proj.lora_B.weight"].to(torch.float32)  # [6, 2]
    assert torch.equal(m.pool.A_buffer["q_proj"][slot], a)  # rank 2 == max_lora_rank 2
    assert torch.equal(m.pool.B_buffer["q_proj"][slot], b)
    assert float(m.pool.scaling[slot]) == 0.5
    m.pool.check()
    m.pool.check_weights()


def test_a_float8_adapter_with_a_nan_is_refused_as_a_format_error(tmp_path: Path) -> None:
    st = pytest.importorskip("safetensors.torch")
    path, tensors = _fp8_directory(tmp_path, "f8nan")
    key = "base_model.model.q_proj.lora_B.weight"
    bad = tensors[key].to(torch.float32)
    bad[1, 0] = float("nan")
    tensors[key] = bad.to(F8)
    st.save_file(tensors, str(Path(path) / "adapter_model.safetensors"))
    gen = torch.Generator().manual_seed(1)
    ok = write_peft_adapter(tmp_path / "ok", make_adapter(gen, 2, ("q_proj",)))
    m = LoraManager(LoraArgs(lora_paths=[f"ok={ok}"], max_loras_per_batch=2), SHAPES)
    before = (dict(m.name_to_uid), m.pool.snapshot())
    with pytest.raises(LoraFormatError, match=r"weights\['q_proj'\].B must be finite, got 1 NaN"):
        m.load_adapter("f8nan", path)
    assert (dict(m.name_to_uid), m.pool.snapshot()) == before


def test_lora_adapter_checks_float8_weights_for_nan() -> None:
    a = torch.ones(2, 8).to(F8)
    b = torch.full((6, 2), float("nan")).to(F8)
    with pytest.raises(ValueError, match=r"weights\['q_proj'\].B must be finite, got 12 NaN"):
        LoraAdapter({"q_proj": (a, b)})
    assert LoraAdapter({"q_proj": (a, torch.ones(6, 2).to(F8))}).rank == 2


def test_apply_refuses_a_module_of_the_wrong_type_with_type_error() -> None:
    # Before: ValueError ("module must be one of ..."), as for an unknown name.
    from allocators.lora import LoraMemoryPool

    pool = LoraMemoryPool(SHAPES, 2, 2, dtype=torch.float64)
    x = torch.zeros(1, 8, dtype=torch.float64)
    i = torch.zeros(1, dtype=torch.int64)
    for bad in (1, None, b"q_proj"):
        with pytest.raises(TypeError, match="module must be a str"):
            pool.apply(bad, x, i)
    with pytest.raises(ValueError, match="module must be one of"):
        pool.apply("k_proj", x, i)


@pytest.mark.parametrize("names", [[3], ["q_proj", None], ("q_proj", 1.5)])
def test_lora_target_modules_with_a_non_str_name_is_a_type_error(names: list) -> None:
    # Before: ValueError ("must be 'all' or non-empty names"), as for an empty name.
    with pytest.raises(TypeError, match=r"lora_target_modules\[\d\] must be a str"):
        LoraArgs(lora_paths=["a=/x"], lora_target_modules=names)
    with pytest.raises(ValueError, match="non-empty names"):
        LoraArgs(lora_paths=["a=/x"], lora_target_modules=["q_proj", " "])
