"""The options of ``python -m bench sync-counts``.

Parsers only, without torch: ``python -m bench COMMAND --help`` builds them alone
(:data:`bench.cli.COMMANDS`); the commands' modules import the library where they run."""

from __future__ import annotations

import argparse

from bench.cli import new_parser, output_path, positive, positive_float

__all__ = ["HOST_TIER_MODEL_NAMES", "MODEL_NAMES", "sync_counts_parser"]

MODEL_NAMES = ("kv", "hybrid", "swa", "hicache")
"""The engine models of :data:`bench.dev.gpu.sync_counts.MODELS` (checked equal by the tests)."""

HOST_TIER_MODEL_NAMES = ("hicache", "swa_hicache", "hybrid_swa_hicache")
"""The models of :data:`bench.dev.gpu.sync_counts.HOST_TIER_MODELS` (checked equal by the tests)."""


def sync_counts_parser() -> argparse.ArgumentParser:
    p = new_parser("sync-counts", (
        "Host synchronisations, kernel launches and memcpys per request and per operation of the "
        "replay's engine on a simulated CUDA device; with --device cuda, us/request on a real GPU "
        "against the CPU, the counts from the profiler."))
    p.add_argument("--requests", type=positive, default=160, help="requests per model (160)")
    p.add_argument("--trace", default=None,
                   help="replay this trace file's first --requests instead of the seeded "
                        "conversations (e.g. bench/traces/...jsonl)")
    p.add_argument("--page-size", type=positive, default=1, help="tokens per KV page (1)")
    p.add_argument("--models", nargs="+", default=list(MODEL_NAMES), choices=MODEL_NAMES)
    p.add_argument("--policy", default="lru", help="radix eviction policy (lru)")
    p.add_argument("--kv-tokens", type=positive, default=None,
                   help="KV pool size [tokens] (default: the models' 30,000; a trace's long "
                        "prompts want more, e.g. 16000000)")
    p.add_argument("--json", nargs="?", const="-", default=None, type=output_path,
                   metavar="FILE",
                   help="write the counts as JSON to FILE (no FILE or '-': print them instead "
                        "of the table)")
    p.add_argument("--device", choices=("sim", "cuda"), default="sim",
                   help="sim: the simulated device (default); cuda: a real GPU (us/request "
                        "on cuda and cpu, counts from torch.profiler, stats() equality)")
    return p


def hicache_bandwidth_parser() -> argparse.ArgumentParser:
    p = new_parser("hicache-bandwidth", (
        "The host tier at the speed of the link: raw pinned host <-> device copy bandwidth and the "
        "library's backup (insert, write_through) and load_back of whole nodes, per "
        "hicache_io_backend / hicache_mem_layout and node size: GB/s, share of the raw bandwidth, "
        "engine-thread time per call, CPU-copied bytes, blocking waits, bit-exactness. On a machine"
        " without CUDA it runs the same paths on a small pool on the simulated device "
        "(bench/gpu/simcuda.py): those figures are not a GPU's."))
    p.add_argument("--node-tokens", type=positive, nargs="+", default=None,
                   help="tokens per node (GPU default: 16384 256; simulated: 256 16)")
    p.add_argument("--gib", type=positive_float, default=None,
                   help="GiB of K+V moved per measurement, as nodes of --node-tokens "
                        "(GPU default 2; simulated: 1/256)")
    p.add_argument("--layers", type=positive, default=None, help="KV layers (GPU 32, simulated 4)")
    p.add_argument("--heads", type=positive, default=None, help="KV heads (GPU 8, simulated 2)")
    p.add_argument("--head-dim", type=positive, default=None, help="head dim (GPU 128, simulated 16)")
    p.add_argument("--io-backends", nargs="+", default=["direct", "kernel"],
                   choices=["direct", "kernel"])
    p.add_argument("--mem-layouts", nargs="+", default=["page_first", "layer_first"],
                   choices=["page_first", "layer_first"])
    p.add_argument("--simulate", action="store_true",
                   help="use the simulated device even where CUDA is available")
    p.add_argument("--replay", action="store_true",
                   help="instead: the seeded HiCache replay (bench.dev.gpu.sync_counts) on the "
                        "simulated device per model, write policy, page size 1 / 16 and events "
                        "that complete or never do: bytes moved, CPU-copied bytes, blocking waits")
    p.add_argument("--models", nargs="+", default=None, choices=list(HOST_TIER_MODEL_NAMES),
                   help="with --replay: the models with a host tier (hicache: KV + states; "
                        "swa_hicache: KV + sliding-window KV; hybrid_swa_hicache: all three; "
                        "default: all)")
    p.add_argument("--json", default=None, metavar="FILE",
                   help="write one record per backend / layout and node size ('-': stdout)")
    return p
