"""SGLang's ``HiCacheStorage`` interface over the library's backends
(``hicache.storage.sglang_adapter``): the interface as SGLang 0.5.23 documents it, pages moved
between a host pool and the store, and (anchor environment) SGLang's own ``dynamic`` loader
building the adapter and moving pages with it."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from hicache.storage import FileStore, register_backend, unregister_backend
from hicache.storage.sglang_adapter import SGLangStorageAdapter, page_key_of, sglang_tag
from tests.helpers.sglang_anchor import ANCHOR_DIR, ANCHOR_PY, anchor_missing
from tests.helpers.sglang_host_pool import HostPool

REPO = Path(__file__).resolve().parents[2]

#: SGLang 0.5.23's ``HiCacheStorage`` calls a backend answers, with their parameters (from
#: its documented base class).
INTERFACE = {
    "register_mem_pool_host": ["mem_pool_host"],
    "batch_get_v1": ["keys", "host_indices", "extra_info"],
    "batch_set_v1": ["keys", "host_indices", "extra_info"],
    "get": ["key", "target_location", "target_sizes"],
    "batch_get": ["keys", "target_locations", "target_sizes"],
    "set": ["key", "value", "target_location", "target_sizes"],
    "batch_set": ["keys", "values", "target_locations", "target_sizes"],
    "exists": ["key"],
    "batch_exists": ["keys", "extra_info"],
    "clear": [],
    "get_stats": [],
}


def storage_config(extra: dict[str, Any], model: str = "org/model", tp_rank: int = 0) -> Any:
    """The fields of SGLang's ``HiCacheStorageConfig`` the adapter reads."""
    return SimpleNamespace(tp_rank=tp_rank, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0,
                           attn_cp_size=1, is_mla_model=False, model_name=model,
                           extra_config=extra)


@pytest.fixture
def adapters(caches: list[Any]) -> list[SGLangStorageAdapter]:
    """The adapters a test builds, each ``close()``d at teardown (the shared ``caches``)."""
    return caches


def engine(tmp_path: Any, made: list[SGLangStorageAdapter], **kw: Any) -> tuple[SGLangStorageAdapter, HostPool]:
    a = SGLangStorageAdapter(storage_config({"hpc_backend": "file",
                                             "hicache_storage_dir": str(tmp_path)}, **kw), {})
    pool = HostPool(32, 4)
    a.register_mem_pool_host(pool)
    made.append(a)
    return a, pool


def test_the_adapter_has_sglangs_interface() -> None:
    for name, params in INTERFACE.items():
        sig = inspect.signature(getattr(SGLangStorageAdapter, name))
        assert list(sig.parameters)[1:] == params, name


def test_pages_move_between_two_engines_through_the_store(tmp_path: Any, adapters: list[Any]) -> None:
    a, pa = engine(tmp_path, adapters)
    b, pb = engine(tmp_path, adapters)
    gen = torch.Generator().manual_seed(1)
    pa.buf.copy_(torch.randn(pa.buf.shape, generator=gen).to(torch.float16))
    keys = ["p0", "p1", "p2"]
    src = torch.arange(4, 16)  # pages at slots 4, 8, 12
    assert a.batch_set_v1(keys, src) == [True, True, True]
    assert b.batch_exists(keys + ["p3"]) == 3 and b.exists("p1") and not b.exists("p3")
    dst = torch.arange(20, 32)
    assert b.batch_get_v1(keys, dst) == [True, True, True]
    assert torch.equal(pb.buf[20:32], pa.buf[4:16]) and not pb.buf[:20].any()
    # A missing key ends the run: the pages after it are not loaded.
    pb.buf.zero_()
    assert b.batch_get_v1(["p0", "nope", "p2"], dst) == [True, False, False]
    assert torch.equal(pb.buf[20:24], pa.buf[4:8]) and not pb.buf[24:].any()
    # Stored again: held already, still True.
    assert a.batch_set_v1(keys[:1], src[:4]) == [True]


def test_another_model_or_shard_reads_nothing(tmp_path: Any, adapters: list[Any]) -> None:
    a, pa = engine(tmp_path, adapters)
    pa.buf.fill_(1.5)
    assert a.batch_set_v1(["k"], torch.arange(0, 4)) == [True]
    other_model, _ = engine(tmp_path, adapters, model="org/other")
    other_rank, _ = engine(tmp_path, adapters, tp_rank=1)
    for o in (other_model, other_rank):
        assert o.batch_get_v1(["k"], torch.arange(0, 4)) == [False]
    assert sglang_tag(storage_config({})) == "sglang:org-model:tp0of2"
    assert page_key_of("k") == "8254c329a92850f6d539dd376f4816ee2764517da5e0235514af433164480d7a"


