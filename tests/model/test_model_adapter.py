"""The engine adapter on real transformers models: layout, write-through into our pools, state
views, resuming from our pools at any split (incl. the one-token decode kernels).

Skipped without the optional extra (``pip install -e .[model]``).
"""

from __future__ import annotations

import pytest
import torch

from bench.dev.model import MIN_TRANSFORMERS

pytest.importorskip("transformers", minversion=MIN_TRANSFORMERS,
                    reason="model tests need the optional extra: pip install -e .[model]")

from transformers import DynamicCache  # noqa: E402

from bench.dev.model.adapter import (  # noqa: E402
    CacheLayout,
    ModelAdapter,
    ModelPools,
    build_tiny_model,
)
from tests.helpers.model_helpers import ARCHS, HYBRID, one_thread  # noqa: E402, F401  (autouse fixture)

_MODELS: dict[str, object] = {}


def setup(arch: str, page_size: int = 1, kv_tokens: int = 256, state_slots: int = 8):
    if arch not in _MODELS:
        _MODELS[arch] = build_tiny_model(arch, seed=0)
    model = _MODELS[arch]
    pools = ModelPools(CacheLayout.from_model(model), kv_tokens=kv_tokens, page_size=page_size,
                       state_slots=state_slots)
    return model, pools, ModelAdapter(model, pools)


