"""Model presets for memory accounting: ``--model PRESET --memory-gb G --state-fraction F``.

A hybrid model's cache memory holds two kinds of things: per-token KV of its attention layers
(``kv_bytes_per_token``) and fixed-size recurrent-state checkpoints of its linear layers
(``state_bytes_per_slot``, one slot = every recurrent layer's conv + temporal state at one
position). Given a memory budget and the share of it given to states, :func:`split_memory`
returns the replay's two pool sizes::

    state_slots = floor(F * G * 1e9 / state_bytes_per_slot)
    kv_tokens   = floor((1 - F) * G * 1e9 / kv_bytes_per_token)   (rounded down to a page)

``G`` is in decimal gigabytes (``1e9`` bytes), the unit of the option's name.

Per-layer sizes (``dtype`` bytes in brackets):

* attention KV per token and layer: ``2 (K and V) * kv_heads * head_dim`` [kv dtype];
* Mamba-2 state per layer: temporal ``heads * head_dim * d_state`` [ssm dtype] plus conv
  ``(d_conv - 1) * (heads * head_dim + 2 * n_groups * d_state)`` [conv dtype];
* Gated DeltaNet (GDN) state per layer: temporal ``v_heads * k_head_dim * v_head_dim``
  [ssm dtype] plus conv ``(d_conv - 1) * (2 * k_heads * k_head_dim + v_heads * v_head_dim)``
  [conv dtype].

Sources of the shapes (public configs and papers; numbers as read from them):

``marconi-7b``
    The 7B hybrid of the Marconi paper (Pan et al., MLSys 2025, arXiv 2411.19379, section 5.1:
    4 attention, 24 SSM and 28 MLP layers, FP16), i.e. NVIDIA's Mamba-2-Hybrid shape
    (Waleffe et al., arXiv 2406.07887): d_model 4096, GQA with 8 KV heads of 128; Mamba-2 with
    128 heads of 64, d_state 128, 8 groups, d_conv 4. Everything FP16. Cross-check: Marconi
    reports 17.4 GB of state for a 10K-token input checkpointed every 32 tokens; these numbers
    give 313 checkpoints x 51.8 MB = 16.2 GB plus 0.16 GB of KV.
``nemotron-h-8b``
    NVIDIA Nemotron-H-8B (the ``NemotronHConfig`` defaults, "NemotronH-v0.1"): 52 layers with
    pattern ``M-M-M-M*-...`` = 24 Mamba-2, 4 attention, 24 MLP; 32 heads, 8 KV heads of 128;
    Mamba-2 128 heads of 64, d_state 128, 8 groups, d_conv 4. The released Nemotron-H configs
    keep the SSM cache in FP32 (``mamba_ssm_cache_dtype``); KV and conv state BF16.
``qwen3-next-80b``
    Qwen3-Next-80B-A3B (``Qwen3NextConfig`` defaults): 48 layers, ``full_attention_interval``
    4 -> 12 gated-attention + 36 GDN layers; 2 KV heads of 256; GDN with 16 key heads and 32
    value heads of 128, d_conv 4. Temporal state FP32 (``mamba_ssm_dtype`` of the Qwen3.5
    configs), conv state and KV BF16.
``glm-5.3-flash-like``
    A plausible hybrid shape named "GLM-5.3-Flash-like", chosen so that the counts of the GDS
    seed's deployment (SGLang, GLM-5.3-Flash NVFP4 on 2x B200: **419 state slots against
    2,969,600 KV tokens**, the seed's reference outcome quoted in issue 38) come out of a stated
    budget and split; the released model's config is not available here, so this shape is a
    stand-in, not the released one.
    64 layers, every 4th attention: 16 attention layers with GQA of 8 KV heads x 128 (GLM-4.5's
    KV heads) and an FP8 KV cache (assumed for an NVFP4 deployment), and 48 Gated DeltaNet
    layers with 32 key heads and 64 value heads of 128, d_conv 4, temporal state FP32, conv
    BF16. Arithmetic::

        KV    = 16 layers * 2 * 8 heads * 128 * 1 B               =      32,768 B / token
        state = 48 * (64 * 128 * 128 * 4 + 3 * (2*32*128 + 64*128) * 2)
              = 48 * (4,194,304 + 98,304)                          = 206,045,184 B / slot
                                                                     (= 6,288 KV tokens)
        budget 183.7 GB (91.85 GB per B200 for the cache), state fraction 0.47028, page 64:
        slots  = floor(0.47028 * 183.7e9 / 206,045,184)  = floor(419.28)   = 419
        tokens = floor(0.52972 * 183.7e9 / 32,768)       = floor(2,969,652.2)
                 -> whole pages of 64                                       = 2,969,600

    The fraction is what the counts imply: 419 slots are 86.33 GB and 2,969,600 tokens
    97.31 GB, a state : KV ratio of 0.887, near SGLang's default ``--mamba-full-memory-ratio``
    0.9. With page 1 the tokens are 2,969,652 (52 more, the page rounding).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["DEFAULT_STATE_FRACTION", "GB", "PRESETS", "SGLANG_DEFAULT_FRACTION", "UNIFIED", "ArenaLayout", "MemorySplit",
           "ModelPreset", "arena_layout", "engine_sizes", "get_preset", "split_memory"]

GB = 10**9
"""Bytes per ``--memory-gb`` unit (decimal gigabyte)."""

SGLANG_DEFAULT_FRACTION = 0.9 / 1.9
"""SGLang's default state share: ``--mamba-full-memory-ratio`` 0.9 (``server_args.py``, the
ratio of Mamba-state to full-attention KV memory); the model runner gives states
``total * r / (1 + r)`` of the cache memory, ``0.9 / 1.9 = 0.4737``. The unified arena starts
there."""

DEFAULT_STATE_FRACTION = 0.2
"""The states' share of ``--memory-gb`` when no ``--state-fraction`` is given (``simulate``,
``replay``)."""

UNIFIED = "unified"
"""The split of the unified arena (``--state-fraction unified``, a record's ``split``)."""


@dataclass(frozen=True, slots=True)
class ModelPreset:
    """The cache-memory shape of one hybrid model (all sizes in bytes).

    Attributes:
        name: the ``--model`` name.
        attention_layers / recurrent_layers: the layer mix (MLP/MoE layers hold no cache).
        kv_bytes_per_token: KV of every attention layer for one token.
        state_bytes_per_slot: conv + temporal state of every recurrent layer (one checkpoint).
        source: where the numbers come from (one line).
    """

    name: str
    attention_layers: int
    recurrent_layers: int
    kv_bytes_per_token: int
    state_bytes_per_slot: int
    source: str

    def __post_init__(self) -> None:
        for f in ("attention_layers", "recurrent_layers", "kv_bytes_per_token",
                  "state_bytes_per_slot"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{f} must be an int >= 1, got {v!r}")

    @property
    def state_to_kv_tokens(self) -> float:
        """How many tokens of KV one state slot weighs."""
        return self.state_bytes_per_slot / self.kv_bytes_per_token


def _check_sizes(**sizes: int) -> None:
    """Every size an int >= 1 (``bool`` refused), else ``ValueError`` naming it."""
    for name, v in sizes.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")


def _check_divides(whole: str, n: int, part: str, d: int) -> None:
    """``n`` (argument ``whole``) a multiple of ``d`` (argument ``part``), else ``ValueError``."""
    if n % d:
        raise ValueError(f"{whole}={n} is not a multiple of {part}={d} (shapes that do not divide)")


def attention_kv_bytes(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """KV bytes per token of ``layers`` attention layers (K and V).

    Raises:
        ValueError: a size that is not an int >= 1 (named).
    """
    _check_sizes(layers=layers, kv_heads=kv_heads, head_dim=head_dim, dtype_bytes=dtype_bytes)
    return layers * 2 * kv_heads * head_dim * dtype_bytes


def mamba2_state_bytes(layers: int, heads: int, head_dim: int, d_state: int, n_groups: int,
                       d_conv: int, ssm_bytes: int, conv_bytes: int) -> int:
    """State bytes of one checkpoint over ``layers`` Mamba-2 layers.

    Raises:
        ValueError: a size that is not an int >= 1, ``d_conv < 2`` (no conv state), or
            ``heads`` not a multiple of ``n_groups`` (each group serves whole heads).
    """
    _check_sizes(layers=layers, heads=heads, head_dim=head_dim, d_state=d_state,
                 n_groups=n_groups, d_conv=d_conv, ssm_bytes=ssm_bytes, conv_bytes=conv_bytes)
    if d_conv < 2:
        raise ValueError(f"d_conv must be >= 2 (the state keeps d_conv - 1 inputs), got {d_conv}")
    _check_divides("heads", heads, "n_groups", n_groups)
    temporal = heads * head_dim * d_state * ssm_bytes
    conv = (d_conv - 1) * (heads * head_dim + 2 * n_groups * d_state) * conv_bytes
    return layers * (temporal + conv)


def gdn_state_bytes(layers: int, k_heads: int, v_heads: int, k_head_dim: int, v_head_dim: int,
                    d_conv: int, ssm_bytes: int, conv_bytes: int) -> int:
    """State bytes of one checkpoint over ``layers`` Gated DeltaNet layers.

    Raises:
        ValueError: a size that is not an int >= 1, ``d_conv < 2`` (no conv state), or
            ``v_heads`` not a multiple of ``k_heads`` (GQA-style sharing of key heads).
    """
    _check_sizes(layers=layers, k_heads=k_heads, v_heads=v_heads, k_head_dim=k_head_dim,
                 v_head_dim=v_head_dim, d_conv=d_conv, ssm_bytes=ssm_bytes, conv_bytes=conv_bytes)
    if d_conv < 2:
        raise ValueError(f"d_conv must be >= 2 (the state keeps d_conv - 1 inputs), got {d_conv}")
    _check_divides("v_heads", v_heads, "k_heads", k_heads)
    temporal = v_heads * k_head_dim * v_head_dim * ssm_bytes
    conv = (d_conv - 1) * (2 * k_heads * k_head_dim + v_heads * v_head_dim) * conv_bytes
    return layers * (temporal + conv)


PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        ModelPreset(
            "marconi-7b", 4, 24,
            attention_kv_bytes(4, 8, 128, 2),
            mamba2_state_bytes(24, 128, 64, 128, 8, 4, 2, 2),
            "Marconi (arXiv 2411.19379) 7B hybrid = Mamba-2-Hybrid shape (arXiv 2406.07887), FP16",
        ),
        ModelPreset(
            "nemotron-h-8b", 4, 24,
            attention_kv_bytes(4, 8, 128, 2),
            mamba2_state_bytes(24, 128, 64, 128, 8, 4, 4, 2),
            "NemotronHConfig defaults (Nemotron-H-8B), SSM cache FP32, KV/conv BF16",
        ),
        ModelPreset(
            "qwen3-next-80b", 12, 36,
            attention_kv_bytes(12, 2, 256, 2),
            gdn_state_bytes(36, 16, 32, 128, 128, 4, 4, 2),
            "Qwen3NextConfig defaults (Qwen3-Next-80B-A3B), GDN state FP32, KV/conv BF16",
        ),
        ModelPreset(
            "glm-5.3-flash-like", 16, 48,
            attention_kv_bytes(16, 8, 128, 1),
            gdn_state_bytes(48, 32, 64, 128, 128, 4, 4, 2),
            "GLM-5.3-Flash-like hybrid fitted to the seed's 2x B200 counts (419 states, "
            "2,969,600 KV tokens at 183.7 GB, state fraction 0.47028, page 64), KV FP8",
        ),
    )
}


def get_preset(name: str) -> ModelPreset:
    """The preset called ``name``; raises ``ValueError`` listing the known names."""
    preset = PRESETS.get(name)
    if preset is None:
        raise ValueError(f"unknown model preset {name!r}; expected one of {sorted(PRESETS)}")
    return preset


@dataclass(frozen=True, slots=True)
class MemorySplit:
    """Pool sizes from a memory budget: KV tokens, state slots, and the bytes each takes."""

    kv_tokens: int
    state_slots: int
    kv_bytes: int
    state_bytes: int


def split_memory(preset: ModelPreset, memory_gb: float, state_fraction: float,
                 page_size: int = 1) -> MemorySplit:
    """Split ``memory_gb`` (decimal GB) between state slots (``state_fraction``) and KV tokens.

    Example: ``qwen3-next-80b`` with 40 GB and a 0.2 state fraction gives
    ``floor(8e9 / 77,266,944) = 103`` slots and ``floor(32e9 / 24,576) = 1,302,083`` tokens.

    Raises:
        ValueError: ``memory_gb <= 0``, ``state_fraction`` outside ``[0, 1)``, a budget
            below one state plus one page, or a budget whose KV share does not hold one page.
    """
    if not memory_gb > 0:
        raise ValueError(f"memory_gb must be > 0, got {memory_gb!r}")
    if not 0.0 <= state_fraction < 1.0:
        raise ValueError(f"state_fraction must be in [0, 1), got {state_fraction!r}")
    total = memory_gb * GB
    least = preset.state_bytes_per_slot + page_size * preset.kv_bytes_per_token
    if total < least:
        raise ValueError(
            f"memory_gb={memory_gb} is below one state plus one page of {preset.name} "
            f"({least:,} bytes)")
    state_budget = state_fraction * total
    slots = int(state_budget // preset.state_bytes_per_slot)
    kv_tokens = int((total - state_budget) // preset.kv_bytes_per_token) // page_size * page_size
    if kv_tokens < page_size:
        raise ValueError(
            f"{memory_gb} GB with state fraction {state_fraction} leaves no KV page for "
            f"{preset.name} ({preset.kv_bytes_per_token:,} bytes per token)"
        )
    return MemorySplit(kv_tokens, slots, kv_tokens * preset.kv_bytes_per_token,
                       slots * preset.state_bytes_per_slot)


@dataclass(frozen=True, slots=True)
class ArenaLayout:
    """The counts of a unified memory arena (``allocators.arena.MemoryArena``) of a budget:
    ``num_chunks`` chunks of ``tokens_per_chunk`` KV tokens or one state each, chunk 0 the
    padding (on top of the budget, as a fixed pool's padding rows), ``state_chunks`` of the
    others owned by states at the start (the boundary moves at run time).

    Raises:
        ValueError: a count that is not an int, ``tokens_per_chunk < 1``, ``num_chunks < 3``
            (padding, one state, one KV chunk), ``state_chunks`` outside ``[1, num_chunks - 2]``.
    """

    tokens_per_chunk: int
    num_chunks: int
    state_chunks: int

    def __post_init__(self) -> None:
        for f, least in (("tokens_per_chunk", 1), ("num_chunks", 3), ("state_chunks", 1)):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise ValueError(f"{f} must be an int >= {least}, got {v!r}")
        if self.state_chunks > self.num_chunks - 2:
            raise ValueError(f"state_chunks={self.state_chunks} leaves no KV chunk of "
                             f"{self.num_chunks} (one is the padding)")

    @property
    def kv_tokens(self) -> int:
        """KV tokens of the chunks KV owns at the start."""
        return (self.num_chunks - 1 - self.state_chunks) * self.tokens_per_chunk


def arena_layout(preset: ModelPreset, memory_gb: float, state_fraction: float,
                 page_size: int = 1) -> ArenaLayout:
    """The unified arena of ``preset`` at ``memory_gb`` (decimal GB), states owning
    ``state_fraction`` of the usable chunks at the start (at least one, and one KV chunk)::

        tokens_per_chunk = ceil(state_bytes / (page_size * kv_bytes_per_token)) * page_size
        num_chunks       = floor(memory_gb * 1e9 / (tokens_per_chunk * kv_bytes_per_token)) + 1
        state_chunks     = clamp(round(state_fraction * (num_chunks - 1)), 1, num_chunks - 2)

    (``allocators.arena``'s chunking: a chunk is one state rounded up to whole KV pages; the
    ``+ 1`` is the padding chunk, allocated on top of the budget as the fixed pools allocate
    their padding rows on top of their size, so both modes get the same usable bytes.)
    Example: ``qwen3-next-80b`` at 10 GB: 3,144 tokens per chunk (77,266,944 B, exactly one
    state), 129 usable chunks and the padding: 130.

    Raises:
        ValueError: ``memory_gb <= 0``, ``state_fraction`` outside ``[0, 1)``,
            ``page_size < 1``, or a budget below three chunks (the padding chunk, one state,
            one chunk of KV pages), naming ``memory_gb``.
    """
    if not memory_gb > 0:
        raise ValueError(f"memory_gb must be > 0, got {memory_gb!r}")
    if not 0.0 <= state_fraction < 1.0:
        raise ValueError(f"state_fraction must be in [0, 1), got {state_fraction!r}")
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
    kv_page = page_size * preset.kv_bytes_per_token
    tokens_per_chunk = -(-preset.state_bytes_per_slot // kv_page) * page_size
    chunk_bytes = tokens_per_chunk * preset.kv_bytes_per_token
    usable = int(memory_gb * GB // chunk_bytes)
    if usable < 2:
        raise ValueError(
            f"memory_gb={memory_gb} holds {usable} arena chunks of {chunk_bytes:,} bytes "
            f"({preset.name}: one state in whole pages of {page_size}); the unified arena needs "
            f"2 (one state, one KV chunk): {2 * chunk_bytes / GB:.4g} GB or more")
    chunks = usable + 1
    state_chunks = min(max(1, round(state_fraction * (chunks - 1))), chunks - 2)
    return ArenaLayout(tokens_per_chunk, chunks, state_chunks)


def engine_sizes(preset: ModelPreset, memory_gb: float, split: float | str,
                 page_size: int = 1) -> dict[str, Any]:
    """The pool fields of ``bench.engine.core.EngineConfig`` for ``memory_gb`` of ``preset``:
    ``kv_tokens`` and ``state_slots`` of the fixed split ``split`` (:func:`split_memory`), or
    for ``split == "unified"`` the arena (:func:`arena_layout`, starting at
    :data:`SGLANG_DEFAULT_FRACTION`) with its split at the start and ``policy="unified"``.

    Raises:
        ValueError: as :func:`split_memory` / :func:`arena_layout`; a ``split`` that is
            neither a number nor ``"unified"``.
    """
    if split == UNIFIED:
        arena = arena_layout(preset, memory_gb, SGLANG_DEFAULT_FRACTION, page_size)
        return {"policy": UNIFIED, "kv_tokens": arena.kv_tokens,
                "state_slots": arena.state_chunks, "arena": arena}
    if isinstance(split, str) or isinstance(split, bool):
        raise ValueError(f"split must be a state fraction or {UNIFIED!r}, got {split!r}")
    fixed = split_memory(preset, memory_gb, split, page_size)
    return {"kv_tokens": fixed.kv_tokens, "state_slots": fixed.state_slots}
