"""Developer instruments: in the repository, never in the wheel (``pyproject.toml`` excludes
``bench.dev``). ``python -m bench`` registers their commands when this package is present
(:func:`bench.cli._dev_commands`); the tests under ``tests/`` run them from a checkout.

=================  ============================================================================
``compare/``       radix operations against SGLang's own caches (the anchor environment),
                   per-operation cost, evict cost against tree size
``gpu/``           a CUDA device simulated on the CPU that counts host synchronisations;
                   the host tier's bandwidth (``hicache-bandwidth``)
``model/``         tiny real hybrid models (transformers) served through the cache
``storage/``       L3 backend throughput, engines sharing one L3 store
``lora/``          LoRA adapter load cost from PEFT directories
``policies/``      replay baselines (``marconi``, ``seglen``), the offline reference
                   (``belady``), experimental walks (``idea:*``), the slot-time budget model,
                   the hit breakdown
``benchmarks/``    the pytest-benchmark suite (``python -m pytest bench/dev/benchmarks``)
=================  ============================================================================

Imports nothing: ``python -m bench`` reads :data:`COMMANDS` and :data:`BASELINES` without torch.
"""

from __future__ import annotations

__all__ = ["BASELINES", "COMMANDS"]

#: Command -> (module running it, one-line summary, ``module:function`` of its parser or
#: ``build_parser`` in the module), as :data:`bench.cli.COMMANDS` takes them.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "compare": ("bench.dev.compare.sglang", "radix operations against SGLang's own caches "
                "(needs the anchor environment)", "build_parser"),
    "radix-ops": ("bench.dev.compare.radix_ops", "per-operation cost of match / insert / "
                  "evict / locks", "bench.dev.compare.options:radix_ops_parser"),
    "evict-scaling": ("bench.dev.compare.evict_scaling", "per-node evict cost against tree "
                      "size (10k to 1M nodes)", "bench.dev.compare.options:evict_scaling_parser"),
    "opcodes": ("bench.dev.compare.opcodes", "Python opcodes per match / insert / evict call "
                "(a speed measure load cannot blur)", "build_parser"),
    "state-budget": ("bench.dev.policies.budget", "slot-time budget model: what the "
                     "prompt-end states can save, offline and by an online rule", "build_parser"),
    "hit-breakdown": ("bench.dev.policies.hit_breakdown", "where a state policy's hits come "
                      "from", "bench.dev.policies.options:hit_breakdown_parser"),
    "sync-counts": ("bench.dev.gpu.sync_counts", "host syncs, kernel launches and memcpys per request on a "
                    "simulated CUDA device", "bench.dev.gpu.options:sync_counts_parser"),
    "hicache-bandwidth": ("bench.dev.gpu.hicache_bandwidth", "host tier backup / load-back "
                          "GB/s against the raw pinned copy, per io backend and layout",
                          "bench.dev.gpu.options:hicache_bandwidth_parser"),
    "storage": ("bench.dev.storage.throughput", "L3 backend throughput (file, Redis, "
                "Mooncake Store)", "bench.dev.storage.options:storage_parser"),
    "l3-share": ("bench.dev.storage.l3_share", "hit rates of engines sharing one L3 store",
                 "bench.dev.storage.options:l3_share_parser"),
    "lora-load": ("bench.dev.lora.load", "LoRA adapter load cost from PEFT directories",
                  "bench.dev.lora.options:lora_load_parser"),
    "model": ("bench.dev.model.driver", "a tiny real hybrid model served through the cache, "
              "every request checked against the uncached model",
              "bench.dev.model.options:model_parser"),
}

#: Modules that register replay baselines (:func:`bench.policies.baselines.register`),
#: imported on the first baseline lookup after the installed ones.
BASELINES: tuple[str, ...] = (
    "bench.dev.policies.utility",
    "bench.dev.policies.offline",
    "bench.dev.policies.ideas",
)
