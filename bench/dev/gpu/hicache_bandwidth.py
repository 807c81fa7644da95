"""The host tier at the speed of the link: ``python -m bench hicache-bandwidth``.

Per ``hicache_io_backend`` x ``hicache_mem_layout`` x node size, a cache with a host tier
(write_through) backs up ``--gib`` of K+V as nodes of ``--node-tokens`` (``insert``), demotes
them (``evict``) and loads them back (``load_back``), each phase timed from its first call to
the device being idle (GB/s, against the raw pinned host <-> device copy of the same size in
the same run) and per call on the engine thread (ms per GiB moved). A second, untimed round of
two nodes counts the bytes the CPU copied (host-side torch calls on floating-point data) and
the blocking waits inside the calls (the simulator's syncs; on a GPU, the warnings of
``torch.cuda.set_sync_debug_mode("warn")``). Round trips are checked bit for bit.

Without CUDA (or with ``--simulate``) everything runs on the simulated device
(``bench/dev/gpu/simcuda.py``) over a small pool: the counts are exact, the times are not a GPU's.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, cast
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode

from allocators import KVPool, TokenAllocator
from bench.cli import text_stream, write_json
from bench.dev.gpu.options import hicache_bandwidth_parser
from bench.dev.gpu.simcuda import SimCuda, host_copy_bytes
from hicache import HiCacheConfig
from radix import CacheConfig, RadixCache

GIB = 1 << 30


class CpuCopies(TorchFunctionMode):
    """Counts the bytes host-side torch calls copy (:func:`bench.dev.gpu.simcuda.host_copy_bytes`)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.bytes += host_copy_bytes(func, args, kwargs, out)
        return out


@contextlib.contextmanager
def sync_warnings(on_gpu: bool) -> Iterator[list[Any]]:
    """Collect the host synchronisations torch reports (a real GPU only)."""
    if not on_gpu:
        yield []
        return
    prev = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield caught
        finally:
            torch.cuda.set_sync_debug_mode(prev)


