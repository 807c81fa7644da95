"""Real PEFT adapters, end to end: made by PEFT on a tiny Llama built from a config (no
download), saved by ``save_pretrained``, read by the library from their directories, slotted
into the pool, applied with the pool's batched ``apply`` (one forward, every row with its own
adapter) and compared with PEFT's own forward of each adapter, unmerged and merged.

The adapters cover ranks 8 / 16 / 64, several target-module sets (attention, MLP,
``all-linear``, some layers only), ``rank_pattern`` / ``alpha_pattern`` and rsLoRA.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from allocators.lora import LoraAdapter, leaf_name, linear_module_shapes
from radix.lora import LoraArgs, LoraManager, read_peft_adapter, write_peft_adapter
from tests.helpers.lora_peft_helpers import (
    ATTENTION,
    LAYERS,
    MLP,
    batched_logits,
    manager_for,
    peft_logits,
    reference_logits,
    save_peft_adapter,
    skip_without_peft,
    tiny_model,
)

skip_without_peft()

# name -> PEFT LoraConfig keywords (init_lora_weights=False: B is not zero)
ADAPTERS = {
    "qv8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "attn16": dict(r=16, lora_alpha=8, target_modules=list(ATTENTION), use_rslora=True),
    "mlp64": dict(r=64, lora_alpha=32, target_modules=list(MLP), layers_to_transform=[1]),
    "all8": dict(
        r=8,
        lora_alpha=8,
        target_modules="all-linear",
        rank_pattern={"o_proj": 4},
        alpha_pattern={"down_proj": 24},
    ),
    "pattern16": dict(
        r=16,
        lora_alpha=16,
        target_modules=["q_proj", "o_proj", "up_proj"],
        rank_pattern={"model.layers.1.self_attn.q_proj": 64},
    ),
}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("peft")
    return {
        name: save_peft_adapter(root / name, seed, **kw)
        for seed, (name, kw) in enumerate(ADAPTERS.items())
    }


@pytest.fixture(scope="module")
def input_ids() -> torch.Tensor:
    return torch.randint(0, 64, (6, 10), generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="module")
def reference(dirs: dict[str, Path], input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    return reference_logits(dirs, input_ids)


# ---------------------------------------------------------------------- forward vs PEFT
def test_one_batch_of_every_adapter_matches_peft(dirs, input_ids, reference) -> None:
    m = manager_for(dirs, ADAPTERS)
    rows = ["qv8", "attn16", "base", "mlp64", "all8", "pattern16"]
    got = batched_logits(m, rows, input_ids)
    for i, name in enumerate(rows):
        torch.testing.assert_close(got[i], reference[name][i], msg=f"row {i} ({name})")
    # Each adapter changes the output (the comparison is not base model vs base model).
    for i, name in enumerate(rows):
        if name != "base":
            assert not torch.allclose(reference[name][i], reference["base"][i], atol=1e-3)


def test_slot_refills_under_eviction_match_peft(dirs, input_ids, reference) -> None:
    # Two slots for five adapters: every batch evicts, each fill must hold exactly its adapter.
    m = manager_for(dirs, ADAPTERS, max_loras_per_batch=2)
    for pair in [("qv8", "attn16"), ("mlp64", "base"), ("all8", "qv8"), ("pattern16", "mlp64")]:
        rows = [pair[i % 2] for i in range(len(input_ids))]
        got = batched_logits(m, rows, input_ids)
        for i, name in enumerate(rows):
            torch.testing.assert_close(got[i], reference[name][i], msg=f"{pair} row {i}")
    assert m.pool.eviction_count == 6


@pytest.mark.parametrize("name", ["qv8", "all8"])
def test_peft_merged_forward_agrees(dirs, input_ids, name) -> None:
    m = manager_for(dirs, [name])
    got = batched_logits(m, [name] * len(input_ids), input_ids)
    torch.testing.assert_close(got, peft_logits(dirs[name], input_ids, merged=True))


# ---------------------------------------------------------------------- what is read
def test_adapters_read_from_peft_directories(dirs) -> None:
    qv8 = read_peft_adapter(dirs["qv8"])
    assert qv8.rank == 8 and qv8.scaling == 16 / 8 and qv8.dtype == torch.float32
    assert sorted(qv8.modules) == sorted(
        f"model.layers.{i}.self_attn.{p}" for i in range(LAYERS) for p in ("q_proj", "v_proj")
    )
    assert qv8.nbytes == LAYERS * 4 * 8 * (32 + 32 + 32 + 16)  # q: 32 -> 32, v: 32 -> 16
    attn16 = read_peft_adapter(dirs["attn16"])
    assert attn16.scaling == 8 / 16**0.5  # rsLoRA
    mlp64 = read_peft_adapter(dirs["mlp64"])
    assert {leaf_name(p) for p in mlp64.modules} == set(MLP)
    assert all(p.startswith("model.layers.1.") for p in mlp64.modules)  # layers_to_transform
    # Per-module ranks and alphas: the scalings differ, so they are folded into B.
    all8 = read_peft_adapter(dirs["all8"])
    assert len(all8.modules) == LAYERS * 7 and all8.scaling == 1.0 and all8.rank == 8
    assert all8.rank_of("model.layers.0.self_attn.o_proj") == 4
    pattern16 = read_peft_adapter(dirs["pattern16"])
    assert pattern16.rank == 64 and pattern16.rank_of("model.layers.0.self_attn.q_proj") == 16


def test_all_linear_written_as_a_string_is_read(dirs, tmp_path, input_ids, reference) -> None:
    # PEFT saves "all-linear" resolved to module paths; an adapter whose config still says
    # "all-linear" (older tools, hand-edited) selects every linear module all the same.
    d = tmp_path / "all8"
    d.mkdir()
    for f in dirs["all8"].iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((d / "adapter_config.json").read_text())
    cfg["target_modules"] = "all-linear"
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    m = LoraManager(LoraArgs(lora_paths=[f"all8={d}"]), linear_module_shapes(tiny_model()))
    got = batched_logits(m, ["all8"] * len(input_ids), input_ids)
    torch.testing.assert_close(got, reference["all8"])


# ---------------------------------------------------------------------- inference
def test_inferred_rank_and_target_modules_of_a_mixed_set(tmp_path) -> None:
    made = {
        "qv8": dict(r=8, target_modules=["q_proj", "v_proj"]),
        "o16": dict(r=16, target_modules=["o_proj"]),
        "up64": dict(r=64, target_modules=["up_proj"], layers_to_transform=[0]),
    }
    dirs = {n: save_peft_adapter(tmp_path / n, i, **kw) for i, (n, kw) in enumerate(made.items())}
    m = manager_for(dirs, made)
    assert m.max_lora_rank == m.pool.max_lora_rank == 64
    assert sorted(m.lora_target_modules) == ["o_proj", "q_proj", "up_proj", "v_proj"]
    # Every layer gets a buffer for each name, although up64 only touched layer 0.
    assert sorted(m.pool.target_modules) == sorted(
        f"model.layers.{i}.{p}"
        for i in range(LAYERS)
        for p in ("self_attn.q_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.up_proj")
    )
    assert m.pool.A_buffer["model.layers.1.mlp.up_proj"].shape == (8, 64, 32)
    assert m.pool.B_buffer["model.layers.1.self_attn.v_proj"].shape == (8, 16, 64)


def test_later_loads_beyond_the_inferred_shapes_are_refused(dirs, tmp_path) -> None:
    m = manager_for(dirs, ["qv8"])
    assert m.max_lora_rank == 8 and sorted(m.lora_target_modules) == ["q_proj", "v_proj"]
    before = (dict(m.name_to_uid), m.pool.snapshot())
    wide = save_peft_adapter(tmp_path / "q16", 9, r=16, target_modules=["q_proj"])
    with pytest.raises(ValueError, match=r"rank 16 > max_lora_rank=8; start with max_lora_rank >= 16"):
        m.load_adapter("q16", wide)
    with pytest.raises(
        ValueError,
        match=r"targets \['k_proj', 'o_proj'\], not in lora_target_modules=\['q_proj', 'v_proj'\]",
    ):
        m.load_adapter("attn16", dirs["attn16"])
    assert (dict(m.name_to_uid), m.pool.snapshot()) == before
    # Given explicitly, both admit what comes later.
    m = manager_for(dirs, ["qv8"], max_lora_rank=64, lora_target_modules="all")
    uid = m.load_adapter("all8", dirs["all8"])
    assert m.pool.prepare_batch([uid]).loaded == (uid,)


# ---------------------------------------------------------------------- the library's writer
def test_written_directories_are_read_by_peft_and_back_bit_exact(tmp_path) -> None:
    shapes = linear_module_shapes(tiny_model())
    gen = torch.Generator().manual_seed(3)
    ranks = {"model.layers.0.self_attn.q_proj": 8, "model.layers.1.mlp.down_proj": 16}
    weights = {
        p: (torch.randn(r, shapes[p][0], generator=gen), torch.randn(shapes[p][1], r, generator=gen))
        for p, r in ranks.items()
    }
    adapter = LoraAdapter(weights, scaling=0.75)
    d = write_peft_adapter(tmp_path / "mine", adapter)
    back = read_peft_adapter(d)
    assert back.scaling == 0.75 and back.modules == adapter.modules
    for p, (a, b) in adapter.weights.items():
        assert torch.equal(back.weights[p][0], a) and torch.equal(back.weights[p][1], b)
    ids = torch.randint(0, 64, (2, 5), generator=gen)
    m = LoraManager(LoraArgs(lora_paths=[f"mine={d}"]), shapes)
    torch.testing.assert_close(batched_logits(m, ["mine", "mine"], ids), peft_logits(d, ids))


# ---------------------------------------------------------------------- the load benchmark
def test_load_benchmark_rows(tmp_path) -> None:
    from bench.dev.lora.load import measure

    rows = measure(hidden=64, layers=1, ranks=[8], repeats=1, workdir=tmp_path)
    assert [(r["rank"], r["targets"], r["modules"]) for r in rows] == [
        (8, "q,v", 2),
        (8, "attention", 4),
        (8, "all-linear", 7),
    ]
    # q and v: 64 -> 64 (one head, one KV head, of 64): 8 * (64 + 64) float32 each
    assert rows[0]["host_bytes"] == 2 * 8 * (64 + 64) * 4
    assert all(r["file_bytes"] > r["host_bytes"] for r in rows)  # + header and config
    assert all(r[k] >= 0 for r in rows for k in ("read_s", "load_s", "fill_s"))


# ---------------------------------------------------------------------- seeded round trips
def test_random_adapters_round_trip_through_the_writer_and_reader(tmp_path) -> None:
    # Random module subsets of the tiny model, a rank per module, a scaling: what is written
    # is read back bit for bit, with the scaling kept (per-module ranks go to rank_pattern /
    # alpha_pattern, whose alpha / r equals the scaling again).
    shapes = linear_module_shapes(tiny_model())
    paths = sorted(shapes)
    gen = torch.Generator().manual_seed(11)
    for trial in range(20):
        chosen = [p for p in paths if torch.rand(1, generator=gen).item() < 0.4] or [paths[0]]
        weights = {}
        for p in chosen:
            r = int(torch.randint(1, 65, (1,), generator=gen))
            weights[p] = (
                torch.randn(r, shapes[p][0], generator=gen, dtype=torch.bfloat16),
                torch.randn(shapes[p][1], r, generator=gen, dtype=torch.bfloat16),
            )
        scaling = float(torch.rand(1, generator=gen)) * 4 + 0.1
        adapter = LoraAdapter(weights, scaling)
        back = read_peft_adapter(write_peft_adapter(tmp_path / f"a{trial}", adapter))
        assert back.modules == adapter.modules and back.dtype == torch.bfloat16
        assert back.scaling == pytest.approx(scaling, rel=1e-12)
        for p, (a, b) in adapter.weights.items():
            assert torch.equal(back.weights[p][0], a) and torch.equal(back.weights[p][1], b), p
