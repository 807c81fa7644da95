"""Throughput of the unkeyed L3 record checksum: sealing (``page.encode``) and verifying
(``page.decode``) one record, body bytes per second of CPU time, by page size; and the raw
hash functions for reference. Prints one JSON line per page size.

    python bench/dev/storage/checksum.py [--sizes 65536 1048576] [--seconds 1.0]

Run from the repository root (``PYTHONPATH=$PWD``). The record path measures whatever
checksum the code on the path writes by default (``checksum`` in the output, when the code
says which).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from collections.abc import Callable
from functools import partial

from hicache.storage import page


def rate(fn: Callable[[], object], nbytes: int, seconds: float) -> float:
    """MB/s (1e6 bytes) of CPU time over at least ``seconds``, best of 3 rounds."""
    best = 0.0
    for _ in range(3):
        n, t0 = 0, time.process_time()
        while True:
            fn()
            n += 1
            dt = time.process_time() - t0
            if dt >= seconds / 3:
                break
        best = max(best, n * nbytes / dt / 1e6)
    return round(best, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[64 << 10, 1 << 20])
    ap.add_argument("--seconds", type=float, default=1.0)
    args = ap.parse_args()
    tag, key = page.tag_digest("bench"), os.urandom(32)
    for size in args.sizes:
        body = os.urandom(size)
        a, b = body[: size // 2], body[size // 2 :]
        rec = page.encode(page.KIND_KV, tag, key, a, b)
        out = {"page_bytes": size,
               "checksum": getattr(page, "default_checksum", lambda: "sha256")(),
               "seal_MBps": rate(partial(page.encode, page.KIND_KV, tag, key, a, b), size,
                                 args.seconds),
               "verify_MBps": rate(partial(page.decode, rec, page.KIND_KV, tag, key), size,
                                   args.seconds),
               "sha256_MBps": rate(partial(hashlib.sha256, body), size, args.seconds)}
        try:
            import xxhash
            out["xxh3_128_MBps"] = rate(partial(xxhash.xxh3_128, body), size, args.seconds)
        except ImportError:
            pass
        print(json.dumps(out))


if __name__ == "__main__":
    main()
