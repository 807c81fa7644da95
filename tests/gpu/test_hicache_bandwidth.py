"""``python -m bench hicache-bandwidth`` on the simulated device: one record per backend /
layout / node size with the fields a GPU run reports; the counts exact (0 CPU-copied bytes,
0 blocking waits), round trips bit-exact, the device named as simulated."""

from __future__ import annotations

import json
from pathlib import Path

from bench.dev.gpu.hicache_bandwidth import main

FIELDS = {"device", "io_backend", "mem_layout", "node_tokens", "raw_gb_per_s", "backup_gb_per_s",
          "load_gb_per_s", "backup_call_ms_per_gib", "load_call_ms_per_gib", "cpu_copied_bytes",
          "blocking_waits", "bit_exact"}


def test_the_command_runs_on_the_simulated_device(tmp_path: Path) -> None:
    out = tmp_path / "bw.json"
    assert main(["--node-tokens", "32", "8", "--gib", str(1 / 2048), "--layers", "2",
                 "--json", str(out)]) == 0
    recs = json.loads(out.read_text())
    assert [(r["io_backend"], r["mem_layout"], r["node_tokens"]) for r in recs] == [
        (io, layout, n) for io in ("direct", "kernel") for layout in ("page_first", "layer_first")
        for n in (32, 8)]
    per_token = 2 * 2 * 2 * 16 * 2  # K+V, 2 layers, 2 heads, head dim 16, float16
    for r in recs:
        assert FIELDS <= set(r)
        assert r["device"].startswith("simulated")
        assert r["bit_exact"] is True and r["cpu_copied_bytes"] == 0 and r["blocking_waits"] == 0
        assert r["bytes"] == r["nodes"] * r["node_tokens"] * per_token == (1 << 30) // 2048
        assert r["backup_gb_per_s"] > 0 and r["load_gb_per_s"] > 0


def test_the_replay_counts_cover_every_host_tier_model() -> None:
    """``--replay``'s rows: per model with a host tier (the sliding-window ones included),
    write policy, page size and event mode, bytes moved and none copied on the CPU or waited
    for; the parser's model names are the library's."""
    from bench.dev.gpu.hicache_bandwidth import replay_counts
    from bench.dev.gpu.options import HOST_TIER_MODEL_NAMES
    from bench.dev.gpu.sync_counts import HOST_TIER_MODELS

    assert tuple(HOST_TIER_MODELS) == HOST_TIER_MODEL_NAMES
    rows = replay_counts(requests=30, models=["swa_hicache"])
    assert [(r["model"], r["write_policy"], r["page_size"], r["events_complete"]) for r in rows] == [
        ("swa_hicache", p, ps, ev)
        for p in ("write_through", "write_through_selective", "write_back")
        for ps in (1, 16) for ev in (True, False)]
    for r in rows:
        assert r["link_bytes"] > 0 and r["cpu_copied_bytes"] == 0 and r["blocking_waits"] == 0, r
