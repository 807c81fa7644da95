"""Replays an operation script on SGLang's own caches and prints what it observed (one JSON
line). Run by the anchor environment's Python (SGLang 0.5.23 installed), never imported by the
project: ``tests/sglang/test_sglang_differential.py`` starts it as a subprocess.

    <anchor python> sglang_driver.py ANCHOR_DIR < script.json

``ANCHOR_DIR`` holds ``sglang_cpu_shim`` (import-time stand-ins for triton / torchvision).
The script is ``{"variant": "kv" | "mamba", "impl": "unified" | "radix" | "mamba-0.5.12",
"page_size": P, "policy": NAME, "ops": [...]}`` (``mamba-0.5.12``: SGLang 0.5.12's
``MambaRadixCache``, page size 1, from the copy ``.ci/sglang-anchor-up`` unpacks; one process
runs one release); each op is a list:

    ["insert", key, value, prev_prefix_len, state | null]
    ["match", key]
    ["lock", key, lock_id]            match, then inc_lock_ref on the matched node
    ["unlock", lock_id]
    ["evict", num_tokens, mamba_num]

and each observation ``[answer, sizes, freed_kv, freed_states]``: the op's answer (prefix
length, matched slots, branching point, mamba_exist), the sizes after it, and the slots and
state slots the cache gave back during it, sorted. The allocators are stand-ins that hand
nothing out and record every free: the slot ids come from the script.
"""

from __future__ import annotations

import json
import sys
import types
from array import array
from typing import Any

SG = types.SimpleNamespace()


def load_legacy() -> None:
    """Import SGLang 0.5.12's ``MambaRadixCache`` (unpacked by ``.ci/sglang-anchor-up`` in the
    environment, ``older/x_0.5.12``) into ``SG``."""
    sys.path.insert(0, f"{sys.prefix}/older/x_0.5.12")
    import importlib

    import transformers  # 0.5.12 registers model configs newer transformers already has

    register = transformers.AutoConfig.register

    def _register(model_type: Any, config: Any, exist_ok: bool = False) -> Any:
        return register(model_type, config, exist_ok=True)

    transformers.AutoConfig.register = staticmethod(_register)
    mrc = importlib.import_module("sglang.srt.mem_cache.mamba_radix_cache")
    SG.legacy = mrc
    SG.legacy_alloc = importlib.import_module("sglang.srt.mem_cache.allocator")


def load_sglang(anchor_dir: str, legacy: bool = False) -> None:
    """Import SGLang's caches (after the CPU shim from ``anchor_dir``) into ``SG``; with
    ``legacy``, SGLang 0.5.12's instead of 0.5.23's."""
    sys.path.insert(0, anchor_dir)
    import importlib

    importlib.import_module("sglang_cpu_shim")  # before any sglang import
    if legacy:
        load_legacy()
    import torch
    from sglang.srt.mem_cache import memory_pool
    from sglang.srt.mem_cache.base_prefix_cache import (
        EvictParams,
        InsertParams,
        MatchPrefixParams,
    )
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

    SG.__dict__.update(torch=torch, memory_pool=memory_pool, EvictParams=EvictParams,
                       InsertParams=InsertParams, MatchPrefixParams=MatchPrefixParams,
                       CacheInitParams=CacheInitParams, RadixCache=RadixCache,
                       RadixKey=RadixKey)
    if legacy:
        return
    from sglang.srt.mem_cache.rust_tree_core import adapter
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
    from sglang.srt.mem_cache.unified_cache.components import mamba
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    SG.__dict__.update(adapter=adapter, ComponentType=ComponentType, mamba_component=mamba,
                       UnifiedRadixCache=UnifiedRadixCache)


class RecordingAllocator:
    """KV allocator stand-in: records what the cache frees."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.device = "cpu"
        self.freed: list[int] = []

    def free(self, idx: Any, *args: Any, **kwargs: Any) -> None:
        self.freed.extend(int(x) for x in idx.reshape(-1).tolist())

    free_segment = free
    free_full = free

    def available_size(self) -> int:
        return 0

    def mamba_full_cache_donor(self) -> None:
        return None


class RecordingStates:
    """Mamba slot allocator stand-in: records what the cache frees."""

    def __init__(self) -> None:
        self.freed: list[int] = []

    def free(self, idx: Any) -> None:
        self.freed.extend(int(x) for x in idx.reshape(-1).tolist())

    def alloc(self, n: int) -> None:
        raise AssertionError("the script never asks the cache to allocate a state")

    def available_size(self) -> int:
        return 1 << 30

    schedulable_available_size = available_size


def build_legacy(ps: int) -> tuple[Any, RecordingAllocator, RecordingStates]:
    """SGLang 0.5.12's ``MambaRadixCache`` over recording stand-ins (page size 1 only)."""
    cls = type("RecordingTokenAllocator", (RecordingAllocator, SG.legacy_alloc.TokenToKVPoolAllocator), {})
    alloc = cls(ps)
    SG.legacy.get_global_server_args = lambda: types.SimpleNamespace(mamba_cache_chunk_size=ps)
    states = RecordingStates()
    pool = types.SimpleNamespace(mamba_pool=states)
    cache = SG.legacy.MambaRadixCache(SG.CacheInitParams(
        disable=False, req_to_token_pool=pool, token_to_kv_pool_allocator=alloc, page_size=ps))
    return cache, alloc, states


