"""SGLang's HiCache settings by name (host memory mode / fraction, the ``timeout`` prefetch
default, extra configs in JSON / YAML / TOML, the generic extra-config keys) and the
storage-backend registry (names, factories, instances)."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import hicache.host_pools as host_pools
from allocators import KVPool, MambaStatePool, TokenAllocator
from hicache import HiCacheConfig
from hicache.storage import FileStore, StorageBackend, register_backend, unregister_backend
from tests.storage.test_storage_common import (
    L3,
    WAIT_S,
    fresh_model,
    make,
    put_random,
    wrap_flaky,
)


# ====================================================================== host memory
def test_host_memory_mode_defaults_to_cache_and_refuses_buffer_only() -> None:
    assert HiCacheConfig().hicache_host_memory_mode == "cache"
    assert HiCacheConfig().hicache_host_memory_fraction == 0.8
    with pytest.raises(ValueError, match="hicache_host_memory_mode='buffer_only'"):
        HiCacheConfig(hicache_host_memory_mode="buffer_only")
    with pytest.raises(ValueError, match="hicache_host_memory_mode='ram' is unknown"):
        HiCacheConfig(hicache_host_memory_mode="ram")


@pytest.mark.parametrize("bad", [0, -0.1, 1.5, float("nan"), True, "0.5"])
def test_host_memory_fraction_refuses_values_outside_0_1(bad: Any) -> None:
    with pytest.raises(ValueError, match="hicache_host_memory_fraction must be a number in"):
        HiCacheConfig(hicache_host_memory_fraction=bad)


def test_host_memory_fraction_caps_a_ratio_sized_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = KVPool(8, 2, 1, 2, torch.float32)
    kv = TokenAllocator(8, pool=pool)
    per_token = 2 * 2 * 1 * 2 * 4  # K and V x layers x heads x head_dim x 4 bytes
    assert pool.bytes_per_token == per_token
    monkeypatch.setattr(host_pools, "host_memory_budget", lambda: 40 * per_token)
    # ratio 4 asks 32 tokens; half of 40 tokens' bytes holds 20.
    assert host_pools.mirror_kv(kv, HiCacheConfig(hicache_ratio=4.0, hicache_host_memory_fraction=0.5)).size == 20
    # fraction 1: 40 tokens fit, the ratio's 32 stand; None: no cap.
    assert host_pools.mirror_kv(kv, HiCacheConfig(hicache_ratio=4.0, hicache_host_memory_fraction=1.0)).size == 32
    monkeypatch.setattr(host_pools, "host_memory_budget", lambda: 4 * per_token)
    assert host_pools.mirror_kv(kv, HiCacheConfig(hicache_ratio=4.0, hicache_host_memory_fraction=None)).size == 32
    # hicache_size given: the fraction does not apply (as SGLang's).
    cfg = HiCacheConfig(hicache_size=16 * per_token / 1e9)
    assert host_pools.mirror_kv(kv, cfg).size == 16
    with pytest.raises(ValueError, match="hicache_host_memory_fraction=0.8"):
        host_pools.mirror_kv(kv, HiCacheConfig(hicache_ratio=4.0))


def test_host_memory_fraction_caps_the_state_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    sp = MambaStatePool(4, num_layers=2, conv_state_shape=(3,), ssm_state_shape=(2, 2))
    per_slot = 2 * (3 + 4) * 4
    assert sp.bytes_per_slot == per_slot
    monkeypatch.setattr(host_pools, "host_memory_budget", lambda: 6 * per_slot)
    assert host_pools.mirror_state(sp, HiCacheConfig(hicache_ratio=3.0, hicache_host_memory_fraction=1.0)).size == 6
    assert host_pools.mirror_state(sp, HiCacheConfig(hicache_ratio=3.0, hicache_host_memory_fraction=None)).size == 12


# ====================================================================== prefetch
def test_prefetch_policy_defaults_to_timeout_as_sglang() -> None:
    cfg = HiCacheConfig(hicache_storage_backend="file", hicache_storage_dir="/tmp/x",
                        hicache_prefetch_timeout_s=0.3)
    assert cfg.hicache_storage_prefetch_policy == "timeout"
    assert cfg.prefetch_wait_s(4096) == 0.3  # no generic keys: the library's own timeout


@pytest.mark.parametrize("extra,tokens,want", [
    ({"prefetch_timeout_base": 2, "prefetch_timeout_per_ki_token": 0.5}, 2048, 2 + 0.5 * 2),
    ({"prefetch_timeout_base": 0.1}, 4096, 0.1 + 0.25 * 4),  # per_ki at SGLang's 0.25
    ({"prefetch_timeout_per_ki_token": 1}, 512, 1.0 + 0.5),  # base at SGLang's 1
])
def test_generic_timeout_keys_set_the_timeout_wait(tmp_path: Any, extra: dict[str, Any],
                                                   tokens: int, want: float) -> None:
    cfg = HiCacheConfig(hicache_storage_backend="file", hicache_storage_dir=str(tmp_path),
                        hicache_storage_backend_extra_config=json.dumps(extra))
    assert cfg.prefetch_wait_s(tokens) == pytest.approx(want)
    assert cfg.extra_config() == {}  # the file backend sees none of them
    other = HiCacheConfig(hicache_storage_backend="file", hicache_storage_dir=str(tmp_path),
                          hicache_storage_prefetch_policy="wait_complete",
                          hicache_storage_timeout_s=3.0,
                          hicache_storage_backend_extra_config=json.dumps(extra))
    assert other.prefetch_wait_s(tokens) == 3.0
    best = HiCacheConfig(hicache_storage_backend="file", hicache_storage_dir=str(tmp_path),
                         hicache_storage_prefetch_policy="best_effort",
                         hicache_storage_backend_extra_config=json.dumps(extra))
    assert best.prefetch_wait_s(tokens) is None


@pytest.mark.parametrize("extra,match", [
    ({"prefetch_timeout_base": "1"}, "prefetch_timeout_base must be a finite number"),
    ({"prefetch_timeout_base": -1}, "prefetch_timeout_base must be a finite number"),
    ({"prefetch_timeout_per_ki_token": True}, "prefetch_timeout_per_ki_token must be"),
    ({"check_server": "yes"}, "check_server must be true or false"),
    ({"prefetch_threshold": 256}, "not accepted by hicache_storage_backend='file'"),
])
def test_generic_keys_are_checked_when_the_config_is_built(tmp_path: Any, extra: dict[str, Any],
                                                           match: str) -> None:
    with pytest.raises(ValueError, match=match):
        HiCacheConfig(hicache_storage_backend="file", hicache_storage_dir=str(tmp_path),
                      hicache_storage_backend_extra_config=json.dumps(extra))


def test_timeout_keys_bound_a_match_in_the_tier(tmp_path: Any, caches: list[L3]) -> None:
    where, model = str(tmp_path), fresh_model()
    gen = torch.Generator().manual_seed(3)
    a = make("file", where=where, page_size=2, model=model)
    # 8 tokens: 0.05 + 8/1024 * 0 s; hicache_prefetch_timeout_s (30 s) would hang the test.
    b = make("file", where=where, page_size=2, model=model, prefetch="timeout", timeout_s=30.0,
             extra={"prefetch_timeout_base": 0.05, "prefetch_timeout_per_ki_token": 0})
    caches += [a, b]
    key = list(range(500, 508))
    put_random(a, key, gen)
    assert a.cache.flush_storage(WAIT_S)
    flaky = wrap_flaky(b)
    flaky.gate.clear()
    assert b.cache.match_prefix(key).host_hit_length == 0
    assert b.cache.stats()["l3_prefetch_timeouts"] == 1
    flaky.gate.set()
    assert b.cache.flush_storage(WAIT_S)
    assert b.cache.match_prefix(key).host_hit_length == 8


# ====================================================================== extra-config files
def test_extra_config_files_json_yaml_toml_read_the_same(tmp_path: Any) -> None:
    files = {
        "c.json": '{"prefetch_timeout_base": 0.5, "check_server": true}',
        "c.yaml": "prefetch_timeout_base: 0.5\ncheck_server: true\n",
        "c.yml": "prefetch_timeout_base: 0.5\ncheck_server: true\n",
        "c.toml": "prefetch_timeout_base = 0.5\ncheck_server = true\n",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
        cfg = HiCacheConfig(hicache_storage_backend="file", hicache_storage_dir=str(tmp_path / "d"),
                            hicache_storage_backend_extra_config="@" + str(tmp_path / name))
        assert cfg.generic_extra() == {"prefetch_timeout_base": 0.5,
                                       "prefetch_timeout_per_ki_token": 0.25,
                                       "check_server": True}, name
        assert cfg.prefetch_wait_s(1024) == 0.75
    (tmp_path / "c.ini").write_text("x=1")
    with pytest.raises(ValueError, match="must be .json, .yaml / .yml or .toml"):
        HiCacheConfig(hicache_storage_backend="file", hicache_storage_dir=str(tmp_path),
                      hicache_storage_backend_extra_config="@" + str(tmp_path / "c.ini"))
    (tmp_path / "bad.yaml").write_text("a: [1,\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        HiCacheConfig(hicache_storage_backend="file", hicache_storage_dir=str(tmp_path),
                      hicache_storage_backend_extra_config="@" + str(tmp_path / "bad.yaml"))


def test_yaml_without_pyyaml_says_what_to_install(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "c.yaml").write_text("check_server: false\n")
    monkeypatch.setitem(sys.modules, "yaml", None)
    with pytest.raises(ValueError, match="pip install pyyaml"):
        HiCacheConfig(hicache_storage_backend="file", hicache_storage_dir=str(tmp_path),
                      hicache_storage_backend_extra_config="@" + str(tmp_path / "c.yaml"))


# ====================================================================== registry
class Unreachable(FileStore):
    """A file store whose every presence question fails (a server that is down)."""

    def _exists_raw(self, keys: Any) -> list[bool]:
        raise OSError("connection refused")


@pytest.fixture
def registered() -> Iterator[list[str]]:
    names: list[str] = []
    yield names
    for n in names:
        unregister_backend(n)


def test_a_registered_backend_carries_pages_between_engines(tmp_path: Any, caches: list[L3],
                                                            registered: list[str]) -> None:
    seen: list[tuple[str, str]] = []

    def factory(config: HiCacheConfig, tag: str) -> StorageBackend:
        assert config.hicache_storage_url is not None
        seen.append((config.hicache_storage_url, tag))
        return FileStore(config.hicache_storage_url, tag=tag)

    register_backend("my-files", factory)
    registered.append("my-files")
    where, model = str(tmp_path), fresh_model()
    gen = torch.Generator().manual_seed(5)
    a = make("my-files", where=where, page_size=2, model=model)
    b = make("my-files", where=where, page_size=2, model=model)
    caches += [a, b]
    key = list(range(100, 110))
    w = put_random(a, key, gen)
    assert a.cache.flush_storage(WAIT_S)
    m = b.cache.match_prefix(key)
    assert m.host_hit_length == 10 and len(seen) == 2 and seen[0] == seen[1]
    b.cache.load_back(m.last_host_node)
    got = b.cache.match_prefix(key).device_indices
    assert torch.equal(b.pool.k_all[:, got], w.k) and torch.equal(b.pool.v_all[:, got], w.v)


def test_register_backend_refuses_bad_entries(registered: list[str]) -> None:
    def factory(config: HiCacheConfig, tag: str) -> StorageBackend:
        return FileStore("/tmp/unused", tag=tag)

    anything: Any = 3
    with pytest.raises(TypeError, match="register_backend name must be a str"):
        register_backend(anything, factory)
    with pytest.raises(ValueError, match="register_backend name must be a non-empty"):
        register_backend(" ", factory)
    with pytest.raises(ValueError, match="register_backend name 'file' is taken"):
        register_backend("file", factory)
    with pytest.raises(TypeError, match="register_backend factory must be a callable"):
        register_backend("x", anything)
    anything = FileStore("/tmp/unused")
    with pytest.raises(TypeError, match="register_backend factory must be a callable"):
        register_backend("x", anything)
    register_backend("x", factory)
    registered.append("x")
    with pytest.raises(ValueError, match="register_backend name 'x' is taken"):
        register_backend("x", factory)
    with pytest.raises(ValueError, match=r"hicache_storage_backend='nope' is unknown; .*'x'"):
        HiCacheConfig(hicache_storage_backend="nope")


def test_bad_factory_results_and_tags_are_refused_at_build(tmp_path: Any, caches: list[L3],
                                                           registered: list[str]) -> None:
    def not_a_backend(config: HiCacheConfig, tag: str) -> Any:
        return object()

    register_backend("not-a-backend", not_a_backend)
    register_backend("wrong-tag", lambda config, tag: FileStore(str(tmp_path), tag="other"))
    registered += ["not-a-backend", "wrong-tag"]
    with pytest.raises(TypeError, match="'not-a-backend' returned object"):
        make("not-a-backend", where=str(tmp_path))
    with pytest.raises(ValueError, match="'wrong-tag' built its backend with tag 'other'"):
        make("wrong-tag", where=str(tmp_path))


def test_a_backend_instance_is_taken_directly(tmp_path: Any) -> None:
    from hicache.storage import layout_tag
    from radix import CacheConfig, RadixCache

    pool = KVPool(16, 2, 1, 2, torch.float32)
    kv = TokenAllocator(16, pool=pool)
    tag = layout_tag("m", 1, pool, None)
    store = FileStore(str(tmp_path), tag=tag)
    cfg = HiCacheConfig(hicache_storage_backend=store, hicache_storage_model="m")
    cache = RadixCache(CacheConfig(), kv_allocator=kv, hicache=cfg)
    assert cache.storage is not None and cache.storage.backend is store
    cache.close_storage()
    bad = HiCacheConfig(hicache_storage_backend=FileStore(str(tmp_path), tag="x"),
                        hicache_storage_model="m")
    with pytest.raises(ValueError, match="hicache_storage_backend instance built its backend with tag 'x'"):
        RadixCache(CacheConfig(), kv_allocator=TokenAllocator(16, pool=KVPool(16, 2, 1, 2, torch.float32)),
                   hicache=bad)


def test_check_server_fails_the_build_when_the_store_does_not_answer(tmp_path: Any, caches: list[L3],
                                                                     registered: list[str]) -> None:
    register_backend("down", lambda config, tag: Unreachable(str(tmp_path), tag=tag))
    registered.append("down")
    with pytest.raises(ConnectionError, match="check_server: the file storage backend did not answer"):
        make("down", where=str(tmp_path), extra={"check_server": True})
    caches.append(make("down", where=str(tmp_path), extra={"check_server": False}))  # not asked
    ok = make("file", where=str(tmp_path / "f"), extra={"check_server": True})
    caches.append(ok)


# ====================================================================== dynamic (by module path)
class ConfigStore(FileStore):
    """A backend class taking ``(config, tag)``, as the dynamic backend calls it."""

    def __init__(self, config: HiCacheConfig, tag: str) -> None:
        options = config.extra_config()
        super().__init__(options["root"], tag=tag)


def make_dynamic(config: HiCacheConfig, tag: str) -> Any:
    return config.extra_config()["answer"]


def test_the_dynamic_backend_loads_a_factory_by_module_path(tmp_path: Any, caches: list[L3]) -> None:
    extra = {"backend_name": "mine", "module_path": __name__, "class_name": "ConfigStore",
             "root": str(tmp_path)}
    where, model = str(tmp_path), fresh_model()
    gen = torch.Generator().manual_seed(8)
    a = make("dynamic", where=where, page_size=2, model=model, extra=extra)
    b = make("dynamic", where=where, page_size=2, model=model, extra=extra)
    caches += [a, b]
    assert a.cache.storage is not None and type(a.cache.storage.backend) is ConfigStore
    key = list(range(300, 306))
    put_random(a, key, gen)
    assert a.cache.flush_storage(WAIT_S)
    assert b.cache.match_prefix(key).host_hit_length == 6


@pytest.mark.parametrize("extra,err,match", [
    ({"module_path": "m", "class_name": "c"}, ValueError, "needs extra config backend_name"),
    ({"backend_name": "x", "module_path": "no.such.module", "class_name": "c"}, ValueError,
     "module_path 'no.such.module' does not import"),
    ({"backend_name": "x", "module_path": "json", "class_name": "Nope"}, ValueError,
     "class_name 'Nope': json has no callable"),
    ({"backend_name": "x", "module_path": "json", "class_name": "JSONDecoder"}, ValueError,
     "is a class that is not a hicache.storage.StorageBackend"),
])
def test_the_dynamic_backend_refuses_bad_module_paths(extra: dict[str, Any], err: type,
                                                      match: str) -> None:
    with pytest.raises(err, match=match):
        HiCacheConfig(hicache_storage_backend="dynamic",
                      hicache_storage_backend_extra_config=json.dumps(extra))


def test_the_dynamic_backend_refuses_a_bad_factory_result(tmp_path: Any) -> None:
    extra = {"backend_name": "x", "module_path": __name__, "class_name": "make_dynamic",
             "answer": 42}
    with pytest.raises(TypeError, match="the dynamic backend 'x' returned int"):
        make("dynamic", where=str(tmp_path), extra=extra)


def test_host_memory_fraction_caps_the_kv_and_state_pools_together(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from radix import RadixCache

    pool = KVPool(16, 2, 1, 2, torch.float32)  # 32 bytes per token
    sp = MambaStatePool(4, num_layers=2, conv_state_shape=(2,), ssm_state_shape=(2, 2))
    assert (pool.bytes_per_token, sp.bytes_per_slot) == (32, 48)  # 2 x (2 + 4) x 4
    monkeypatch.setattr(host_pools, "host_memory_budget", lambda: 2410)
    cache = RadixCache(kv_allocator=TokenAllocator(16, pool=pool), state_allocator=sp,
                       hicache=HiCacheConfig(hicache_ratio=4.0))
    hc = cache.hicache
    assert hc is not None and hc.host_state is not None
    # Per unit of ratio: 16 tokens x (32 bytes + 13 of free list) + 4 states x (48 + 13) = 964
    # bytes; 0.8 x 2410 = 1928 bytes hold one ratio of 2.0 for both: 32 tokens and 8 states.
    # (Each capped alone: 1928 // 32 = 60 tokens and 16 states, 2688 bytes of rows in all.)
    assert (hc.host_kv.size, hc.host_state.size) == (32, 8)
    assert hc.config.hicache_ratio == 2.0
    # a budget where the shared ratio leaves a pool no larger than its device pool
    monkeypatch.setattr(host_pools, "host_memory_budget", lambda: 1000)  # ratio 800 / 964
    with pytest.raises(ValueError, match="hicache_host_memory_fraction=0.8"):
        RadixCache(kv_allocator=TokenAllocator(16, pool=KVPool(16, 2, 1, 2, torch.float32)),
                   state_allocator=MambaStatePool(4, 2, (2,), (2, 2)),
                   hicache=HiCacheConfig(hicache_ratio=4.0))


def test_host_memory_fraction_counts_the_swa_pool_too(monkeypatch: pytest.MonkeyPatch) -> None:
    from allocators import SWAAllocator
    from radix import CacheConfig, RadixCache

    full, swa = KVPool(16, 2, 1, 2, torch.float32), KVPool(8, 1, 1, 2, torch.float32)
    assert (full.bytes_per_token, swa.bytes_per_token) == (32, 16)
    kv = SWAAllocator(16, 8, 1, full_pool=full, swa_pool=swa)
    monkeypatch.setattr(host_pools, "host_memory_budget", lambda: 2380)
    cache = RadixCache(CacheConfig(sliding_window_size=4), kv_allocator=kv,
                       hicache=HiCacheConfig(hicache_ratio=4.0))
    pools = cache.hicache.pools  # type: ignore[union-attr]
    # 0.8 x 2380 = 1904 bytes over 16 x (32 + 13) + 8 x (16 + 13) = 952 per unit of ratio:
    # 2.0 -> 32 full tokens and 16 SWA tokens (alone: 59 and 32)
    assert (pools["kv"].host.size, pools["swa"].host.size) == (32, 16)
