"""Helpers for the tests on real PEFT adapters: a tiny Llama built from a config (no
download), adapters made and saved by PEFT itself, and a forward through the library's pool.

``peft`` and ``transformers`` are imported inside the functions: the test modules that use
these helpers skip themselves first when the packages are missing (:func:`skip_without_peft`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from allocators.lora import BASE_MODEL, LoraMemoryPool, linear_module_shapes
from radix.lora import LoraArgs, LoraManager

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded, ever

LAYERS = 2
HIDDEN = 32
INTERMEDIATE = 48
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def skip_without_peft() -> None:
    """Skip the calling test module (at its import) unless PEFT, transformers and safetensors
    are installed: the adapters are made by PEFT, on a transformers model, saved as
    safetensors."""
    pytest.importorskip("peft", reason="PEFT adapters are made with PEFT")
    pytest.importorskip("transformers", reason="PEFT adapters are made on a transformers model")
    pytest.importorskip("safetensors", reason="PEFT adapter directories are safetensors files")


def tiny_model(seed: int = 0, hidden: int = HIDDEN) -> Any:
    """A 2-layer Llama (vocab 64, hidden ``hidden``, 4 heads of 8, 2 KV heads), float32, with
    weights drawn from ``seed``: the same seed gives the same model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=hidden,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=64,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def save_peft_adapter(
    directory: Path,
    seed: int,
    *,
    method: str = "LoraConfig",
    hidden: int = HIDDEN,
    safe_serialization: bool = True,
    save_embedding_layers: bool | str = "auto",
    **config: Any,
) -> Path:
    """An adapter made by PEFT on :func:`tiny_model` (``hidden`` wide) and written by PEFT's
    ``save_pretrained``. ``method`` is the PEFT config class (``LoraConfig`` by default, with
    ``init_lora_weights=False`` so that ``B`` is not zero; ``IA3Config``, ``LoHaConfig``...).
    ``save_embedding_layers``: PEFT's argument (its ``"auto"`` saves the base embedding and
    output layers beside ``embed_tokens`` / ``lm_head`` LoRA)."""
    import peft

    if method == "LoraConfig":
        config.setdefault("init_lora_weights", False)
    model = tiny_model(hidden=hidden)
    torch.manual_seed(1000 + seed)
    peft_model = peft.get_peft_model(model, getattr(peft, method)(**config))
    peft_model.save_pretrained(
        str(directory),
        safe_serialization=safe_serialization,
        save_embedding_layers=save_embedding_layers,
    )
    return directory


def peft_logits(directory: Path, input_ids: torch.Tensor, *, merged: bool = False) -> torch.Tensor:
    """PEFT's own forward of :func:`tiny_model` with the adapter in ``directory``; with
    ``merged``, the forward of the model PEFT merged the adapter into."""
    from peft import PeftModel

    model = PeftModel.from_pretrained(tiny_model(), str(directory)).eval()
    if merged:
        model = model.merge_and_unload()
    with torch.no_grad():
        return model(input_ids).logits


@contextmanager
def pool_forward(model: Any, pool: LoraMemoryPool, row_slots: torch.Tensor) -> Iterator[None]:
    """Add ``pool.apply`` to every target module of ``model`` while the block runs.

    ``row_slots``: ``[batch]`` slot of each row (from ``prepare_batch``); every token of a row
    uses its row's slot. An embedding module gets its token ids (``[batch, seq]`` int64).
    """
    modules = dict(model.named_modules())
    handles = []

    def hook_for(path: str) -> Any:
        def hook(_module: Any, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> Any:
            x = inputs[0]
            slots = row_slots.repeat_interleave(x.shape[1])
            flat = x.reshape(-1) if x.dim() == 2 else x.reshape(-1, x.shape[-1])
            delta = pool.apply(path, flat, slots)
            return output + delta.reshape(output.shape)

        return hook

    for path in pool.target_modules:
        handles.append(modules[path].register_forward_hook(hook_for(path)))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def reference_logits(dirs: dict[str, Path], input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """PEFT's logits of every adapter in ``dirs`` (name -> directory) and of the base model
    (``"base"``) on every row of ``input_ids``: the oracle of the pool's batched forward."""
    with torch.no_grad():
        out = {"base": tiny_model()(input_ids).logits}
    out.update({name: peft_logits(d, input_ids) for name, d in dirs.items()})
    return out


def manager_for(dirs: dict[str, Path], names: Iterable[str], **kw: Any) -> LoraManager:
    """A :class:`LoraManager` over :func:`tiny_model`'s linear layers serving the adapters
    ``names`` of ``dirs`` (``kw``: more ``LoraArgs``); its pool checked."""
    args = LoraArgs(lora_paths=[f"{n}={dirs[n]}" for n in names], **kw)
    m = LoraManager(args, linear_module_shapes(tiny_model()))
    m.pool.check()
    return m


def batched_logits(m: LoraManager, rows: list[str], input_ids: torch.Tensor) -> torch.Tensor:
    """One forward of the base model with the pool's LoRA, row ``i`` running ``rows[i]`` (an
    adapter name, or ``"base"``); the pool and its slot weights checked first."""
    uids = [BASE_MODEL if n == "base" else m.uid_of(n) for n in rows]
    batch = m.pool.prepare_batch(uids)
    m.pool.check()
    m.pool.check_weights()
    model = tiny_model()
    with torch.no_grad(), pool_forward(model, m.pool, batch.weight_indices):
        return model(input_ids).logits
