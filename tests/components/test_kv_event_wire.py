"""KV events on the wire (``components.event_wire``): what the library encodes decodes with the
engines' own schemas (written in ``tests/helpers/engine_kv_schemas.py`` from their documentation,
and SGLang 0.5.23's own classes when the anchor environment is built), with every field equal
to the event it came from; tenants and state checkpoints reach a router.

* the decode matrix: every event kind (KV store / removal in each medium, a state checkpoint's
  store / removal, ``AllBlocksCleared``) x (SGLang 0.5.23, vLLM current, vLLM's older arrays);
* ``namespace_labels`` for every namespace kind the library accepts;
* a router that decodes the batches of a seeded hybrid replay rebuilds the page set and
  computes each request's usable hit from it alone: it equals ``match_prefix``'s;
* bad arguments; the library without msgspec.
"""

from __future__ import annotations

import hashlib
import json
import random
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import msgspec
import pytest
import torch

from allocators import MambaStatePool, TokenAllocator
from allocators.lora import LoraUid
from components.event_wire import encode_batch
from components.events import (
    CPU,
    GPU,
    STATE_GROUP,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    namespace_labels,
)
from hicache import HiCacheConfig
from radix import CacheConfig, RadixCache
from tests.helpers.engine_kv_schemas import DECODERS, decodes
from tests.helpers.isolated import run_python
from tests.helpers.sglang_anchor import ANCHOR_DIR, ANCHOR_PY, anchor_missing

REPO = Path(__file__).resolve().parents[2]


def hybrid(host: bool = False, size: int = 64, states: int = 8) -> tuple[RadixCache, Any, Any]:
    kv = TokenAllocator(size)
    sp = MambaStatePool(states, num_layers=1, conv_state_shape=(1,), ssm_state_shape=(1,))
    hc = HiCacheConfig(hicache_ratio=2.0, load_back_threshold=1) if host else None
    cache = RadixCache(CacheConfig(enable_kv_cache_events=True), kv_allocator=kv,
                       state_allocator=sp, hicache=hc)
    return cache, kv, sp


def put(cache: RadixCache, kv: Any, sp: Any, key: list[int], extra_key: Any = None) -> None:
    """Insert ``key`` with a state at its end, freeing what the tree did not take."""
    m = cache.match_prefix(key, extra_key)
    if m.prefix_len == len(key):
        return
    fresh = kv.alloc(len(key) - m.prefix_len)
    slot = int(sp.alloc(1)[0])
    res = cache.insert(key, torch.cat([m.device_indices, fresh]), extra_key, state_slot=slot)
    taken = set(res.adopted_indices.tolist()) | set(res.revived_indices.tolist())
    left = [x for x in fresh.tolist() if x not in taken]
    if left:
        kv.free(torch.tensor(left, dtype=torch.int64))
    if not res.state_adopted:
        sp.free(torch.tensor([slot], dtype=torch.int64))


def every_kind() -> list[Any]:
    """One event of every kind the library emits: KV stores in both media, with an int LoRA
    id, an adapter uid and a salt; a state checkpoint's store and removal; KV removals in both
    media; ``AllBlocksCleared``."""
    cache, kv, sp = hybrid(host=True)
    evs: list[Any] = []
    put(cache, kv, sp, [1, 2, 3])
    put(cache, kv, sp, [4, 5], extra_key=7)
    put(cache, kv, sp, [6], extra_key=(LoraUid("sql", 3), "salt-a"))
    cache.poll_transfers()
    evs += cache.take_events()
    cache.evict_states(1)
    cache.evict(6)
    cache.evict_host(6)
    evs += cache.take_events()
    cache.reset()
    evs += cache.take_events()
    return evs


def kind(ev: Any) -> str:
    name = type(ev).__name__
    if isinstance(ev, AllBlocksCleared):
        return name
    group = "state" if ev.group_idx == STATE_GROUP else "kv"
    return f"{name}/{group}/{ev.medium}"


