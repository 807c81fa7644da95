"""The GPU path on a real CUDA device (skipped without one; CI never needs one).

The simulated device (``bench/dev/gpu/simcuda.py``) proves the same properties on every machine; these
run them where the hardware decides: ``torch.cuda.set_sync_debug_mode("error")`` makes every
synchronising call raise, so the replay's engine calls must go through without one, and the
host tier's round trips must be bit-exact with the real streams, events and pinned memory.
"""

from __future__ import annotations

import pytest
import torch

from bench.dev.gpu.sync_counts import COMMON, HOST_TIER_MODELS, MODELS, conversations
from bench.engine.core import EngineConfig, ReplayEngine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
#: Every replay model, the sliding-window ones with a host tier included.
REPLAY_MODELS = {**MODELS, **HOST_TIER_MODELS}


@pytest.mark.parametrize("model", list(REPLAY_MODELS))
def test_the_replay_runs_with_sync_debug_mode_error(model: str) -> None:
    trace = conversations(60)
    engine = ReplayEngine(EngineConfig(**{**COMMON, **REPLAY_MODELS[model]}))
    torch.cuda.synchronize()
    try:
        torch.cuda.set_sync_debug_mode("error")
        for i, tr in enumerate(trace):
            engine.admit(tr, rid=i)
        engine.drain()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    engine.cache.sanity_check()
    cpu = ReplayEngine(EngineConfig(**{**COMMON, **REPLAY_MODELS[model], "device": "cpu"}))
    for i, tr in enumerate(trace):
        cpu.admit(tr, rid=i)
    cpu.drain()
    assert engine.cache.stats() == cpu.cache.stats()


IO = [(io, layout) for io in ("direct", "kernel") for layout in ("page_first", "layer_first")]


@pytest.mark.parametrize("io, layout", IO, ids=[f"{a}-{b}" for a, b in IO])
@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
def test_host_tier_round_trip_is_bit_exact_on_cuda(io: str, layout: str, layerwise: bool) -> None:
    from allocators import KVPool, MambaStatePool, TokenAllocator
    from hicache import HiCacheConfig
    from radix import CacheConfig, RadixCache

    pool = KVPool(256, 4, 8, 128, torch.float16, "cuda")
    kv = TokenAllocator(256, pool=pool, device="cuda")
    sp = MambaStatePool(8, 4, (64, 4), (8, 64, 64), device="cuda")
    c = RadixCache(CacheConfig(), kv_allocator=kv, state_allocator=sp,
                   hicache=HiCacheConfig(load_back_threshold=1, hicache_io_backend=io,
                                         hicache_mem_layout=layout))
    slots = kv.alloc(192)
    assert slots is not None
    k = torch.randn(4, 192, 8, 128, device="cuda", dtype=torch.float16)
    v = torch.randn(4, 192, 8, 128, device="cuda", dtype=torch.float16)
    pool.scatter(slots, k, v)
    s = sp.alloc(1)
    assert s is not None
    sp.conv.index_copy_(1, s, torch.randn(4, 1, 64, 4, device="cuda"))
    conv = sp.conv[:, s].cpu()
    node = c.insert(list(range(1, 193)), slots, state_slot=s).last_node
    torch.cuda.synchronize()
    c.poll_transfers()
    assert c.hicache is not None
    hp = c.hicache.host_kv.pool
    assert hp is not None and torch.equal(hp.k_all[:, node.host_value], k.cpu())
    c.evict(192)
    pool.k_all.zero_()
    sp.conv.zero_()
    c.hicache.layerwise = layerwise
    assert c.load_back(node) == 192
    t = c.hicache.last_load
    assert t is not None and len(t.layer_events) == 4
    if layerwise:
        for i in range(4):  # what an engine does before layer i's attention
            t.wait_layer(i)
    else:
        torch.cuda.synchronize()
    got_k, _ = pool.gather(c.kv.slots(node))
    assert torch.equal(got_k.cpu(), k.cpu())
    assert torch.equal(sp.conv[:, node.state_slot].cpu(), conv[:, 0])


def test_sync_counts_device_cuda_compares_cpu_and_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m bench sync-counts --device cuda``: the replay on the GPU makes the CPU's
    decisions, and the profiler's counts come back per model."""
    import json

    from bench.dev.gpu.real_device import compare

    assert compare(["kv", "hybrid"], conversations(40), json_path="-") == 0
    out = capsys.readouterr().out
    rows = json.loads(out[out.index("["):])
    assert [r["model"] for r in rows] == ["kv", "hybrid"]
    assert all(r["stats_equal"] and r["cuda_us_per_request"] > 0 for r in rows)
    assert all(r["memcpys_per_request"] > 0 for r in rows)  # the KV uploads, seen by the profiler
