"""Page throughput of the L3 backends: pages/s and MiB/s, written and read, batched or not.

    python -m bench storage                                  # file store only
    eval "$(bash .ci/redis-up)"; python -m bench storage     # + Redis node and cluster
    eval "$(bash .ci/mooncake-up)"; python -m bench storage  # + Mooncake Store
    python -m bench storage --page-bytes 1M --pages 128 --batch 1 64 --json out.json

Each run writes ``--pages`` fresh pages of ``--page-bytes`` random bytes (through the whole
interface: record header, checksum, set-if-absent) in batches of ``--batch`` pages, then
reads them back (verification included) in the same batches. Redis URLs come from
``--redis-url`` / ``--cluster-urls`` or the ``HPC_REDIS_URL`` / ``HPC_REDIS_CLUSTER_URLS``
variables that ``.ci/redis-up`` prints, Mooncake Store's master from ``--mooncake-url`` or
``HPC_MOONCAKE_URL`` (metadata server ``HPC_MOONCAKE_METADATA``, from ``.ci/mooncake-up``); a
backend without a URL is left out. Mooncake runs twice: zero-copy for every batch (records
encoded into a registered buffer and sent from it, read into one) and copying (through the
client's transfer buffer); the backend's default takes the zero-copy path from 1 MiB a batch.
``--mac on`` / ``both``: the records are sealed with an HMAC-SHA256 under a random deployment
secret instead of the checksum (the authenticated pages of ``hicache_storage_secret``). The bench's client lends no memory: the pages cross loopback TCP to the segment of
the standalone ``mooncake_client``. Wall-clock rates, and the bench process's CPU time per page
(``time.process_time``: what the engine host pays for checksums and copies).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import secrets
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.cli import text_stream, write_json
from bench.dev.storage.options import storage_parser
from hicache.storage import FileStore, MooncakeOptions, RedisStore, StorageBackend
from hicache.storage.page import KIND_KV, decode, encode, mac_state, tag_digest


def bench_one(store: StorageBackend, page_bytes: int, pages: int, batch: int) -> dict[str, Any]:
    run = uuid.uuid4().hex
    keys = [hashlib.sha256(f"{run}/{i}".encode()).hexdigest() for i in range(pages)]
    half = page_bytes // 2
    body = os.urandom(page_bytes)
    a, b = body[:half], body[half:]
    store.expect_sections((half, page_bytes - half), (0, 0))
    t0, c0 = time.perf_counter(), time.process_time()
    written = 0
    for lo in range(0, pages, batch):
        written += store.batch_set([(k, a, b) for k in keys[lo:lo + batch]])
    t1, c1 = time.perf_counter(), time.process_time()
    got = 0
    for lo in range(0, pages, batch):
        got += sum(p is not None for p in store.batch_get(keys[lo:lo + batch]))
    t2, c2 = time.perf_counter(), time.process_time()
    mib = pages * page_bytes / 2**20
    assert written == pages and got == pages, (written, got, store.stats)
    return {
        "write_pages_s": round(pages / (t1 - t0), 1),
        "write_mib_s": round(mib / (t1 - t0), 1),
        "read_pages_s": round(pages / (t2 - t1), 1),
        "read_mib_s": round(mib / (t2 - t1), 1),
        "write_cpu_us_page": round(1e6 * (c1 - c0) / pages, 1),
        "read_cpu_us_page": round(1e6 * (c2 - c1) / pages, 1),
    }


def bench_codec(page_bytes: int, pages: int, secret: bytes | None) -> dict[str, float]:
    """CPU time per page [us] of sealing and of verifying one record (``encode`` /
    ``decode``: the checksum, or the MAC under ``secret``) with no backend at all: the part of
    a page's cost the MAC changes, apart from the I/O whose noise hides it in the rows above."""
    half = page_bytes // 2
    body = os.urandom(page_bytes)
    a, b = body[:half], body[half:]
    tag, h = tag_digest("bench"), os.urandom(32)
    mac = None if secret is None else mac_state(secret)
    c0 = time.process_time()
    recs = [encode(KIND_KV, tag, h, a, b, mac) for _ in range(pages)]
    c1 = time.process_time()
    for r in recs:
        decode(r, KIND_KV, tag, h, mac)
    c2 = time.process_time()
    return {"seal_cpu_us_page": round(1e6 * (c1 - c0) / pages, 1),
            "verify_cpu_us_page": round(1e6 * (c2 - c1) / pages, 1)}


