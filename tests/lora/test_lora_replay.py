"""The replay with adapters: assignment, the LoRA scheduler's exact admissions (with and
without draining), namespaces seen by the cache, the host tier, and the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from allocators.lora import BASE_MODEL
from bench.engine.core import EngineConfig, ReplayEngine
from bench.lora.replay import REPLAY_BASE_MODULES, write_replay_adapters
from bench.lora.sched import (
    AdapterSkew,
    LoraReplayConfig,
    LoraScheduler,
    assign_adapters,
    parse_adapter_skew,
)
from bench.runs.replay import main
from bench.traces.loader import TraceRequest
from tests.helpers.replay_helpers import assert_usage_error


def req(t: float, out: int, first_block: int, n_blocks: int = 2, block: int = 4) -> TraceRequest:
    """A prompt of ``n_blocks`` blocks ``first_block, first_block+1, ...`` of ``block`` tokens."""
    ids = tuple(range(first_block, first_block + n_blocks))
    return TraceRequest(
        timestamp_s=t,
        input_length=n_blocks * block,
        output_length=out,
        block_size=block,
        block_ids=ids,
        runs=((first_block * block + 1, n_blocks * block),),
    )


@pytest.fixture(scope="module")
def adapter_files(tmp_path_factory) -> tuple[list[str], int]:
    pytest.importorskip("safetensors", reason="PEFT adapter directories are safetensors files")
    return write_replay_adapters(tmp_path_factory.mktemp("adapters"), 4, seed=0)


def run(trace, adapters, files, concurrency=4, **lora_kw):
    cfg = LoraReplayConfig(num_adapters=len(files[0]), decode_step_s=1.0, **lora_kw)
    engine = ReplayEngine(EngineConfig(kv_tokens=10_000, state_slots=0, concurrency=concurrency))
    sched = LoraScheduler(cfg, concurrency, files[0], REPLAY_BASE_MODULES, files[1])
    counters = sched.run(trace, adapters, engine)
    engine.cache.sanity_check()
    assert engine.cache.protected_size() == 0
    return counters, engine, sched


# ---------------------------------------------------------------------- assignment
def test_parse_adapter_skew() -> None:
    assert parse_adapter_skew("zipf:1.1") == AdapterSkew("zipf", 1.1)
    assert parse_adapter_skew(" uniform ") == AdapterSkew("uniform")
    for bad in ("zipf", "zipf:-1", "zipf:x", "uniform:2", "pareto:1", "zipf:nan"):
        with pytest.raises(ValueError, match="'uniform' or 'zipf:S'"):
            parse_adapter_skew(bad)
    p = AdapterSkew("zipf", 1.0).probabilities(4)
    assert p.sum() == pytest.approx(1.0) and p[0] == pytest.approx(2 * p[1])


def test_assignment_is_seeded_per_session_and_honours_the_base_fraction() -> None:
    trace = [req(i, 1, first_block=100 * (i % 5)) for i in range(40)]  # 5 sessions
    cfg = LoraReplayConfig(num_adapters=8, skew=AdapterSkew("uniform"), seed=3)
    got = assign_adapters(trace, cfg)
    assert got == assign_adapters(trace, cfg)  # deterministic
    for i in range(5, 40):
        assert got[i] == got[i % 5]  # a session keeps its adapter
    assert all(isinstance(a, int) and 0 <= a < 8 for a in got)
    all_base = LoraReplayConfig(num_adapters=8, base_fraction=1.0)
    assert set(assign_adapters(trace, all_base)) == {BASE_MODEL}
    zipf = LoraReplayConfig(num_adapters=8, skew=AdapterSkew("zipf", 2.0), seed=1)
    many = [req(i, 1, first_block=10 * i) for i in range(400)]  # 400 sessions
    counts = [assign_adapters(many, zipf).count(k) for k in range(8)]
    assert counts[0] > counts[1] > counts[7]


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="num_adapters must be >= 1"):
        LoraReplayConfig(num_adapters=0)
    with pytest.raises(ValueError, match="base_fraction must be in"):
        LoraReplayConfig(num_adapters=2, base_fraction=1.5)
    with pytest.raises(ValueError, match=r"max_loaded_loras \(2\) must be >= max_loras_per_batch"):
        LoraReplayConfig(num_adapters=2, max_loaded_loras=2)
    with pytest.raises(ValueError, match="lora_eviction_policy"):
        LoraReplayConfig(num_adapters=2, eviction_policy="mru")


# ---------------------------------------------------------------------- scheduling
# Two slots, adapters 0 1 2, decode step 1 s:
#   r0 t=0 adapter 0 out 2; r1 t=0 adapter 1 out 4; r2 t=0 adapter 2 out 1; r3 t=1 adapter 0 out 1
TRACE = [req(0, 2, 10), req(0, 4, 20), req(0, 1, 30), req(1, 1, 40)]
ADAPTERS = [0, 1, 2, 0]


def test_a_blocked_adapter_waits_for_a_slot_and_others_pass_it(adapter_files) -> None:
    c, _, sched = run(TRACE, ADAPTERS, adapter_files, max_loras_per_batch=2)
    # r2 needs a third adapter: it waits until adapter 0 drains naturally (t=2, r0 and r3
    # done); r3 joins the running adapter 0 at t=1 although r2 arrived first.
    assert c.waits_s == [0.0, 0.0, 0.0, 2.0]  # in admission order: r0 r1 r3 r2
    assert c.requests == 4 and c.slot_loads == 3 and c.slot_evictions == 1
    assert c.slot_hits == 1  # r3: adapter 0 was running
    assert c.drains == 0
    assert [u if u is None else u.name for u in sched.pool.slot_to_uid] == ["lora2", "lora1"]


def test_drain_stops_admissions_of_one_running_adapter(adapter_files) -> None:
    c, _, _ = run(TRACE, ADAPTERS, adapter_files, max_loras_per_batch=2, drain_wait_threshold_s=0.5)
    # t=1: r2 waited 1 s > 0.5 and cannot join -> adapter 0 (its requests end first, at t=2)
    # drains, so r3 (adapter 0) is held back. t=2: r2 is admitted (oldest), r3 no longer fits
    # (adapters 1 and 2 run) and starts at t=3 when r2 ends.
    assert c.drains == 1
    assert c.waits_s == [0.0, 0.0, 2.0, 2.0]  # r0 r1 r2 r3


def test_requests_of_different_adapters_never_share_prefixes(adapter_files) -> None:
    same = [req(0, 1, 50), req(5, 1, 50), req(10, 1, 50)]  # one prompt, three times
    _, engine, _ = run(same, [0, 0, 1], adapter_files)
    assert list(engine.log.usable_len) == [0, 7, 0]  # match prompt[:-1]; adapter 1: a miss
    _, engine, _ = run(same, [BASE_MODEL, 0, BASE_MODEL], adapter_files)
    assert list(engine.log.usable_len) == [0, 0, 7]


def test_host_tier_reload_gives_a_new_namespace(adapter_files) -> None:
    # Two host slots for four adapters (max_loaded_loras = max_loras_per_batch = 2).
    trace = [req(0, 1, 60), req(5, 1, 70), req(10, 1, 80), req(15, 1, 60)]
    c, engine, sched = run(
        trace, [0, 1, 2, 0], adapter_files, max_loras_per_batch=2, max_loaded_loras=2
    )
    # Adapter 2 evicts adapter 0 from the host tier; adapter 0 comes back as a new load.
    assert c.host_loads == 2
    assert sched.manager.uid_of("lora0").serial == 3
    assert list(engine.log.usable_len) == [0, 0, 0, 0]  # r3's prefix was under the old uid


# ---------------------------------------------------------------------- CLI
def test_cli_reports_both_policies(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = [
        {"timestamp": i // 4, "input_length": 1000, "output_length": 20 + i, "hash_ids": [0, 1 + i]}
        for i in range(24)
    ]  # 24 sessions (distinct second block), four arriving per second
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "r.json"
    argv = [
        "--trace", str(trace), "--adapters", "6", "--max-loras-per-batch", "2",
        "--concurrency", "4", "--policy", "lru", "--kv-tokens", "100K", "--state-slots", "16",
        "--no-progress", "--json", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "lru/lru" in table and "lru/fifo" in table and "adapter slot hit rate" in table
    data = json.loads(out.read_text())
    loras = [r["lora"] for r in data["runs"]]
    assert [x["eviction_policy"] for x in loras] == ["lru", "fifo"]
    assert all(x["requests"] == 24 and x["slot_evictions"] > 0 for x in loras)
    assert all(x["slot_loads"] == x["slot_evictions"] + 2 for x in loras)


@pytest.mark.parametrize(
    "bad",
    [
        ["--adapter-skew", "zipf:x"],
        ["--max-loaded-loras", "2"],
        ["--lora-eviction-policy", "mru"],
        ["--adapters", "-3"],
        ["--plot", "x.png"],
    ],
)
def test_cli_refuses_bad_lora_options(bad: list[str]) -> None:
    assert_usage_error(main, ["--max-requests", "1", "--adapters", "4", "--no-progress", *bad])


# ---------------------------------------------------------------------- real adapter directories
def _small_trace(tmp_path: Path) -> Path:
    rows = [
        {"timestamp": i // 4, "input_length": 1000, "output_length": 20 + i, "hash_ids": [0, 1 + i]}
        for i in range(16)
    ]
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return trace


def test_cli_serves_adapter_directories(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("safetensors", reason="PEFT adapter directories are safetensors files")
    from allocators.lora import LoraAdapter
    from radix.lora import write_peft_adapter

    gen = torch.Generator().manual_seed(0)

    def adapter(rank: int, modules: tuple[str, ...]) -> LoraAdapter:
        return LoraAdapter(
            {m: (torch.randn(rank, 16, generator=gen), torch.randn(24, rank, generator=gen))
             for m in modules}
        )  # fmt: skip

    q = ("model.layers.0.self_attn.q_proj",)
    qv = (*q, "model.layers.0.self_attn.v_proj")
    paths = [
        write_peft_adapter(tmp_path / "sql", adapter(8, q)),
        write_peft_adapter(tmp_path / "chat", adapter(16, qv)),
        write_peft_adapter(tmp_path / "code", adapter(4, qv)),
    ]
    entries = [f"sql={paths[0]}", json.dumps({"lora_name": "chat", "lora_path": str(paths[1])}),
               str(paths[2])]  # fmt: skip
    out = tmp_path / "r.json"
    argv = [
        "--trace", str(_small_trace(tmp_path)), "--adapters", *entries,
        "--max-loras-per-batch", "2", "--lora-eviction-policy", "lru", "--concurrency", "4",
        "--policy", "lru", "--kv-tokens", "100K", "--state-slots", "16", "--no-progress",
        "--json", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    assert "LoRA: 3 adapters, from their directories" in capsys.readouterr().out
    (run,) = json.loads(out.read_text())["runs"]
    lora = run["lora"]
    assert lora["adapters"] == "directories" and lora["num_adapters"] == 3
    assert lora["adapter_paths"] == [str(p) for p in paths] and lora["max_lora_rank"] == 16
    assert lora["requests"] == 16 and lora["slot_evictions"] > 0


def test_cli_refuses_adapter_directories_it_cannot_serve(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("safetensors", reason="PEFT adapter directories are safetensors files")
    from allocators.lora import LoraAdapter
    from radix.lora import write_peft_adapter

    trace = str(_small_trace(tmp_path))
    base = ["--trace", trace, "--no-progress", "--policy", "lru", "--kv-tokens", "100K"]
    assert_usage_error(main, [*base, "--adapters", str(tmp_path / "nowhere")])
    assert "LoRA adapter directory not found" in capsys.readouterr().err
    narrow = write_peft_adapter(tmp_path / "a", LoraAdapter({"q": (torch.ones(2, 8), torch.ones(8, 2))}))
    wide = write_peft_adapter(tmp_path / "b", LoraAdapter({"q": (torch.ones(2, 16), torch.ones(8, 2))}))
    assert main([*base, "--adapters", str(narrow), str(wide)]) == 2
    assert "has 'q' of (in, out) = (16, 8)" in capsys.readouterr().err
    (narrow / "adapter_config.json").write_text('{"peft_type": "IA3"}')
    assert main([*base, "--adapters", str(narrow)]) == 2
    assert "peft_type='IA3'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main([*base, "--adapters", json.dumps({"lora_name": "a", "lora_path": str(wide), "pinned": True})])
    assert exc.value.code == 2 and "pinning is not modelled" in capsys.readouterr().err
