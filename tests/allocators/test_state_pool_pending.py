"""The state pool's pending work on a device (``allocators.state_pool``): ``alloc``, ``alloc_slot``
and ``copy`` issue no CUDA call; zeroing and copies wait on the host until the states are read
(``conv`` / ``ssm``, or ``flush``), then go out in one batch (at most 1 memcpy and 6 kernel
launches). The states read must be those of the same calls on the CPU, which does the work at
once: a seeded random sequence, compared after every few calls."""

from __future__ import annotations

import random

import torch

from allocators import MambaStatePool
from allocators.host_mirror import host_ids
from bench.dev.gpu.simcuda import SimCuda

SIZE = 12


def _fill(pool: MambaStatePool, slot: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    conv = torch.randn(pool.conv_state_shape, generator=g)
    ssm = torch.randn(pool.ssm_state_shape, generator=g)
    for layer in range(pool.num_layers):
        pool.set_state(slot, layer, conv.to(pool.device) + layer, ssm.to(pool.device) - layer)


def _states(pool: MambaStatePool, slots: list[int]) -> tuple[list[float], list[float]]:
    idx = torch.tensor(sorted(slots), dtype=torch.int64)
    conv, ssm = pool.conv.cpu()[:, idx], pool.ssm.cpu()[:, idx]
    return conv.flatten().tolist(), ssm.flatten().tolist()


def test_pending_work_reads_as_the_cpu_did_it_at_once() -> None:
    rng = random.Random(7)
    cpu = MambaStatePool(SIZE, 2, (3, 2), (2, 2, 2))
    with SimCuda() as sim:
        dev = MambaStatePool(SIZE, 2, (3, 2), (2, 2, 2), device="cuda")
        held: list[int] = []
        flushes = 0
        for step in range(400):
            op = rng.random()
            if op < 0.3 and len(held) < SIZE:
                if rng.random() < 0.5:
                    a, b = cpu.alloc_slot(), dev.alloc_slot()
                    assert a is not None and b is not None
                else:
                    ta, tb = cpu.alloc(1), dev.alloc(1)
                    assert ta is not None and tb is not None
                    a, b = int(ta[0]), int(host_ids(tb)[0])  # (its mirror: no sync)
                assert a == b
                held.append(a)
            elif op < 0.45 and held:
                s = held.pop(rng.randrange(len(held)))
                cpu.free_slot(s)
                dev.free_slot(s)
            elif op < 0.8 and len(held) >= 2:
                if rng.random() < 0.6:
                    src, dst = rng.sample(held, 2)
                    cpu.copy(src, dst)
                    dev.copy(src, dst)
                else:  # several at once: every source as it was before the call
                    k = rng.randint(2, min(4, len(held)))
                    dst = rng.sample(held, k)
                    src = [rng.choice(held) for _ in range(k)]
                    cpu.copy(torch.tensor(src), torch.tensor(dst))
                    dev.copy(torch.tensor(src), torch.tensor(dst))
            elif held:
                s = rng.choice(held)
                _fill(cpu, s, step)
                _fill(dev, s, step)
            if step % 7 == 6 and held:
                before = sim.api_of("(outside)")
                n_launch, n_copy = sum(before.launches.values()), sum(before.memcpys.values())
                dev.flush()
                after = sim.api_of("(outside)")
                assert sum(after.launches.values()) - n_launch <= 6
                assert sum(after.memcpys.values()) - n_copy <= 1
                flushes += 1
                assert _states(dev, held) == _states(cpu, held), step
        assert flushes > 20


def test_alloc_copy_and_free_issue_no_cuda_call() -> None:
    with SimCuda() as sim:
        pool = MambaStatePool(8, 2, (3, 2), (2, 2, 2), device="cuda")
        sim.track(pool, ["alloc", "alloc_slot", "copy", "free", "free_slot", "flush"], "pool")
        a = pool.alloc(1)
        b = pool.alloc_slot()
        assert a is not None and b is not None
        _fill(pool, b, 1)  # (reads the states: the pending zeroing goes out first)
        c = pool.alloc(1)
        d, e = pool.alloc_slot(), pool.alloc_slot()
        assert c is not None and d is not None and e is not None
        pool.copy(a, c)  # c: zeros (a's state), then b's
        pool.copy(b, c)
        pool.copy(c, d)  # d: b's state (c's source), not a copy of a copy
        pool.free(a)
        ops = ("pool.alloc", "pool.alloc_slot", "pool.copy", "pool.free")
        assert [sim.api_of(op).total for op in ops] == [0, 0, 0, 0]
        assert [sim.ops[op].calls for op in ops] == [2, 3, 3, 1]
        assert sorted(pool._pending.items()) == sorted(
            [(int(host_ids(c)[0]), b), (d, b), (e, -1)])  # (-1: zeros)
        f = sim.api_of("pool.flush")
        seen = (sum(f.memcpys.values()), sum(f.launches.values()))
        pool.flush()  # two copies, one zeroing: one upload, 2 gathers, 2 scatters, 2 fills
        f = sim.api_of("pool.flush")
        assert (sum(f.memcpys.values()) - seen[0], sum(f.launches.values()) - seen[1]) == (1, 6)
        assert [sim.syncs_of(op) for op in (*ops, "pool.flush")] == [0] * 5
        conv, ssm = pool.conv.cpu(), pool.ssm.cpu()
        cs = int(host_ids(c)[0])
        for s in (cs, d):
            assert torch.equal(conv[:, s], conv[:, b]) and torch.equal(ssm[:, s], ssm[:, b])
        assert conv[:, b].abs().sum() > 0
        assert conv[:, e].abs().sum() == 0 and ssm[:, e].abs().sum() == 0
