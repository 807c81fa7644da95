"""LoRA on ``embed_tokens`` and ``lm_head`` (SGLang's ``--lora-target-modules embed_tokens
lm_head``): a real adapter made by PEFT on the tiny Llama, read from its directory, slotted
into the pool, and applied with the pool's batched ``apply`` (the embedding as a lookup of
token ids), compared with PEFT's own forward; the slot tensors hold PEFT's tensors exactly.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import cast

import pytest
import torch

from allocators.lora import LoraAdapter, LoraMemoryPool
from radix.lora import read_peft_adapter, write_peft_adapter
from tests.helpers.lora_peft_helpers import (
    HIDDEN,
    LAYERS,
    batched_logits,
    manager_for,
    peft_logits,
    reference_logits,
    save_peft_adapter,
    skip_without_peft,
)

skip_without_peft()

VOCAB = 64
EMBED, HEAD = "model.embed_tokens", "lm_head"
# name -> PEFT LoraConfig keywords (init_lora_weights=False: B is not zero)
ADAPTERS = {
    "emb_head8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "embed_tokens", "lm_head"]),
    "emb4": dict(r=4, lora_alpha=4, target_modules=["embed_tokens", "v_proj"]),
    "head16": dict(r=16, lora_alpha=8, target_modules=["lm_head"], use_rslora=True),
}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("peft_emb")
    return {
        name: save_peft_adapter(root / name, 10 + seed, save_embedding_layers=False, **kw)
        for seed, (name, kw) in enumerate(ADAPTERS.items())
    }


@pytest.fixture(scope="module")
def input_ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (6, 9), generator=torch.Generator().manual_seed(11))


@pytest.fixture(scope="module")
def reference(dirs: dict[str, Path], input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    return reference_logits(dirs, input_ids)


def test_peft_tensors_are_read_and_slotted_with_sglang_shapes(dirs) -> None:
    from safetensors.torch import load_file

    raw = load_file(str(dirs["emb_head8"] / "adapter_model.safetensors"))
    adapter = read_peft_adapter(dirs["emb_head8"])
    assert adapter.embedding_modules == {EMBED}
    assert adapter.scaling == 2.0
    a, b = adapter.weights[EMBED]
    assert torch.equal(a, raw[f"base_model.model.{EMBED}.lora_embedding_A"])  # [r, vocab]
    assert torch.equal(b, raw[f"base_model.model.{EMBED}.lora_embedding_B"])  # [hidden, r]
    assert (tuple(a.shape), tuple(b.shape)) == ((8, VOCAB), (HIDDEN, 8))
    a, b = adapter.weights[HEAD]
    assert torch.equal(a, raw[f"base_model.model.{HEAD}.lora_A.weight"])  # [r, hidden]
    assert torch.equal(b, raw[f"base_model.model.{HEAD}.lora_B.weight"])  # [vocab, r]
    assert (tuple(a.shape), tuple(b.shape)) == ((8, HIDDEN), (VOCAB, 8))

    m = manager_for(dirs, ADAPTERS, max_loras_per_batch=4)
    assert {"embed_tokens", "lm_head", "q_proj", "v_proj"} == m.lora_target_modules
    pool = m.pool
    assert pool.target_modules[EMBED] == (VOCAB, HIDDEN)
    assert pool.target_modules[HEAD] == (HIDDEN, VOCAB)
    slot = pool.prepare_batch([m.uid_of("emb_head8")]).weight_indices[0].item()
    k, r = pool.slots.num_slots, m.max_lora_rank
    assert r == 16
    assert tuple(pool.slots.A_buffer[EMBED].shape) == (k, r, VOCAB)
    assert tuple(pool.slots.B_buffer[EMBED].shape) == (k, HIDDEN, r)
    assert tuple(pool.slots.A_buffer[HEAD].shape) == (k, r, HIDDEN)
    assert tuple(pool.slots.B_buffer[HEAD].shape) == (k, VOCAB, r)
    for module in (EMBED, HEAD):
        a, b = adapter.weights[module]
        assert torch.equal(pool.slots.A_buffer[module][slot, :8], a)
        assert torch.equal(pool.slots.B_buffer[module][slot, :, :8], b)
        assert not pool.slots.A_buffer[module][slot, 8:].any()
        assert not pool.slots.B_buffer[module][slot, :, 8:].any()
    pool.check_weights()


def test_embedding_lookup_is_the_one_hot_product(dirs) -> None:
    # The pool's lookup of token ids equals the linear LoRA of their one-hot rows, by hand.
    adapter = read_peft_adapter(dirs["emb4"])
    pool = LoraMemoryPool({EMBED: (VOCAB, HIDDEN)}, 8, 2)
    slot = pool.prepare_batch([pool.add_adapter("emb4", LoraAdapter(
        {EMBED: adapter.weights[EMBED]}, adapter.scaling, frozenset({EMBED})))]).weight_indices
    ids = torch.tensor([0, 5, 63, 5, 17])
    slots = slot.repeat(len(ids))
    a, b = adapter.weights[EMBED]
    one_hot = torch.nn.functional.one_hot(ids, VOCAB).to(torch.float32)
    by_hand = adapter.scaling * (one_hot @ a.T @ b.T)
    torch.testing.assert_close(pool.apply(EMBED, ids, slots), by_hand, rtol=0, atol=1e-6)
    torch.testing.assert_close(pool.apply(EMBED, one_hot, slots), by_hand, rtol=0, atol=1e-6)
    torch.testing.assert_close(adapter.delta(EMBED, ids), by_hand, rtol=0, atol=1e-6)


def test_one_batch_of_every_adapter_matches_peft(dirs, input_ids, reference) -> None:
    m = manager_for(dirs, ADAPTERS)
    rows = ["emb_head8", "base", "emb4", "head16", "emb_head8", "emb4"]
    got = batched_logits(m, rows, input_ids)
    worst = 0.0
    for i, name in enumerate(rows):
        torch.testing.assert_close(got[i], reference[name][i], msg=f"row {i} ({name})")
        worst = max(worst, (got[i] - reference[name][i]).abs().max().item())
        if name != "base":  # the adapter changes the output
            assert not torch.allclose(reference[name][i], reference["base"][i], atol=1e-3)
    assert worst < 2e-6, worst  # measured 2.4e-7 (float32)


def test_refills_under_eviction_and_merged_forward_agree(dirs, input_ids, reference) -> None:
    m = manager_for(dirs, ADAPTERS, max_loras_per_batch=2)
    for pair in [("emb_head8", "emb4"), ("head16", "base"), ("emb4", "emb_head8")]:
        rows = [pair[i % 2] for i in range(len(input_ids))]
        got = batched_logits(m, rows, input_ids)
        for i, name in enumerate(rows):
            torch.testing.assert_close(got[i], reference[name][i], msg=f"{pair} row {i}")
    got = batched_logits(m, ["emb_head8"] * len(input_ids), input_ids)
    torch.testing.assert_close(got, peft_logits(dirs["emb_head8"], input_ids, merged=True))


def test_written_back_peft_loads_it_and_the_reader_reads_it_bit_exact(
    dirs, tmp_path, input_ids, reference
) -> None:
    adapter = read_peft_adapter(dirs["emb_head8"])
    out = write_peft_adapter(tmp_path / "copy", adapter)
    again = read_peft_adapter(out)
    assert again.embedding_modules == adapter.embedding_modules
    assert again.digest() == adapter.digest()
    torch.testing.assert_close(peft_logits(out, input_ids), reference["emb_head8"])
    # The embedding kind is part of the content: the same tensors as a linear module differ.
    linear = LoraAdapter(dict(adapter.weights), adapter.scaling)
    assert linear.digest() != adapter.digest()


def test_target_modules_arguments(dirs) -> None:
    # Named explicitly, as SGLang's --lora-target-modules takes them.
    m = manager_for(dirs, ["emb4"], lora_target_modules=["embed_tokens", "lm_head", "v_proj"])
    assert set(m.pool.target_modules) == {EMBED, HEAD} | {
        f"model.layers.{i}.self_attn.v_proj" for i in range(LAYERS)
    }
    # 'all' covers embed_tokens and lm_head.
    m = manager_for(dirs, ["emb4"], lora_target_modules="all")
    assert {EMBED, HEAD} <= set(m.pool.target_modules)
    # Without them, an adapter targeting them is refused naming the argument; nothing changes.
    m = manager_for(dirs, ["emb4"], lora_target_modules=["embed_tokens", "v_proj"])
    before = (dict(m.name_to_uid), m.pool.snapshot())
    with pytest.raises(ValueError, match=r"targets \['lm_head', 'q_proj'\], not in "
                       r"lora_target_modules=.*start with lora_target_modules including them"):
        m.load_adapter("emb_head8", dirs["emb_head8"])
    assert (dict(m.name_to_uid), m.pool.snapshot()) == before


def test_added_tokens_of_the_base_vocabulary_are_accepted(dirs, tmp_path) -> None:
    # added_tokens.json copied from the base tokenizer (ids < vocab) adds nothing (SGLang).
    d = save_peft_adapter(tmp_path / "a", 3, r=4, target_modules=["embed_tokens"],
                          save_embedding_layers=False)
    (d / "added_tokens.json").write_text(json.dumps({"<s>": 1, "</s>": 2}))
    m = manager_for({"a": d}, ["a"])
    assert m.pool.target_modules == {EMBED: (VOCAB, HIDDEN)}
    with pytest.raises(ValueError, match=r"lora_added_tokens_size=2 .* base_vocab_size=None"):
        read_peft_adapter(d)  # without the base vocabulary every entry counts


def test_bad_token_ids_are_refused(dirs) -> None:
    m = manager_for(dirs, ["emb4"])
    slots = m.pool.prepare_batch([m.uid_of("emb4")]).weight_indices.repeat(2)
    with pytest.raises(ValueError, match=r"x \(token ids\) must lie in \[0, 64\)"):
        m.pool.apply(EMBED, torch.tensor([3, 64]), slots)
    with pytest.raises(TypeError, match=r"x must have dtype torch\.int64, got torch\.int32"):
        m.pool.apply(EMBED, torch.tensor([3, 4], dtype=torch.int32), slots)
    with pytest.raises(TypeError, match="base_vocab_size"):
        read_peft_adapter(m.path_of("emb4"), base_vocab_size=cast(int, "64"))
