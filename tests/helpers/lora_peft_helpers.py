"""Helpers for the tests on real PEFT adapters: a tiny Llama built from a config (no
download), adapters made and saved by PEFT itself, and a forward through the library's pool.

``peft`` and ``transformers`` are imported inside the functions: the test modules that use
these helpers skip themselves first when the packages are missing.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from allocators.lora import LoraMemoryPool

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded, ever

LAYERS = 2
HIDDEN = 32
INTERMEDIATE = 48
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


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