def test_flat_tensor_calls(tmp_path: Any, adapters: list[Any]) -> None:
    a, _ = engine(tmp_path, adapters)
    value = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert a.set("t", value) is True
    target = torch.zeros(3, 4)
    assert a.get("t", target) is target and torch.equal(target, value)
    assert a.get("missing") is None
    assert a.get("t", torch.zeros(5)) is None  # another size: a miss
    raw = a.get("t")
    assert raw is not None and raw.dtype == torch.uint8 and raw.numel() == 48
    assert a.batch_set(["u", "v"], [value, value + 1]) is True
    got = a.batch_get(["u", "v", "w"], [torch.zeros(3, 4), torch.zeros(3, 4), torch.zeros(3, 4)])
    assert got[0] is not None and torch.equal(got[0], value)
    assert got[1] is not None and torch.equal(got[1], value + 1) and got[2] is None
    stats = a.get_stats()
    assert stats["set_calls"] == 2 and stats["get_calls"] >= 4


def test_registered_backends_and_bad_settings(tmp_path: Any, adapters: list[Any]) -> None:
    made: list[FileStore] = []

    def factory(config: Any, tag: str) -> FileStore:
        made.append(FileStore(str(tmp_path / "reg"), tag=tag))
        return made[-1]

    register_backend("adapter-test", factory)
    try:
        a = SGLangStorageAdapter(storage_config({"hpc_backend": "adapter-test",
                                                 "backend_name": "hpc", "module_path": "m",
                                                 "class_name": "c"}), {})
        adapters.append(a)
        assert a.backend is made[0] and a.backend.tag == "sglang:org-model:tp0of2"
    finally:
        unregister_backend("adapter-test")
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['colour'\]"):
        SGLangStorageAdapter(storage_config({"colour": 1}))
    with pytest.raises(ValueError, match="hicache_storage_backend='nope' is unknown"):
        SGLangStorageAdapter(storage_config({"hpc_backend": "nope"}))
    with pytest.raises(ValueError, match="hicache_storage_dir"):
        SGLangStorageAdapter(storage_config({"hpc_backend": "file"}))
    with pytest.raises(TypeError, match="needs storage_config"):
        SGLangStorageAdapter()
    not_a_backend: Any = object()
    with pytest.raises(TypeError, match="backend must be a hicache.storage.StorageBackend"):
        SGLangStorageAdapter(backend=not_a_backend)
    wrapped = SGLangStorageAdapter(backend=FileStore(str(tmp_path / "w")))
    with pytest.raises(RuntimeError, match="register_mem_pool_host"):
        wrapped.batch_get_v1(["k"], torch.arange(4))
    wrapped.register_mem_pool_host(HostPool(8, 4))
    with pytest.raises(ValueError, match="host_indices must hold"):
        wrapped.batch_set_v1(["k"], torch.arange(3))


# ---------------------------------------------------------------- SGLang's own loader (anchor)
ANCHOR_SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1])
import sglang_cpu_shim
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from tests.helpers.sglang_host_pool import HostPool
job = json.load(sys.stdin)
cfg = HiCacheStorageConfig(tp_rank=0, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0,
                           attn_cp_size=1, is_mla_model=False, enable_storage_metrics=False,
                           is_page_first_layout=True, model_name="org/model",
                           extra_config=job["extra"])
backend = StorageBackendFactory.create_backend("dynamic", cfg, None)
pool = HostPool(32, 4)
backend.register_mem_pool_host(pool)
gen = torch.Generator().manual_seed(9)
pool.buf.copy_(torch.randn(pool.buf.shape, generator=gen).to(torch.float16))
wrote = backend.batch_set_v1(["a", "b"], torch.arange(0, 8))
pool2 = HostPool(32, 4)
backend.register_mem_pool_host(pool2)
read = backend.batch_get_v1(["a", "b", "c"], torch.arange(8, 20))
print(json.dumps({"base": isinstance(backend, HiCacheStorage), "type": type(backend).__name__,
                  "wrote": wrote, "read": read, "exists": backend.batch_exists(["a", "b", "c"]),
                  "equal": bool(torch.equal(pool2.buf[8:16], pool.buf[0:8])),
                  "pages": pool.buf[0:8].flatten().tolist()}))
"""


@pytest.mark.skipif(anchor_missing() is not None, reason=str(anchor_missing()))
def test_sglangs_dynamic_loader_builds_the_adapter_and_moves_pages(tmp_path: Any,
                                                                  adapters: list[Any]) -> None:
    extra = {"backend_name": "hpc", "module_path": "hicache.storage.sglang_dynamic",
             "class_name": "HiCacheStorageAdapter", "hpc_backend": "file",
             "hicache_storage_dir": str(tmp_path)}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(ANCHOR_DIR)])}
    proc = subprocess.run([str(ANCHOR_PY), "-c", ANCHOR_SCRIPT, str(ANCHOR_DIR)],
                          input=json.dumps({"extra": extra}), text=True, capture_output=True,
                          timeout=300, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["base"] is True and got["type"] == "HiCacheStorageAdapter"
    assert got["wrote"] == [True, True] and got["read"] == [True, True, False]
    assert got["exists"] == 2 and got["equal"] is True
    # This process reads what SGLang's loader wrote, bit for bit.
    b, pb = engine(tmp_path, adapters)
    assert b.batch_get_v1(["a", "b"], torch.arange(0, 8)) == [True, True]
    assert pb.buf[0:8].flatten().tolist() == got["pages"]
