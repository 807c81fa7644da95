"""Sizes checked against memory before allocation (``allocators.memory``): the available figure
read as the kernel writes it (``/proc/meminfo``, the cgroup v2 limit), and every pool
constructor refusing a size past it with a ``MemoryBudgetError`` naming its arguments, before
allocating anything."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import allocators.memory as memory
from allocators import KVPool, MambaStatePool, PagedAllocator, SWAAllocator, TokenAllocator
from allocators.lora import LoraMemoryPool
from allocators.memory import (
    HOST,
    UNCHECKED_BYTES,
    MemoryBudgetError,
    available_host_memory,
    available_memory,
    check_memory,
)
from hicache import host_pools

MIB = 1 << 20


def fake_host(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, avail_kib: int,
              cgroup: tuple[str, int] | None = None) -> None:
    """Point the readings at files of this test: ``MemAvailable: avail_kib kB`` and, when
    given, a cgroup ``memory.max`` / ``memory.current`` pair."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal:       99999999 kB\nMemFree:          1234 kB\n"
                       f"MemAvailable:   {avail_kib} kB\nBuffers:           0 kB\n")
    monkeypatch.setattr(memory, "MEMINFO", str(meminfo))
    limit, current = tmp_path / "memory.max", tmp_path / "memory.current"
    if cgroup is not None:
        limit.write_text(cgroup[0] + "\n")
        current.write_text(f"{cgroup[1]}\n")
    monkeypatch.setattr(memory, "CGROUP_MAX", str(limit))
    monkeypatch.setattr(memory, "CGROUP_CURRENT", str(current))


# ------------------------------------------------------------------ the available figure
def test_host_figure_is_mem_available_in_bytes(monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path) -> None:
    fake_host(monkeypatch, tmp_path, 1000)
    assert available_host_memory() == 1000 * 1024
    assert available_memory(HOST) == 1000 * 1024


def test_host_figure_is_bounded_by_the_cgroup_limit(monkeypatch: pytest.MonkeyPatch,
                                                     tmp_path: Path) -> None:
    fake_host(monkeypatch, tmp_path, 1000, cgroup=("600000", 100_000))
    assert available_host_memory() == 500_000  # 600,000 - 100,000 < 1,024,000
    fake_host(monkeypatch, tmp_path, 100, cgroup=("600000", 100_000))
    assert available_host_memory() == 102_400  # MemAvailable is the smaller
    fake_host(monkeypatch, tmp_path, 100, cgroup=("600000", 700_000))
    assert available_host_memory() == 0  # over its limit already
    fake_host(monkeypatch, tmp_path, 100, cgroup=("max", 700_000))
    assert available_host_memory() == 102_400  # no limit set


def test_unknown_figures_refuse_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(memory, "MEMINFO", str(tmp_path / "absent"))
    monkeypatch.setattr(memory, "CGROUP_MAX", str(tmp_path / "absent.max"))
    assert available_host_memory() is None
    check_memory(1 << 60, "KVPool(size=...)", HOST)  # nothing known: accepted
    assert available_memory(torch.device("meta")) is None


def test_the_kernels_own_files_are_read_as_written(monkeypatch: pytest.MonkeyPatch,
                                                    tmp_path: Path) -> None:
    """This machine's /proc/meminfo (and cgroup files, where there are any), copied at one
    instant, against the figure parsed here by other means."""
    if not Path("/proc/meminfo").exists():
        pytest.skip("no /proc/meminfo here")
    text = Path("/proc/meminfo").read_text()
    m = re.search(r"^MemAvailable:\s+(\d+) kB$", text, re.MULTILINE)
    assert m is not None
    want = int(m.group(1)) * 1024
    (tmp_path / "meminfo").write_text(text)
    monkeypatch.setattr(memory, "MEMINFO", str(tmp_path / "meminfo"))
    for name, attr in (("memory.max", "CGROUP_MAX"), ("memory.current", "CGROUP_CURRENT")):
        real = Path("/sys/fs/cgroup") / name
        if real.exists():
            (tmp_path / name).write_text(real.read_text())
        monkeypatch.setattr(memory, attr, str(tmp_path / name))
    limit, current = tmp_path / "memory.max", tmp_path / "memory.current"
    if limit.exists() and current.exists() and limit.read_text().strip() != "max":
        want = min(want, max(0, int(limit.read_text()) - int(current.read_text())))
    assert available_host_memory() == want


def test_host_pools_read_the_same_figure() -> None:
    assert host_pools.host_memory_budget is available_host_memory