def build(script: dict[str, Any]) -> tuple[Any, RecordingAllocator, RecordingStates | None]:
    ps = script["page_size"]
    if script["impl"] == "mamba-0.5.12":
        return build_legacy(ps)
    alloc = RecordingAllocator(ps)
    if script["impl"] == "radix":
        cache = SG.RadixCache(SG.CacheInitParams(disable=False, req_to_token_pool=None,
                                           token_to_kv_pool_allocator=alloc, page_size=ps,
                                           eviction_policy=script["policy"]))
        return cache, alloc, None
    comps: tuple[Any, ...] = (SG.ComponentType.FULL,)
    pool = None
    states = None
    extra_buffer = False
    if script["variant"] == "mamba":
        comps = (SG.ComponentType.FULL, SG.ComponentType.MAMBA)
        # configuration look-ups only (no algorithm change): checkpoints on every page
        exec_ns = types.SimpleNamespace(mamba=types.SimpleNamespace(
            mamba_max_states_per_path=-1, enable_mamba_extra_buffer_lazy=False))
        SG.mamba_component.mamba_cache_chunk_size = lambda: ps
        SG.mamba_component.mamba_checkpoint_grid = lambda page: page
        SG.mamba_component.get_exec = lambda: exec_ns
        SG.adapter.mamba_cache_chunk_size = lambda: ps
        SG.adapter.get_exec = lambda: exec_ns
        pool = object.__new__(SG.memory_pool.HybridReqToTokenPool)
        states = RecordingStates()
        pool.mamba_allocator = states
        extra_buffer = ps > 1  # SGLang allows page sizes > 1 only with the extra buffer
    cache = SG.UnifiedRadixCache(SG.CacheInitParams(
        disable=False, req_to_token_pool=pool, token_to_kv_pool_allocator=alloc,
        page_size=ps, eviction_policy=script["policy"], tree_components=comps,
        enable_mamba_extra_buffer=extra_buffer, tree_core_backend=script.get("core", "python")))
    return cache, alloc, states


def key(tokens: list[int]) -> Any:
    return SG.RadixKey(array("q", tokens))


def sizes(cache: Any, mamba: bool) -> list[int]:
    if isinstance(cache, SG.RadixCache):
        return [cache.evictable_size(), cache.protected_size()]
    out = [cache.full_evictable_size(), cache.full_protected_size()]
    if mamba:
        out += [cache.mamba_evictable_size(), cache.mamba_protected_size()]
    return out


def run(script: dict[str, Any]) -> list[Any]:
    cache, alloc, states = build(script)
    mamba = states is not None
    locks: dict[int, Any] = {}
    out = []
    for op in script["ops"]:
        alloc.freed = []
        if states is not None:
            states.freed = []
        kind = op[0]
        answer: Any = None
        if kind == "insert":
            _, toks, value, prev, state = op
            kw: dict[str, Any] = dict(key=key(toks), value=SG.torch.tensor(value, dtype=SG.torch.int64))
            if not isinstance(cache, SG.RadixCache):
                kw["prev_prefix_len"] = prev
            if state is not None:
                kw["mamba_value"] = SG.torch.tensor([state], dtype=SG.torch.int64)
            res = cache.insert(SG.InsertParams(**kw))
            answer = [res.prefix_len, bool(res.mamba_exist)]
        elif kind in ("match", "lock"):
            m = cache.match_prefix(SG.MatchPrefixParams(key=key(op[1])))
            if hasattr(m, "device_prefix_len"):
                n = m.device_prefix_len
                slots = cache.path_device_indices(m.last_device_node)[:n].tolist()
            else:  # 0.5.12 returns the slots themselves
                slots = m.device_indices.tolist()
                n = len(slots)
            answer = [n, slots, m.mamba_branching_seqlen if mamba else None]
            if kind == "lock":
                locks[op[2]] = (m.last_device_node, cache.inc_lock_ref(m.last_device_node))
        elif kind == "unlock":
            node, receipt = locks.pop(op[1])
            if hasattr(receipt, "to_dec_params"):
                cache.dec_lock_ref(node, receipt.to_dec_params())
            else:
                cache.dec_lock_ref(node)
        elif kind == "evict":
            r = cache.evict(SG.EvictParams(num_tokens=op[1], mamba_num=op[2]))
            answer = [r.num_tokens_evicted, r.mamba_num_evicted]
        else:
            raise ValueError(f"unknown op {op!r}")
        out.append([answer, sizes(cache, mamba), sorted(alloc.freed),
                    sorted(states.freed) if states is not None else []])
    return out


if __name__ == "__main__":
    scripts = json.load(sys.stdin)
    legacy = {s["impl"] == "mamba-0.5.12" for s in scripts}
    if len(legacy) > 1:
        raise SystemExit("one process runs either SGLang 0.5.23 or 0.5.12, not both")
    load_sglang(sys.argv[1], legacy=legacy.pop() if legacy else False)
    print(json.dumps([run(s) for s in scripts]))