def prompt(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


def own_slot(pools: ModelPools) -> int | None:
    return int(pools.state_pool.alloc(1)[0]) if pools.state_pool is not None else None


def test_layouts_match_each_architecture() -> None:
    expect = {  # (kv_layers, swa_layers, state_layers, window)
        "qwen3_next": ((1, 3), (), (0, 2), None),
        "bamba": ((1,), (), (0, 2), None),
        "falcon_h1": ((0, 1), (), (0, 1), None),  # attention and Mamba2 in every layer
        "qwen2_swa": ((1,), (0, 2), (), 12),
    }
    for arch, (kv, swa, state, window) in expect.items():
        lay = setup(arch)[1].layout
        assert (lay.kv_layers, lay.swa_layers, lay.state_layers, lay.sliding_window) == (
            kv, swa, state, window), arch
        assert (lay.num_kv_heads, lay.head_dim) == (2, 16)
        assert lay.hybrid == (arch in HYBRID)


def test_unknown_architecture_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown architecture 'jamba'"):
        build_tiny_model("jamba")


def test_weights_are_seeded() -> None:
    a, b = build_tiny_model("bamba", seed=3), build_tiny_model("bamba", seed=3)
    c = build_tiny_model("bamba", seed=4)
    pa, pb, pc = (next(m.model.layers[0].parameters()) for m in (a, b, c))
    assert torch.equal(pa, pb) and not torch.equal(pa, pc)


@pytest.mark.parametrize("arch", ARCHS)
def test_forward_writes_kv_and_state_through_into_the_pools(arch: str) -> None:
    """One prefill through the adapter leaves in our pools exactly what transformers' own
    DynamicCache holds after the same forward."""
    model, pools, adapter = setup(arch)
    ids = prompt(40)
    row = pools.kv_allocator.alloc(40)
    slot = own_slot(pools)
    got = adapter.forward(ids, start=0, row=row, state_slot=slot)
    own = DynamicCache(config=model.config)
    with torch.no_grad():
        want = model(input_ids=ids[None], cache=own, use_cache=True,
                     position_ids=torch.arange(40)[None]).logits[0]
    assert torch.equal(got, want)
    lay = pools.layout
    for i, layer in enumerate(lay.kv_layers):
        k, v = pools.kv_pool.get_kv(i, row)
        assert torch.equal(k, own.layers[layer].keys[0].transpose(0, 1))
        assert torch.equal(v, own.layers[layer].values[0].transpose(0, 1))
    for i, layer in enumerate(lay.swa_layers):  # the cache object keeps W-1 tokens only
        w = lay.sliding_window - 1
        k, _ = pools.swa_pool.get_kv(i, pools.kv_allocator.translate(row[-w:]))
        assert torch.equal(k, own.layers[layer].keys[0].transpose(0, 1))
    for i, layer in enumerate(lay.state_layers):
        conv, ssm = pools.state_pool.get_state(slot, i)
        assert torch.equal(conv, own.layers[layer].conv_states[0][0])
        assert torch.equal(ssm, own.layers[layer].recurrent_states[0][0])


SPLITS = [[16, 17, 40], [1, 40], [8, 39, 40], [20, 33, 60]]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("ends", SPLITS, ids=lambda e: "-".join(map(str, e)))
def test_resuming_from_the_pools_matches_a_full_forward(arch: str, ends: list[int]) -> None:
    """Segments rebuilt from the pools at each split (one-token segments take the decode
    kernels) give the logits of one forward over the whole sequence."""
    _, pools, adapter = setup(arch)
    n = ends[-1]
    ids = prompt(n, seed=len(ends))
    row = pools.kv_allocator.alloc(n)
    slot = own_slot(pools)
    outs, start = [], 0
    for end in ends:
        outs.append(adapter.forward(ids[start:end], start=start, row=row, state_slot=slot))
        start = end
    torch.testing.assert_close(torch.cat(outs), adapter.reference_logits(ids))


@pytest.mark.parametrize("arch", HYBRID)
def test_a_copied_state_resumes_and_the_source_stays_bit_exact(arch: str) -> None:
    _, pools, adapter = setup(arch)
    ids = prompt(48)
    row = pools.kv_allocator.alloc(48)
    first = own_slot(pools)
    adapter.forward(ids[:32], start=0, row=row, state_slot=first)
    pool = pools.state_pool
    before = pool.conv[:, first].clone(), pool.ssm[:, first].clone()
    second = own_slot(pools)
    pools.state_pool.copy(first, second)  # copy-on-write, as the driver does
    branch = torch.cat([row[:32], pools.kv_allocator.alloc(16)])
    got = adapter.forward(ids[32:], start=32, row=branch, state_slot=second)
    torch.testing.assert_close(got, adapter.reference_logits(ids)[32:])
    assert torch.equal(pool.conv[:, first], before[0]) and torch.equal(pool.ssm[:, first], before[1])


def test_state_slot_must_match_the_model() -> None:
    _, pools, adapter = setup("bamba")
    row = pools.kv_allocator.alloc(4)
    with pytest.raises(ValueError, match="state_slot must be given"):
        adapter.forward(prompt(4), start=0, row=row, state_slot=None)
    _, pools, adapter = setup("qwen2_swa")
    with pytest.raises(ValueError, match="state_slot must be given"):
        adapter.forward(prompt(4), start=0, row=pools.kv_allocator.alloc(4), state_slot=1)
    with pytest.raises(ValueError, match="row has 4 slots, need 5"):
        adapter.forward(prompt(5), start=0, row=pools.kv_allocator.alloc(4), state_slot=None)


def test_a_tombstoned_window_is_refused_not_read() -> None:
    """Resuming where the SWA KV inside the window is gone raises instead of reading padding."""
    _, pools, adapter = setup("qwen2_swa")
    ids = prompt(30)
    row = pools.kv_allocator.alloc(30)
    adapter.forward(ids[:20], start=0, row=row, state_slot=None)
    pools.kv_allocator.free_swa(row[:8])  # outside the window of position 20: fine
    got = adapter.forward(ids[20:], start=20, row=row, state_slot=None)
    torch.testing.assert_close(got, adapter.reference_logits(ids)[20:])
    pools.kv_allocator.free_swa(row[8:12])  # inside it
    with pytest.raises(ValueError, match="no live SWA KV"):
        adapter.forward(ids[20:], start=20, row=row, state_slot=None)