# ------------------------------------------------------------------ the check
def test_check_refuses_one_byte_past_the_figure(monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Path) -> None:
    fake_host(monkeypatch, tmp_path, 100 * 1024)  # 100 MiB
    check_memory(100 * MIB, "X(size=1)", HOST)  # exactly what is available: accepted
    with pytest.raises(MemoryBudgetError) as exc:
        check_memory(100 * MIB + 1, "X(size=1)", HOST)
    assert str(exc.value) == ("X(size=1) needs 0.10 GiB (104,857,601 bytes) on cpu, more than "
                              "the 0.10 GiB available there; give a smaller size")
    assert issubclass(MemoryBudgetError, ValueError)


def test_small_allocations_are_not_checked(monkeypatch: pytest.MonkeyPatch,
                                           tmp_path: Path) -> None:
    fake_host(monkeypatch, tmp_path, 1)  # 1 KiB available
    check_memory(UNCHECKED_BYTES - 1, "X", HOST)
    with pytest.raises(MemoryBudgetError):
        check_memory(UNCHECKED_BYTES, "X", HOST)
    TokenAllocator(1000)  # kilobytes: built whatever the figure says
    KVPool(16)


# ------------------------------------------------------------------ every pool constructor
#: Constructor -> (what the error names, bytes it allocates first, computed by hand).
#: 160 MiB available; each one asks for more than that, in its first allocation.
HUGE: dict[str, tuple[Callable[[], object], str, int]] = {
    "kv_pool": (lambda: KVPool(10_000_000, num_layers=2, num_heads=2, head_dim=8),
                "KVPool(size=10,000,000, num_layers=2, num_heads=2, head_dim=8, "
                "dtype=torch.float16)", 2 * 2 * 2 * 8 * 2 * 10_000_001),
    "token_allocator": (lambda: TokenAllocator(20_000_000), "TokenAllocator(size=20,000,000)",
                        8 * 20_000_000 + 5 * 20_000_001),
    "paged_allocator": (lambda: PagedAllocator(320_000_000, 16),
                        "PagedAllocator(size=320,000,000)", 8 * 20_000_000 + 5 * 20_000_001),
    "state_pool": (lambda: MambaStatePool(1_000_000, num_layers=4, conv_state_shape=(4, 3),
                                          ssm_state_shape=(2, 4, 4)),
                   "MambaStatePool(size=1,000,000, num_layers=4, conv_state_shape=(4, 3), "
                   "ssm_state_shape=(2, 4, 4), dtype=torch.float32)",
                   4 * (12 + 32) * 4 * 1_000_001),
    "swa_allocator": (lambda: SWAAllocator(30_000_000, 1000), "SWAAllocator(full_size=30,000,000)",
                      8 * 30_000_001),
    "lora_pool": (lambda: LoraMemoryPool({"q_proj": (4096, 4096)}, 1024, 8),
                  "LoraMemoryPool(max_loras_per_batch=8, max_lora_rank=1024)",
                  8 * (1 + 1024 * (4096 + 4096)) * 4),
}


@pytest.mark.parametrize("name", sorted(HUGE))
def test_every_pool_refuses_a_size_past_the_memory(name: str, monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path) -> None:
    build, what, nbytes = HUGE[name]
    assert nbytes > 160 * MIB
    fake_host(monkeypatch, tmp_path, 160 * 1024)
    with pytest.raises(MemoryBudgetError) as exc:
        build()
    msg = str(exc.value)
    assert msg.startswith(f"{what} needs ") and f"({nbytes:,} bytes) on cpu" in msg
    assert "0.16 GiB available" in msg


def test_a_pool_that_fits_is_built_under_the_check(monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path) -> None:
    fake_host(monkeypatch, tmp_path, 160 * 1024)
    pool = KVPool(5_000_000, num_layers=1, num_heads=1, head_dim=4, dtype=torch.float16)
    assert pool.total_bytes == 2 * 4 * 2 * 5_000_001 > UNCHECKED_BYTES  # checked, and fits
    assert pool.k_buffer(0).shape == (5_000_001, 1, 4)


def test_a_size_past_the_real_memory_is_refused_at_once() -> None:
    avail = available_host_memory()
    if avail is None:
        pytest.skip("the available memory is not known here")
    size = 2 * avail // (2 * 2 * 2 * 8 * 2)  # twice what fits, in KV slots of the defaults
    with pytest.raises(MemoryBudgetError, match=f"^KVPool\\(size={size:,}, "):
        KVPool(size)
    with pytest.raises(MemoryBudgetError, match=f"^TokenAllocator\\(size={avail:,}\\)"):
        TokenAllocator(avail)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_figure_is_free_plus_the_unused_cache() -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    held = torch.empty(64 * MIB, dtype=torch.uint8, device=dev)
    del held  # back in torch's cache: reserved, not allocated
    free, _ = torch.cuda.mem_get_info(dev)
    want = free + torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
    got = available_memory(dev)
    assert got is not None and abs(got - want) <= 8 * MIB
    with pytest.raises(MemoryBudgetError, match=r"^KVPool\(size="):
        KVPool(2 * got // 128, device=dev)