EVENTS = every_kind()
#: Which fields each schema carries, as the event's attributes.
CARRIED = {
    "sglang": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
               "medium", "cache_salt", "lora_name"),
    "vllm": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
             "medium", "lora_name", "group_idx"),
    "vllm_array": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                   "medium"),
}
#: The shape and state-group choice each schema is sent.
SENT = {"sglang": ("map", False), "vllm": ("map", True), "vllm_array": ("array", False)}


def test_the_sample_holds_every_kind() -> None:
    assert {kind(e) for e in EVENTS} == {
        "BlockStored/kv/GPU", "BlockStored/kv/CPU_PINNED", "BlockStored/state/GPU",
        "BlockRemoved/kv/GPU", "BlockRemoved/kv/CPU_PINNED", "BlockRemoved/state/GPU",
        "AllBlocksCleared"}
    stored = [e for e in EVENTS if isinstance(e, BlockStored)]
    assert {(e.lora_id, e.lora_name, e.cache_salt) for e in stored} == {
        (None, None, None), (7, None, None), (3, "sql", "salt-a")}


@pytest.mark.parametrize("schema", sorted(DECODERS))
def test_every_event_kind_decodes_with_every_field(schema: str) -> None:
    shape, state_group = SENT[schema]
    for ev in EVENTS:
        payload = encode_batch([ev], ts=12.5, dp_rank=1, shape=shape, state_group=state_group)
        assert decodes(schema, payload) is None, (kind(ev), decodes(schema, payload))
        batch = DECODERS[schema].decode(payload)
        assert batch.ts == 12.5
        assert (batch.attn_dp_rank if schema == "sglang" else batch.data_parallel_rank) == 1
        if getattr(ev, "group_idx", None) == STATE_GROUP and not state_group:
            assert batch.events == []  # left out: this schema has no group
            continue
        (got,) = batch.events
        assert type(got).__name__.endswith(type(ev).__name__), kind(ev)
        for f in CARRIED[schema]:
            if hasattr(ev, f):
                assert getattr(got, f) == getattr(ev, f), (kind(ev), f)


def test_the_map_shape_writes_the_required_nils() -> None:
    """What the engines' encoders write for an event without LoRA: every field declared
    without a default is present, nil included (the shape their decoders require)."""
    ev = next(e for e in EVENTS if isinstance(e, BlockStored) and e.lora_id is None
              and e.group_idx == 0)
    raw = msgspec.msgpack.decode(encode_batch([ev], ts=0.0))
    assert raw[0] == 0.0 and raw[2] is None
    (m,) = raw[1]
    assert m == {"type": "BlockStored", "block_hashes": ev.block_hashes,
                 "parent_block_hash": ev.parent_block_hash, "token_ids": ev.token_ids,
                 "block_size": 1, "lora_id": None, "medium": ev.medium, "lora_name": None,
                 "group_idx": 0} == ev.to_dict()
    arr = msgspec.msgpack.decode(encode_batch([ev], ts=0.0, shape="array"))
    assert arr == [0.0, [["BlockStored", ev.block_hashes, ev.parent_block_hash, ev.token_ids,
                          1, None, ev.medium]]]


def test_namespace_labels_of_every_namespace_kind() -> None:
    uid = LoraUid("chat", 5)
    assert namespace_labels(None) == (None, None, None)
    assert namespace_labels(3) == (3, None, None)
    assert namespace_labels("tenant-a") == (None, None, "tenant-a")
    assert namespace_labels(uid) == (5, "chat", None)
    assert namespace_labels((uid, "tenant-a")) == (5, "chat", "tenant-a")
    assert namespace_labels((2, "s", b"\x01\xff")) == (2, None, "s/01ff")
    assert namespace_labels(b"\x00\x10") == (None, None, "0010")
    assert namespace_labels(1.5) == (None, None, "1.5")
    assert namespace_labels(True) == (None, None, "True")  # a bool is not a LoRA id
    assert namespace_labels((uid, LoraUid("x", 1))) == (5, "chat", "LoraUid(name='x', serial=1, digest='')")
    # a name given to the cache for a namespace: that adapter's, no salt
    assert namespace_labels("lora-uuid-1", {"lora-uuid-1": "sql"}) == (None, "sql", None)
    assert namespace_labels(4, {4: "sql"}) == (4, "sql", None)
    assert namespace_labels([1], {4: "sql"}) == (None, None, "[1]")  # unhashable: not listed