def backends(args: argparse.Namespace, tmp: str, secret: bytes | None = None
             ) -> list[tuple[str, StorageBackend]]:
    """The backends to measure (``secret``: records sealed with a MAC under it)."""
    out: list[tuple[str, StorageBackend]] = [
        ("file", FileStore(Path(tmp) / ("l3-mac" if secret else "l3"), tag="bench", secret=secret))]
    single = args.redis_url or os.environ.get("HPC_REDIS_URL")
    cluster = args.cluster_urls or os.environ.get("HPC_REDIS_CLUSTER_URLS")
    if single:
        out.append(("redis-single", RedisStore(single, tag="bench", prefix="bench:", timeout_s=10,
                                               secret=secret)))
    if cluster:
        out.append(("redis-cluster", RedisStore(cluster, tag="bench", prefix="bench:", timeout_s=10,
                                                secret=secret)))
    mooncake = args.mooncake_url or os.environ.get("HPC_MOONCAKE_URL")
    if mooncake:
        from hicache.storage.mooncake_store import MooncakeStore

        meta = os.environ.get("HPC_MOONCAKE_METADATA") or "P2PHANDSHAKE"
        for name, zero_copy in (("mooncake", True), ("mooncake-copying", False)):
            opts = MooncakeOptions.resolve(mooncake, {
                "metadata_server": meta, "global_segment_size": 0, "local_hostname": "127.0.0.1",
                "zero_copy": zero_copy, "zero_copy_min_bytes": 0, "key_prefix": "bench:"})
            out.append((name, MooncakeStore(opts, tag="bench", timeout_s=30, secret=secret)))
    return out


def bench_backend(name: str, store: StorageBackend, args: argparse.Namespace,
                  mac: bool) -> list[dict[str, Any]]:
    rows = []
    for batch in args.batch:
        runs = [bench_one(store, args.page_bytes, args.pages, batch)
                for _ in range(max(1, args.repeat))]
        best = {k: (min if "cpu" in k else max)(run[k] for run in runs) for k in runs[0]}
        r = {"backend": name, "mac": mac, "batch": batch, "page_bytes": args.page_bytes,
             "pages": args.pages, "repeat": len(runs), **best}
        rows.append(r)
        print(f"{name:16s} {'mac' if mac else 'sum'} batch={batch:<4d} write "
              f"{r['write_pages_s']:>9.1f} pages/s {r['write_mib_s']:>8.1f} MiB/s "
              f"{r['write_cpu_us_page']:>7.1f} cpu-us/page   read {r['read_pages_s']:>9.1f} pages/s "
              f"{r['read_mib_s']:>8.1f} MiB/s {r['read_cpu_us_page']:>7.1f} cpu-us/page",
              file=text_stream(args.json), flush=True)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    args = storage_parser().parse_args(argv)
    rows = []
    macs = {"off": [False], "on": [True], "both": [False, True]}[args.mac]
    codec = {m: secrets.token_bytes(32) if m else None for m in macs}
    for mac, secret in codec.items():  # interleaved repeats, the least CPU time of each
        runs = [bench_codec(args.page_bytes, args.pages, secret)
                for _ in range(max(3, args.repeat))]
        best = {k: min(run[k] for run in runs) for k in runs[0]}
        rows.append({"backend": "codec", "mac": mac, "page_bytes": args.page_bytes, **best})
        print(f"{'codec':16s} {'mac' if mac else 'sum'} seal {best['seal_cpu_us_page']:>7.1f} "
              f"cpu-us/page   verify {best['verify_cpu_us_page']:>7.1f} cpu-us/page",
              file=text_stream(args.json), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for mac in macs:
            secret = secrets.token_bytes(32) if mac else None
            for name, store in backends(args, tmp, secret):
                rows += bench_backend(name, store, args, mac)
                store.close()
    if args.json:
        write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
