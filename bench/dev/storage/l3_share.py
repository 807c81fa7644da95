"""Engine instances sharing one HiCache L3: hit rate with and without sharing.

    python -m bench l3-share --max-requests 1000 --instances 2 --l3 file:/tmp/hpc-l3
    python -m bench l3-share --instances 2 --l3 redis://127.0.0.1:6379 --json out.json
    python -m bench l3-share --instances 2 --l3 mooncake://127.0.0.1:50051   # Mooncake master

The trace (default: the shipped Mooncake conversation trace) is cut to its first
``--max-requests`` requests; request ``i`` goes to instance ``i % N`` (N independent
:class:`~bench.engine.core.ReplayEngine` caches, each with device and host tiers). Three set-ups run
over the same requests:

* ``none``    — no L3: each instance hits only what it cached itself;
* ``private`` — each instance has an L3 of its own (its own page keys in the same store);
* ``shared``  — all instances share one L3: a prefix one instance computed is prefetched by
  the others on a miss (``wait_complete``: the replay has no clock to wait on).

Per instance: requests, prompt tokens, usable hit tokens and rate, tokens brought from L3
(``l3_prefetch_tokens``) and pages written. Pages hold no tensors (an index-only replay), so
this measures which pages are found, not bandwidth (``bench.dev.storage.throughput`` measures that).
Writes are flushed after every request so the next instance sees them. On Mooncake Store
each instance's client lends ``--mooncake-segment`` bytes to the store; the metadata server is
``$HPC_MOONCAKE_METADATA`` (``.ci/mooncake-up``), else ``$MOONCAKE_TE_META_DATA_SERVER``, else
``P2PHANDSHAKE``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.cli import text_stream, write_json
from bench.dev.storage.options import l3_share_parser
from bench.engine.core import EngineConfig, ReplayEngine
from bench.engine.metrics import summarize
from bench.traces.loader import TraceRequest, load_trace
from hicache import HiCacheConfig


@dataclass(frozen=True, slots=True)
class L3EngineConfig(EngineConfig):
    """An :class:`EngineConfig` whose host tier has an L3 below it."""

    l3_backend: str | None = None
    l3_where: str | None = None
    l3_model: str = "default"
    l3_extra_config: str | None = None
    l3_secret: bytes | None = None

    def hicache_config(self) -> HiCacheConfig | None:
        base = EngineConfig.hicache_config(self)
        if base is None or self.l3_backend is None:
            return base
        where: dict[str, Any] = ({"hicache_storage_dir": self.l3_where} if self.l3_backend == "file"
                 else {"hicache_storage_url": self.l3_where,
                       "hicache_storage_backend_extra_config": self.l3_extra_config})
        return dataclasses.replace(base, hicache_storage_backend=self.l3_backend,
                                   hicache_storage_model=self.l3_model,
                                   hicache_storage_prefetch_policy="wait_complete",
                                   hicache_storage_secret=self.l3_secret, **where)


def mooncake_extra_config(segment: int) -> str:
    """The extra config of a bench instance on Mooncake Store (see the module docstring)."""
    meta = (os.environ.get("HPC_MOONCAKE_METADATA") or os.environ.get("MOONCAKE_TE_META_DATA_SERVER")
            or "P2PHANDSHAKE")
    return json.dumps({"metadata_server": meta, "global_segment_size": segment, "protocol": "tcp",
                       "local_hostname": "127.0.0.1"})


def run_setup(setup: str, trace: list[TraceRequest], base: EngineConfig, n: int,
              l3: tuple[str, str], extra_config: str | None = None,
              secret: bytes | None = None) -> list[dict[str, Any]]:
    """Replay ``trace`` over ``n`` instances in one set-up; one result row per instance
    (``secret``: the instances' pages are authenticated under it)."""
    backend, where = l3
    run = uuid.uuid4().hex[:8]
    engines = []
    for i in range(n):
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(EngineConfig)}
        if setup != "none":
            model = f"l3share-{run}" + ("" if setup == "shared" else f"-{i}")
            loc = str(Path(where) / run) if backend == "file" else where
            cfg = L3EngineConfig(**fields, l3_backend=backend, l3_where=loc, l3_model=model,
                                 l3_extra_config=extra_config, l3_secret=secret)
        else:
            cfg = L3EngineConfig(**fields)
        engines.append(ReplayEngine(cfg))
    start, cpu0 = time.perf_counter(), time.process_time()
    for j, tr in enumerate(trace):
        eng = engines[j % n]
        eng.admit(tr, rid=j)
        eng.cache.flush_storage(30)
    rows = []
    for i, eng in enumerate(engines):
        eng.drain()
        eng.cache.flush_storage(30)
        m = summarize(eng.log)
        st = eng.cache.stats()
        rows.append({
            "setup": setup,
            "instance": i,
            "requests": m.requests,
            "skipped": m.skipped_requests,
            "prompt_tokens": m.prompt_tokens,
            "hit_tokens": m.usable_tokens,
            "hit_rate": round(m.token_hit_rate, 4),
            "host_hit_tokens": st["host_hit_tokens"],
            "l3_prefetch_tokens": st.get("l3_prefetch_tokens", 0),
            "l3_pages_written": st.get("l3_backup_written", 0),
            "l3_faults": st.get("l3_faults", 0) + st.get("l3_backend_errors", 0)
            + st.get("l3_backend_timeouts", 0),
            "seconds": round(time.perf_counter() - start, 1),
            "cpu_s": round(time.process_time() - cpu0, 2),
            "authenticated": secret is not None,
        })
        eng.cache.close_storage()
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = l3_share_parser()
    args = parser.parse_args(argv)
    try:  # the pools and the trace, before any engine or store is built
        base = EngineConfig(kv_tokens=args.kv_tokens, state_slots=args.state_slots,
                            page_size=args.page_size, hicache_ratio=args.hicache_ratio)
        trace = load_trace(args.trace, max_requests=args.max_requests)
    except (FileNotFoundError, ValueError, TypeError) as exc:  # TraceFormatError: a ValueError
        parser.error(str(exc))
    rows = []
    extra = mooncake_extra_config(args.mooncake_segment) if args.l3[0] == "mooncake" else None
    secret = secrets.token_bytes(32) if args.authenticated else None
    for setup in args.setups:
        rows += run_setup(setup, trace, base, args.instances, args.l3, extra, secret)
    head = ("setup", "instance", "requests", "prompt_tokens", "hit_tokens", "hit_rate",
            "l3_prefetch_tokens", "l3_pages_written", "l3_faults", "seconds", "cpu_s")
    out = text_stream(args.json)
    print(" | ".join(head), file=out)
    for r in rows:
        print(" | ".join(str(r[h]) for h in head), file=out)
    for setup in args.setups:
        sel = [r for r in rows if r["setup"] == setup]
        total = sum(r["prompt_tokens"] for r in sel)
        hit = sum(r["hit_tokens"] for r in sel)
        print(f"{setup}: hit rate over all instances {hit / total:.4f}" if total else setup,
              file=out)
    if args.json:
        write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
