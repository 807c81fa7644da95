"""Model presets (bench/engine/presets.py): bytes per token and per slot, and the memory split."""

from __future__ import annotations

import pytest

from bench.engine.presets import PRESETS, ModelPreset, get_preset, split_memory


def test_marconi_7b_bytes() -> None:
    p = PRESETS["marconi-7b"]
    # 4 attention layers x (K, V) x 8 heads x 128 x 2 bytes
    assert p.kv_bytes_per_token == 4 * 2 * 8 * 128 * 2 == 16_384
    # 24 Mamba-2 layers x (128 heads x 64 x d_state 128 x 2 B + 3 x (8192 + 2 x 8 x 128) x 2 B)
    assert p.state_bytes_per_slot == 24 * (2_097_152 + 61_440) == 51_806_208


def test_nemotron_h_8b_bytes() -> None:
    p = PRESETS["nemotron-h-8b"]
    assert p.kv_bytes_per_token == 16_384
    assert p.state_bytes_per_slot == 24 * (128 * 64 * 128 * 4 + 3 * 10_240 * 2) == 102_137_856


def test_qwen3_next_bytes() -> None:
    p = PRESETS["qwen3-next-80b"]
    assert (p.attention_layers, p.recurrent_layers) == (12, 36)
    assert p.kv_bytes_per_token == 12 * 2 * 2 * 256 * 2 == 24_576
    # 36 GDN layers x (32 v-heads x 128 x 128 x 4 B + 3 x (2 x 16 x 128 + 32 x 128) x 2 B)
    assert p.state_bytes_per_slot == 36 * (2_097_152 + 49_152) == 77_266_944
    assert p.state_to_kv_tokens == pytest.approx(3144, abs=1)


def test_split_memory_arithmetic() -> None:
    p = get_preset("qwen3-next-80b")
    s = split_memory(p, 40, 0.2)
    assert (s.state_slots, s.kv_tokens) == (8 * 10**9 // 77_266_944, 32 * 10**9 // 24_576)
    assert (s.state_slots, s.kv_tokens) == (103, 1_302_083)
    assert s.state_bytes == 103 * 77_266_944 and s.kv_bytes == 1_302_083 * 24_576
    assert split_memory(p, 40, 0.2, page_size=16).kv_tokens == 1_302_080
    assert split_memory(p, 40, 0.0).state_slots == 0


def test_split_memory_refuses_bad_input() -> None:
    p = get_preset("marconi-7b")
    with pytest.raises(ValueError, match="state_fraction"):
        split_memory(p, 40, 1.0)
    with pytest.raises(ValueError, match="memory_gb"):
        split_memory(p, 0, 0.2)
    with pytest.raises(ValueError, match="no KV page"):
        split_memory(p, 1.0, 1 - 1e-12, page_size=64)
    # 51,806,208 B of state + 64 x 16,384 B of KV = 52,854,784 B: one byte less is refused
    with pytest.raises(ValueError, match=r"memory_gb=0.052854783 .* one state plus one page"):
        split_memory(p, 0.052854783, 0.5, page_size=64)
    s = split_memory(p, 0.052854784, 0.5, page_size=64)  # half each: 26,427,392 B
    assert (s.state_slots, s.kv_tokens) == (0, 1600)  # 1,613 tokens -> 25 pages of 64
    with pytest.raises(ValueError, match="unknown model preset"):
        get_preset("llama")
    with pytest.raises(ValueError, match="kv_bytes_per_token"):
        ModelPreset("x", 1, 1, 0, 1, "")


def test_glm_flash_like_reproduces_the_seeds_counts() -> None:
    p = get_preset("glm-5.3-flash-like")
    assert (p.attention_layers, p.recurrent_layers) == (16, 48)
    # 16 attention layers x (K, V) x 8 KV heads x 128 x 1 B (FP8)
    assert p.kv_bytes_per_token == 16 * 2 * 8 * 128 == 32_768
    # 48 GDN layers x (64 v-heads x 128 x 128 x 4 B + 3 x (2 x 32 x 128 + 64 x 128) x 2 B)
    assert p.state_bytes_per_slot == 48 * (4_194_304 + 98_304) == 206_045_184
    s = split_memory(p, 183.7, 0.47028, page_size=64)
    # 2x B200 deployment of the GDS seed (SPEC section 2): 419 states, 2,969,600 KV tokens
    assert (s.state_slots, s.kv_tokens) == (419, 2_969_600)
    assert s.kv_tokens % 64 == 0
    # page 1: the 52 tokens past the last whole page of 64 are kept
    assert split_memory(p, 183.7, 0.47028).kv_tokens == 2_969_652


def test_shapes_that_do_not_divide_are_refused() -> None:
    from bench.engine.presets import attention_kv_bytes, gdn_state_bytes, mamba2_state_bytes

    with pytest.raises(ValueError, match=r"v_heads=30 is not a multiple of k_heads=16"):
        gdn_state_bytes(36, 16, 30, 128, 128, 4, 4, 2)
    with pytest.raises(ValueError, match=r"heads=100 is not a multiple of n_groups=8"):
        mamba2_state_bytes(24, 100, 64, 128, 8, 4, 2, 2)
    with pytest.raises(ValueError, match="d_conv must be >= 2"):
        gdn_state_bytes(36, 16, 32, 128, 128, 1, 4, 2)
    with pytest.raises(ValueError, match="kv_heads must be an int >= 1"):
        attention_kv_bytes(12, 0, 256, 2)
    with pytest.raises(ValueError, match="head_dim must be an int >= 1"):
        attention_kv_bytes(12, 2, True, 2)
    with pytest.raises(ValueError, match="unknown model preset 'glm-5.3-flash'"):
        get_preset("glm-5.3-flash")