def raw_bandwidth(nbytes: int) -> tuple[float, float]:
    """(device -> host, host -> device) GB/s of one pinned ``nbytes`` copy (best of 3)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = []
    for dst, src in ((host, dev), (dev, host)):
        best = float("inf")
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        out.append(nbytes / best / 1e9)
    return out[0], out[1]


def _cache(nodes: int, tokens: int, shape: tuple[int, int, int], dtype: torch.dtype, io: str,
           layout: str) -> tuple[RadixCache, KVPool, TokenAllocator]:
    layers, heads, dim = shape
    pool = KVPool(nodes * tokens, layers, heads, dim, dtype, "cuda")
    kv = TokenAllocator(nodes * tokens, pool=pool, device="cuda")
    cfg = HiCacheConfig(hicache_io_backend=io, hicache_mem_layout=layout, load_back_threshold=1,
                        hicache_ratio=2.0)
    return RadixCache(CacheConfig(), kv_allocator=kv, hicache=cfg), pool, kv


def _round(cache: RadixCache, pool: KVPool, kv: TokenAllocator, nodes: int, tokens: int,
           check: bool, wrap: Any = contextlib.nullcontext) -> dict[str, Any]:
    """Back up ``nodes`` nodes, demote them, load them back; times and bit-exactness."""
    torch.manual_seed(0)  # generated on the device: no host time spent on the data
    pool.k_all.copy_(torch.randn(pool.k_all.shape, dtype=pool.dtype, device="cuda"))
    pool.v_all.copy_(torch.randn(pool.v_all.shape, dtype=pool.dtype, device="cuda"))
    orig_k, orig_v = pool.k_all.clone(), pool.v_all.clone()
    slots = []
    for _ in range(nodes):
        got = kv.alloc(tokens)
        assert got is not None
        slots.append(got)
    torch.cuda.synchronize()
    calls = {"insert": 0.0, "load_back": 0.0}
    t0 = time.perf_counter()
    last = []
    for i, s in enumerate(slots):
        key = [i * tokens + j + 1 for j in range(tokens)]
        c0 = time.perf_counter()
        with wrap():
            last.append(cache.insert(key, s).last_node)
        calls["insert"] += time.perf_counter() - c0
    torch.cuda.synchronize()
    backup_s = time.perf_counter() - t0
    cache.poll_transfers()
    hc = cache.hicache
    assert hc is not None
    exact = True
    if check:
        hp = cast("KVPool", cast(Any, hc.host_kv).pool)  # the host mirror of the KVPool
        for node, s in zip(last, slots, strict=True):
            exact &= torch.equal(hp.k_all[:, node.host_value], orig_k[:, s].cpu())
            exact &= torch.equal(hp.v_all[:, node.host_value], orig_v[:, s].cpu())
    with wrap():
        cache.evict(nodes * tokens)
    pool.k_all.zero_()
    pool.v_all.zero_()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for node in last:
        c0 = time.perf_counter()
        with wrap():
            n = cache.load_back(node)
        calls["load_back"] += time.perf_counter() - c0
        assert n == tokens, n
    torch.cuda.synchronize()
    load_s = time.perf_counter() - t0
    if check:
        for node, s in zip(last, slots, strict=True):
            d = cache.kv.slots(node)  # the node's device rows now
            exact &= torch.equal(pool.k_all[:, d], orig_k[:, s])
            exact &= torch.equal(pool.v_all[:, d], orig_v[:, s])
    return {"backup_s": backup_s, "load_s": load_s, "calls": calls, "bit_exact": bool(exact)}


def measure(io: str, layout: str, tokens: int, nbytes: int, shape: tuple[int, int, int],
            dtype: torch.dtype, on_gpu: bool, sim: SimCuda | None,
            raw: tuple[float, float]) -> dict[str, Any]:
    layers, heads, dim = shape
    per_token = 2 * layers * heads * dim * torch.empty((), dtype=dtype).element_size()
    nodes = max(1, nbytes // (per_token * tokens))
    moved = nodes * tokens * per_token
    cache, pool, kv = _cache(nodes, tokens, shape, dtype, io, layout)
    r = _round(cache, pool, kv, nodes, tokens, check=True)
    del cache, pool, kv
    gc.collect()
    # the counted round: two nodes, every call under the counters
    cache, pool, kv = _cache(2, tokens, shape, dtype, io, layout)
    counter = CpuCopies()
    caught: list[Any] = []

    @contextlib.contextmanager
    def counted() -> Iterator[None]:
        with sync_warnings(on_gpu) as got, counter:
            yield
        caught.extend(got)

    if sim is not None:  # the simulator charges the tracked calls itself
        sim.ops.clear()
        sim.cpu_copied.clear()
        sim.track(cache, ["insert", "load_back", "evict"], "cache")
        c = _round(cache, pool, kv, 2, tokens, check=False)
        cpu_copied = sum(n for op, n in sim.cpu_copied.items() if op.startswith("cache."))
        waits = sum(sim.syncs_of(op) for op in list(sim.ops) if op.startswith("cache."))
    else:
        c = _round(cache, pool, kv, 2, tokens, check=False, wrap=counted)
        cpu_copied = counter.bytes
        waits = sum(1 for w in caught if "synchroniz" in str(w.message).lower())
    assert c is not None
    del cache, pool, kv
    gc.collect()
    if on_gpu:
        torch.cuda.empty_cache()
    gib = moved / GIB
    rec = {
        "device": torch.cuda.get_device_name() if on_gpu else "simulated (CPU): not a GPU's figures",
        "io_backend": io, "mem_layout": layout, "node_tokens": tokens, "nodes": nodes,
        "bytes": moved,
        "raw_d2h_gb_per_s": raw[0], "raw_h2d_gb_per_s": raw[1],
        "raw_gb_per_s": min(raw),
        "backup_gb_per_s": moved / r["backup_s"] / 1e9,
        "load_gb_per_s": moved / r["load_s"] / 1e9,
        "backup_call_ms_per_gib": 1e3 * r["calls"]["insert"] / gib,
        "load_call_ms_per_gib": 1e3 * r["calls"]["load_back"] / gib,
        "backup_call_ms": 1e3 * r["calls"]["insert"] / nodes,
        "load_call_ms": 1e3 * r["calls"]["load_back"] / nodes,
        "cpu_copied_bytes": int(cpu_copied),
        "blocking_waits": int(waits),
        "bit_exact": r["bit_exact"],
    }
    rec["backup_share"] = rec["backup_gb_per_s"] / raw[0]
    rec["load_share"] = rec["load_gb_per_s"] / raw[1]
    return rec


def table(records: Sequence[dict[str, Any]]) -> str:
    head = ("| io_backend | mem_layout | node tokens | raw GB/s d2h/h2d | backup GB/s (share) | "
            "load GB/s (share) | insert ms/GiB | load_back ms/GiB | CPU-copied B | waits | exact |")
    lines = [head, "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in records:
        lines.append(
            f"| {r['io_backend']} | {r['mem_layout']} | {r['node_tokens']} | "
            f"{r['raw_d2h_gb_per_s']:.1f} / {r['raw_h2d_gb_per_s']:.1f} | "
            f"{r['backup_gb_per_s']:.2f} ({100 * r['backup_share']:.0f} %) | "
            f"{r['load_gb_per_s']:.2f} ({100 * r['load_share']:.0f} %) | "
            f"{r['backup_call_ms_per_gib']:.2f} | {r['load_call_ms_per_gib']:.2f} | "
            f"{r['cpu_copied_bytes']} | {r['blocking_waits']} | {r['bit_exact']} |")
    return "\n".join(lines)


def replay_counts(requests: int = 100, models: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """The seeded HiCache replay on the simulated device, per model with a host tier
    (``bench.dev.gpu.sync_counts.HOST_TIER_MODELS``: ``hicache`` KV + states, ``swa_hicache``
    KV + sliding-window KV, ``hybrid_swa_hicache`` all three; default: all), write policy,
    page size and event mode: bytes the copies moved, bytes the CPU copied, blocking waits,
    summed over the cache's engine-facing calls [bytes; counts]."""
    from bench.dev.gpu import sync_counts

    out = []
    orig = sync_counts.SimCuda
    for model in models or sync_counts.HOST_TIER_MODELS:
        for policy in ("write_through", "write_through_selective", "write_back"):
            for page_size in (1, 16):
                for complete in (True, False):
                    with mock.patch.object(sync_counts, "SimCuda",
                                           functools.partial(orig, events_complete=complete)):
                        res = sync_counts.run_model(model, sync_counts.conversations(requests),
                                                    strict=True, page_size=page_size,
                                                    hicache_write_policy=policy)
                    rep = {op: r for op, r in res.sim.transfer_report().items()
                           if op.startswith("cache.")}
                    out.append({"model": model, "write_policy": policy, "page_size": page_size,
                                "events_complete": complete,
                                "link_bytes": sum(r["link_bytes"] for r in rep.values()),
                                "cpu_copied_bytes": sum(r["cpu_copied_bytes"] for r in rep.values()),
                                "blocking_waits": sum(r["blocking_waits"] for r in rep.values())})
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = hicache_bandwidth_parser().parse_args(argv)
    out = text_stream(args.json)
    # a file is rewritten after every record (a later failure keeps the earlier ones); stdout
    # ('-') gets the JSON once, at the end
    to_file = args.json is not None and args.json != "-"
    if args.replay:
        rows = replay_counts(models=args.models)
        print("| model | write policy | page size | events | bytes moved | CPU-copied bytes "
              "| blocking waits |", file=out)
        print("|---|---|---:|---|---:|---:|---:|", file=out)
        for r in rows:
            print(f"| {r['model']} | {r['write_policy']} | {r['page_size']} | "
                  f"{'complete' if r['events_complete'] else 'never complete'} | {r['link_bytes']} | "
                  f"{r['cpu_copied_bytes']} | {r['blocking_waits']} |", file=out)
        if args.json:
            write_json(args.json, rows)
        return 0
    on_gpu = torch.cuda.is_available() and not args.simulate
    d = (32, 8, 128, [16384, 256], 2.0) if on_gpu else (4, 2, 16, [256, 16], 1 / 256)
    shape = (args.layers or d[0], args.heads or d[1], args.head_dim or d[2])
    node_tokens = args.node_tokens or d[3]
    nbytes = int((args.gib or d[4]) * GIB)
    dtype = torch.float16
    records: list[dict[str, Any]] = []
    failed: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        sim = None if on_gpu else stack.enter_context(SimCuda(strict=True))
        if sim is not None:
            print("simulated CUDA device: the counts are exact, the times are not a GPU's",
                  file=sys.stderr)
        raw = raw_bandwidth(nbytes)
        for io in args.io_backends:
            for layout in args.mem_layouts:
                for tokens in node_tokens:
                    try:
                        rec = measure(io, layout, tokens, nbytes, shape, dtype, on_gpu, sim, raw)
                    except Exception as e:  # recorded: the other records still count
                        failed.append({"io_backend": io, "mem_layout": layout,
                                       "node_tokens": tokens, "error": repr(e)[:500]})
                        print(f"{io} {layout} {tokens}: FAILED {e!r}", file=sys.stderr)
                        if to_file:
                            write_json(args.json, records + failed)
                        continue
                    records.append(rec)
                    print(f"{io} {layout} {tokens}: backup {rec['backup_gb_per_s']:.2f} GB/s, "
                          f"load {rec['load_gb_per_s']:.2f} GB/s", file=sys.stderr)
                    if to_file:
                        write_json(args.json, records + failed)
    if args.json == "-":
        write_json(args.json, records + failed)
    print(table(records), file=out)
    for f in failed:
        print(f"failed: {f}", file=out)
    return 0 if not failed and all(r["bit_exact"] for r in records) else 1


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
