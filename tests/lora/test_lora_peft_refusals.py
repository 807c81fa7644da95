"""Adapter directories that cannot be served, each refused with the file and the field (or
tensor) in the message, and nothing changed: bad directories made by PEFT itself (other PEFT
methods, DoRA, saved modules, biases, embedding LoRA saved with the base layers, added
tokens, a pickle file), configs edited to
contradict their tensors, shapes that do not fit the base model, broken files."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from allocators.lora import LoraAdapter, linear_module_shapes
from radix.lora import LoraArgs, LoraFormatError, LoraManager, read_peft_adapter, write_peft_adapter
from tests.helpers.lora_peft_helpers import save_peft_adapter, skip_without_peft, tiny_model

skip_without_peft()

CFG = r"adapter_config\.json'"
WTS = r"adapter_model\.safetensors'"
Q0 = "model.layers.0.self_attn.q_proj"


def add_tokens(d: Path, tokens: dict[str, int]) -> Path:
    (d / "added_tokens.json").write_text(json.dumps(tokens))
    return d


def edit_config(d: Path, **fields: object) -> Path:
    cfg = json.loads((d / "adapter_config.json").read_text())
    cfg.update(fields)
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    return d


def qv8(d: Path) -> Path:
    return save_peft_adapter(d, 0, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])


def drop_key(d: Path, key: str) -> Path:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(d / "adapter_model.safetensors"))
    del tensors[key]
    save_file(tensors, str(d / "adapter_model.safetensors"))
    return d


# name -> (make the directory, expected error, regex of the message)
CASES: dict[str, tuple[Callable[[Path], Path], type[Exception], str]] = {
    "config missing": (
        lambda d: (qv8(d) / "adapter_config.json").unlink() or d,
        LoraFormatError,
        r"is not a PEFT adapter directory: adapter_config\.json is missing",
    ),
    "pickle weights only": (
        lambda d: save_peft_adapter(d, 0, r=8, target_modules=["q_proj"], safe_serialization=False),
        LoraFormatError,
        r"adapter_model\.safetensors is missing; adapter_model\.bin is a pickle file, which is "
        r"never loaded",
    ),
    "IA3": (
        lambda d: save_peft_adapter(
            d, 0, method="IA3Config", target_modules=["v_proj", "down_proj"],
            feedforward_modules=["down_proj"],
        ),
        LoraFormatError,
        CFG + r": peft_type='IA3': only LoRA adapters \(peft_type 'LORA'\) can be served",
    ),
    "LoHa": (
        lambda d: save_peft_adapter(d, 0, method="LoHaConfig", r=4, target_modules=["q_proj"]),
        LoraFormatError,
        CFG + r": peft_type='LOHA': only LoRA adapters",
    ),
    "DoRA": (
        lambda d: save_peft_adapter(d, 0, r=8, target_modules=["q_proj"], use_dora=True),
        LoraFormatError,
        CFG + r": use_dora=True: DoRA adapters are not supported \(plain LoRA only\)",
    ),
    "modules_to_save": (
        lambda d: save_peft_adapter(d, 0, r=8, target_modules=["q_proj"], modules_to_save=["lm_head"]),
        LoraFormatError,
        CFG + r": modules_to_save=\['lm_head'\]: whole copies of base modules are not served",
    ),
    "trained bias": (
        lambda d: save_peft_adapter(d, 0, r=8, target_modules=["q_proj"], bias="lora_only"),
        LoraFormatError,
        CFG + r": bias='lora_only': trained biases are not served",
    ),
    "embedding LoRA saved with the base layers": (
        lambda d: save_peft_adapter(d, 0, r=8, target_modules=["embed_tokens"]),
        LoraFormatError,
        WTS + r": tensor 'base_model\.model\.model\.embed_tokens\.base_layer\.weight' is a "
        r"weight of the base model saved with the adapter \(for embed_tokens / lm_head LoRA, "
        r"save it with save_pretrained\(\.\.\., save_embedding_layers=False\)\)",
    ),
    "added tokens (extra vocabulary)": (
        lambda d: add_tokens(
            save_peft_adapter(d, 0, r=8, target_modules=["embed_tokens"], save_embedding_layers=False),
            {"<think>": 64, "</think>": 65, "<base>": 3},
        ),
        LoraFormatError,
        r"added_tokens\.json': lora_added_tokens_size=2 \(tokens \['</think>', '<think>'\] with "
        r"ids >= base_vocab_size=64\): adapters that add tokens to the vocabulary are not served",
    ),
    "an embedding of a larger vocabulary": (
        lambda d: write_peft_adapter(
            d,
            LoraAdapter({"model.embed_tokens": (torch.ones(2, 70), torch.ones(32, 2))},
                        embedding_modules=frozenset({"model.embed_tokens"})),
        ),
        ValueError,
        r"'model\.embed_tokens' has lora_A \[2, 70\] / lora_B \[32, 2\], which do not fit the "
        r"base model's module \(in_features=64, out_features=32\)",
    ),
    "r contradicts the tensors": (
        lambda d: edit_config(qv8(d), r=4),
        LoraFormatError,
        CFG + r": r=4, but '.*" + WTS + rf" holds '{Q0}' with rank 8",
    ),
    "rank_pattern contradicts the tensors": (
        lambda d: edit_config(qv8(d), rank_pattern={"v_proj": 2}),
        LoraFormatError,
        CFG + r": rank_pattern\['v_proj'\]=2, but .* holds 'model\.layers\.0\.self_attn\.v_proj' "
        r"with rank 8",
    ),
    "target_modules contradicts the tensors": (
        lambda d: edit_config(qv8(d), target_modules=["q_proj"]),
        LoraFormatError,
        CFG + r": target_modules=\['q_proj'\] \(exclude_modules=None\) does not select "
        r"'model\.layers\.0\.self_attn\.v_proj', but .*" + WTS + " holds its weights",
    ),
    "exclude_modules contradicts the tensors": (
        lambda d: edit_config(qv8(d), exclude_modules=r".*layers\.1\..*"),
        LoraFormatError,
        r"does not select 'model\.layers\.1\.self_attn\.q_proj'",
    ),
    "lora_B missing": (
        lambda d: drop_key(qv8(d), f"base_model.model.{Q0}.lora_B.weight"),
        LoraFormatError,
        WTS + rf": tensor base_model\.model\.{Q0}\.lora_B\.weight is missing",
    ),
    "broken safetensors": (
        lambda d: (qv8(d) / "adapter_model.safetensors").write_bytes(b"\x08\x00junk") and d,
        LoraFormatError,
        WTS + r": not a readable safetensors file",
    ),
    "invalid JSON": (
        lambda d: (qv8(d) / "adapter_config.json").write_text("{r: 8") and d,
        LoraFormatError,
        CFG + r": not valid JSON",
    ),
    "rank not an integer": (
        lambda d: edit_config(qv8(d), r="eight"),
        LoraFormatError,
        CFG + r": r='eight': the rank must be an integer >= 1",
    ),
    "alpha missing": (
        lambda d: edit_config(qv8(d), lora_alpha=None),
        LoraFormatError,
        CFG + r": lora_alpha=None: must be a finite number",
    ),
    "shapes do not fit the base model": (
        lambda d: save_peft_adapter(d, 0, r=8, target_modules=["q_proj"], hidden=48),
        ValueError,
        rf"adapter '\w+' \('.*'\): '{Q0}' has lora_A \[8, 48\] / lora_B \[48, 8\], which do not "
        r"fit the base model's module \(in_features=32, out_features=32\)",
    ),
    "a module the base model lacks": (
        lambda d: write_peft_adapter(
            d, LoraAdapter({"model.layers.5.self_attn.q_proj": (torch.ones(2, 32), torch.ones(32, 2))})
        ),
        ValueError,
        r"adapter '\w+' targets \['model\.layers\.5\.self_attn\.q_proj'\], which are not "
        r"modules of the base model \(\['lm_head', 'model\.embed_tokens', .* and 8 more\)",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_refused_with_the_file_and_field_and_nothing_changes(case: str, tmp_path: Path) -> None:
    make, exc, pattern = CASES[case]
    good = qv8(tmp_path / "good")
    m = LoraManager(LoraArgs(lora_paths=[f"good={good}"], max_lora_rank=8, lora_target_modules="all"),
                    linear_module_shapes(tiny_model()))  # fmt: skip
    m.pool.prepare_batch([m.uid_of("good")])
    before = (dict(m.name_to_uid), m.pool.snapshot())
    bad = make(tmp_path / "bad")
    with pytest.raises(exc, match=pattern):
        m.load_adapter("bad", bad)
    with pytest.raises(exc, match=pattern):
        m.reload_adapter("good", bad)
    assert (dict(m.name_to_uid), m.pool.snapshot()) == before
    m.pool.check()
    m.pool.check_weights()
    with pytest.raises(exc, match=pattern):  # and at start-up
        LoraManager(LoraArgs(lora_paths=[f"bad={bad}"]), linear_module_shapes(tiny_model()))


def test_format_errors_come_from_the_reader_itself(tmp_path: Path) -> None:
    with pytest.raises(LoraFormatError, match=r"peft_type='IA3'"):
        read_peft_adapter(CASES["IA3"][0](tmp_path / "ia3"))
    with pytest.raises(FileNotFoundError, match="LoRA adapter directory not found"):
        read_peft_adapter(tmp_path / "nowhere")
    with pytest.raises(TypeError, match="lora_path must be a str or path"):
        read_peft_adapter(3)
    assert issubclass(LoraFormatError, ValueError)