def test_a_cache_publishes_its_tenants() -> None:
    kv = TokenAllocator(16)
    cache = RadixCache(CacheConfig(enable_kv_cache_events=True), kv_allocator=kv)
    for ek in ("salt-1", LoraUid("a", 2), (LoraUid("a", 2), "salt-1")):
        cache.insert([1, 2], kv.alloc(2), extra_key=ek)
    got = [(e.lora_id, e.lora_name, e.cache_salt) for e in cache.take_events()]
    assert got == [(None, None, "salt-1"), (2, "a", None), (2, "a", "salt-1")]
    assert cache.kv_events is not None
    cache.kv_events.lora_names = {"salt-1": "sql"}  # this namespace is an adapter's: later events
    cache.insert([1, 2, 3], torch.cat([cache.match_prefix([1, 2], "salt-1").device_indices,
                                       kv.alloc(1)]), extra_key="salt-1")
    assert [(e.lora_name, e.cache_salt) for e in cache.take_events()] == [("sql", None)]


# ---------------------------------------------------------------- a router on a hybrid model
@dataclass
class HybridRouter:
    """Decodes batches with vLLM's schema and keeps the device page set per group; its usable
    hit for a prompt is the longest chain of held KV pages ending at a held checkpoint."""

    kv: set[int]
    states: set[int]

    def apply(self, payload: bytes) -> None:
        for ev in DECODERS["vllm"].decode(payload).events:
            name = type(ev).__name__
            if name.endswith("AllBlocksCleared"):
                self.kv, self.states = set(), set()
                continue
            if ev.medium != GPU:
                continue
            target = self.states if ev.group_idx == STATE_GROUP else self.kv
            if name.endswith("BlockStored"):
                target.update(ev.block_hashes)
            else:
                target.difference_update(ev.block_hashes)

    def usable_hit(self, hashes: list[int]) -> tuple[int, int]:
        """(KV pages held from the start, of which usable: ending at a checkpoint)."""
        held = 0
        while held < len(hashes) and hashes[held] in self.kv:
            held += 1
        usable = held
        while usable and hashes[usable - 1] not in self.states:
            usable -= 1
        return held, usable


def ref_hashes(tokens: list[int]) -> list[int]:
    """Published hashes of ``tokens`` (page size 1, default namespace), from the documented
    formula (``components.events``)."""
    d = hashlib.sha256(b"hpc-l3/1\x00" + struct.pack("<I", 0) + b"N").digest()
    out = []
    for t in tokens:
        d = hashlib.sha256(d + struct.pack("<q", t)).digest()
        out.append(int.from_bytes(d[:8], "big", signed=True))
    return out


def test_a_router_counts_the_usable_hits_of_a_hybrid_model() -> None:
    cache, kv, sp = hybrid(size=48, states=5)
    router = HybridRouter(set(), set())
    rng = random.Random(35)
    stems = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 7], [8, 9]]
    overstated = 0
    for _ in range(300):
        key = list(rng.choice(stems))[: rng.randrange(1, 7)] + [
            rng.randrange(10, 13) for _ in range(rng.randrange(0, 3))]
        hashes = ref_hashes(key)
        held, usable = router.usable_hit(hashes)
        m = cache.match_prefix(key)
        assert usable == m.prefix_len, (key, held, usable, m.prefix_len)
        overstated += held > usable
        if rng.random() < 0.7:
            need = len(key) - m.prefix_len
            if kv.available_size() < need:
                cache.evict(need)
            if sp.available_size() < 1:
                cache.evict_states(1)
            if kv.available_size() >= need and sp.available_size() >= 1:
                put(cache, kv, sp, key)
        elif rng.random() < 0.5:
            cache.evict_states(1)
        router.apply(encode_batch(cache.take_events()))
    assert overstated > 0  # the KV pages alone would have overstated some hits


# ------------------------------------------------------------- SGLang's own classes (anchor)
ANCHOR_DECODE = """
import json, sys
sys.path.insert(0, sys.argv[1])
import sglang_cpu_shim
import msgspec
from sglang.srt.disaggregation.kv_events import KVEventBatch
dec = msgspec.msgpack.Decoder(KVEventBatch)
out = []
for hexed in json.load(sys.stdin):
    try:
        out.append(msgspec.to_builtins(dec.decode(bytes.fromhex(hexed))))
    except msgspec.ValidationError as e:
        out.append(str(e))
print(json.dumps(out))
"""


@pytest.mark.skipif(anchor_missing() is not None, reason=str(anchor_missing()))
def test_sglangs_own_classes_decode_every_kind() -> None:
    payloads = [encode_batch([e], ts=1.0, dp_rank=0, state_group=False) for e in EVENTS]
    proc = subprocess.run([str(ANCHOR_PY), "-c", ANCHOR_DECODE, str(ANCHOR_DIR)],
                          input=json.dumps([p.hex() for p in payloads]), text=True,
                          capture_output=True, timeout=300, check=True)
    got = json.loads(proc.stdout)
    for ev, batch in zip(EVENTS, got, strict=True):
        assert not isinstance(batch, str), (kind(ev), batch)
        if getattr(ev, "group_idx", None) == STATE_GROUP:
            assert batch[1] == []
            continue
        (m,) = batch[1]
        assert m["type"] == type(ev).__name__
        for f in CARRIED["sglang"]:
            if hasattr(ev, f) and (getattr(ev, f) is not None or f in m):
                assert m.get(f) == getattr(ev, f), (kind(ev), f)


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(("kwargs", "exc", "names"), [
    (dict(shape="json"), ValueError, "shape"),
    (dict(dp_rank=-1), ValueError, "dp_rank"),
    (dict(dp_rank=True), ValueError, "dp_rank"),
    (dict(ts="now"), TypeError, "ts"),
    (dict(state_group=1), TypeError, "state_group"),
])
def test_bad_arguments_are_refused_naming_them(kwargs: dict[str, Any], exc: type,
                                               names: str) -> None:
    with pytest.raises(exc, match=names):
        encode_batch(EVENTS[:1], **kwargs)


def test_bad_events_are_refused() -> None:
    with pytest.raises(TypeError, match="events"):
        encode_batch(cast(Any, "BlockStored"))
    with pytest.raises(TypeError, match="events"):
        encode_batch(cast(Any, [{"type": "BlockStored"}]))


def test_the_library_works_without_msgspec() -> None:
    """With msgspec unimportable the cache records events; only the wire module refuses, with
    an error saying what to install."""
    code = """
import sys
sys.modules['msgspec'] = None
import torch
from allocators import TokenAllocator
from radix import CacheConfig, RadixCache
kv = TokenAllocator(4)
c = RadixCache(CacheConfig(enable_kv_cache_events=True), kv_allocator=kv)
c.insert([1, 2], kv.alloc(2))
assert c.take_events()[0].to_dict()['lora_id'] is None
import radix.sglang as sg
f = sg.RadixCache.create_simulated(enable_kv_cache_events=True)
f.insert(sg.RadixKey([1, 2]), None)
assert type(f.take_events()[0]).__module__ == 'components.events'  # the library's own
try:
    import components.event_wire
except ImportError as e:
    print('refused:', e)
"""
    assert "refused: components.event_wire needs msgspec" in run_python(code)


def test_media_constants() -> None:
    assert (GPU, CPU) == ("GPU", "CPU_PINNED")
    assert BlockRemoved([1]).to_dict() == {"type": "BlockRemoved", "block_hashes": [1],
                                           "medium": "GPU", "group_idx": 0}
