"""Engine adapter: run a real hybrid model from ``transformers`` over our pools.

The model is one of transformers' own implementations (tiny, randomly initialised, seeded,
float32, CPU; no weights are downloaded). Our pools are the only store of cached data: before
each forward, the architecture's own cache class (``DynamicCache`` with its per-layer types) is
rebuilt from them, and every K/V the model computes is written through into them::

    forward(tokens[start:end], row, state_slot)
      row[0:start]      -> KV slots of the prefix (the tree's and the request's own)
      row[start:end]    -> fresh slots: the model writes the new K/V there (``out_cache_loc``)
      state_slot        -> the request's own state slot; the model's conv / SSM states are
                           views of it, so the running state lives in our pool

    attention layer    DynamicLayer            keys/values <- KVPool.get_kv(layer, row[:start])
    sliding layer      DynamicSlidingWindowLayer  the last W-1 tokens <- SWA pool, length = start
    recurrent layer    LinearAttentionLayer    conv/recurrent state = views of MambaStatePool slot
    hybrid layer       LinearAttentionAndFullAttentionLayer: both of the above (Falcon-H1)

Positions are always passed explicitly (``position_ids = arange(start, end)``): that is what an
engine does, and Bamba's model (transformers 5.24) restarts implicit positions at 0 after a
cached prefix.

Architectures (``ARCHITECTURES``): ``qwen3_next`` (gated DeltaNet + attention), ``bamba``
(Mamba2 + attention), ``falcon_h1`` (Mamba2 and attention in parallel in every layer),
``qwen2_swa`` (sliding-window + full attention). Jamba is left out: its Mamba mixer ignores
the cached SSM state on a multi-token input, so a suffix prefill cannot resume from a state.
Weights are transformers' random init, except the recurrent mixers' conv1d and ``dt_bias``
(:func:`mamba_style_init`), so that a lost or wrong state shows in the logits.

Needs the optional extra: ``pip install -e .[model]``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from transformers import (
    BambaConfig,
    BambaForCausalLM,
    FalconH1Config,
    FalconH1ForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)
from transformers.cache_utils import (
    DynamicCache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionLayer,
)

from allocators import KVPool, MambaStatePool, PagedAllocator, SWAAllocator, TokenAllocator

__all__ = [
    "ARCHITECTURES",
    "CacheLayout",
    "ModelAdapter",
    "ModelPools",
    "PoolBackedCache",
    "build_tiny_model",
    "mamba_style_init",
]

DTYPE = torch.float32
_Layer = TypeVar("_Layer")


# ====================================================================== tiny models
def _qwen3_next() -> PreTrainedModel:
    # MoE kept, with every expert active (top-k = all): routing stays continuous, so float
    # noise between a chunked and a full forward cannot flip an expert choice.
    return Qwen3NextForCausalLM(Qwen3NextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4,
        moe_intermediate_size=32, shared_expert_intermediate_size=32,
        num_experts=4, num_experts_per_tok=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    ))


def _bamba() -> PreTrainedModel:
    return BambaForCausalLM(BambaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, attn_layer_indices=[1],
        mamba_n_heads=8, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
        mamba_chunk_size=16, mamba_n_groups=1,
    ))


def _falcon_h1() -> PreTrainedModel:
    return FalconH1ForCausalLM(FalconH1Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, mamba_d_ssm=64, mamba_n_heads=8,
        mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16,
    ))


def _qwen2_swa() -> PreTrainedModel:
    return Qwen2ForCausalLM(Qwen2Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True,
        sliding_window=12,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    ))


#: name -> builder of a tiny randomly initialised model (seeded by :func:`build_tiny_model`).
ARCHITECTURES: dict[str, Callable[[], PreTrainedModel]] = {
    "qwen3_next": _qwen3_next,
    "bamba": _bamba,
    "falcon_h1": _falcon_h1,
    "qwen2_swa": _qwen2_swa,
}


def build_tiny_model(arch: str, seed: int = 0) -> PreTrainedModel:
    """A tiny float32 ``arch`` model with weights drawn under ``torch.manual_seed(seed)``, in
    eval mode, its recurrent mixers re-drawn by :func:`mamba_style_init`. Raises
    ``ValueError`` for an unknown name."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {arch!r}; known: {sorted(ARCHITECTURES)}")
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = ARCHITECTURES[arch]()
        mamba_style_init(model)
    return model.float().eval()


def mamba_style_init(model: PreTrainedModel) -> None:
    """Re-draw each recurrent mixer's conv1d (torch's default kaiming-uniform) and ``dt_bias``
    (Mamba2's: ``dt`` log-uniform in [1e-3, 1e-1], stored as its inverse softplus).

    transformers' random init draws conv1d from N(0, 0.02) and sets ``dt_bias = 1``: the SSM
    state of a Mamba2 layer then stays ~1e-5 and decays within a few tokens, so dropping it
    would move the logits less than the check's tolerance. With this init a zeroed SSM state
    moves them by 1e-3 and more, while a correct resume stays within 1e-6.
    """
    lo, hi = math.log(1e-3), math.log(1e-1)
    mod: Any
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(getattr(mod, "conv1d", None), torch.nn.Conv1d) and hasattr(mod, "dt_bias"):
                mod.conv1d.reset_parameters()
                dt = torch.exp(torch.rand(mod.dt_bias.shape) * (hi - lo) + lo)
                mod.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))


# ====================================================================== layout
@dataclass(frozen=True)
class CacheLayout:
    """Which model layers hold what, read from the architecture's own cache class.

    Attributes:
        kv_layers: model layers with full-attention K/V; pool layer ``i`` is ``kv_layers[i]``.
        swa_layers: sliding-window layers; SWA pool layer ``i`` is ``swa_layers[i]``.
        state_layers: recurrent layers (conv + SSM state); state pool layer ``i``.
        num_kv_heads, head_dim: K/V shape per token and layer.
        sliding_window: tokens a sliding layer attends to (itself included), or ``None``.
        conv_state_shape, ssm_state_shape: one layer's state in one slot (no batch dim), or
            ``None`` without recurrent layers.
    """

    kv_layers: tuple[int, ...]
    swa_layers: tuple[int, ...]
    state_layers: tuple[int, ...]
    num_kv_heads: int
    head_dim: int
    sliding_window: int | None
    conv_state_shape: tuple[int, ...] | None
    ssm_state_shape: tuple[int, ...] | None

    @property
    def hybrid(self) -> bool:
        return bool(self.state_layers)

    @classmethod
    def from_model(cls, model: PreTrainedModel) -> CacheLayout:
        """Probe: one token through the model with a fresh ``DynamicCache``, then read each
        layer's cache type and tensor shapes."""
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=torch.zeros((1, 1), dtype=torch.int64), cache=cache, use_cache=True,
                  position_ids=torch.zeros((1, 1), dtype=torch.int64))
        kv: list[int] = []
        swa: list[int] = []
        state: list[int] = []
        heads = dim = 0
        window = None
        conv_shape = ssm_shape = None
        for i, layer in enumerate(cache.layers):
            known = False
            if isinstance(layer, DynamicLayer) and layer.keys is not None:
                known = True
                (swa if isinstance(layer, DynamicSlidingWindowLayer) else kv).append(i)
                window = getattr(layer, "sliding_window", window)
                heads, dim = layer.keys.shape[1], layer.keys.shape[3]
            if isinstance(layer, LinearAttentionLayer):
                known = True
                if layer.number_of_states != 1:
                    raise ValueError(f"layer {i} has {layer.number_of_states} states; one supported")
                state.append(i)
                conv, rec = layer.conv_states[0], layer.recurrent_states[0]
                assert conv is not None and rec is not None
                c, s = tuple(conv.shape[1:]), tuple(rec.shape[1:])
                if conv_shape not in (None, c) or ssm_shape not in (None, s):
                    raise ValueError("recurrent layers with different state shapes are not supported")
                conv_shape, ssm_shape = c, s
            if not known:
                raise ValueError(f"layer {i}: cache layer {type(layer).__name__} is not supported")
        if not kv:
            raise ValueError("the model has no full-attention layer; the KV pool needs one")
        return cls(tuple(kv), tuple(swa), tuple(state), heads, dim, window, conv_shape, ssm_shape)


# ====================================================================== pools
class ModelPools:
    """Our allocators and pools sized for one model's :class:`CacheLayout`.

    ``kv_allocator`` is a :class:`TokenAllocator` (page 1), :class:`PagedAllocator`, or with
    sliding layers an :class:`SWAAllocator` (``swa_tokens`` SWA slots); ``kv_pool`` holds the
    full-attention layers, ``swa_pool`` the sliding ones, ``state_pool`` the recurrent states
    (``None`` without recurrent layers).
    """

    def __init__(self, layout: CacheLayout, *, kv_tokens: int, page_size: int,
                 state_slots: int = 0, swa_tokens: int | None = None) -> None:
        self.layout = layout
        self.page_size = page_size

        def kv_pool(size: int, layers: int) -> KVPool:
            return KVPool(size, num_layers=layers, num_heads=layout.num_kv_heads,
                          head_dim=layout.head_dim, dtype=DTYPE, page_size=page_size)

        self.kv_pool = kv_pool(kv_tokens, len(layout.kv_layers))
        self.swa_pool: KVPool | None = None
        self.kv_allocator: Any
        if layout.swa_layers:
            swa_tokens = kv_tokens if swa_tokens is None else swa_tokens
            self.swa_pool = kv_pool(swa_tokens, len(layout.swa_layers))
            self.kv_allocator = SWAAllocator(kv_tokens, swa_tokens, page_size,
                                             full_pool=self.kv_pool, swa_pool=self.swa_pool)
        elif page_size == 1:
            self.kv_allocator = TokenAllocator(kv_tokens, pool=self.kv_pool)
        else:
            self.kv_allocator = PagedAllocator(kv_tokens, page_size, pool=self.kv_pool)
        self.state_pool: MambaStatePool | None = None
        if layout.hybrid:
            if state_slots < 1:
                raise ValueError("a model with recurrent layers needs state_slots >= 1")
            assert layout.conv_state_shape is not None and layout.ssm_state_shape is not None
            self.state_pool = MambaStatePool(
                state_slots, num_layers=len(layout.state_layers),
                conv_state_shape=layout.conv_state_shape,
                ssm_state_shape=layout.ssm_state_shape, dtype=DTYPE)

    def swa_slots(self, full_slots: torch.Tensor) -> torch.Tensor:
        """SWA pool slots of ``full_slots``; raises ``ValueError`` if any has no live SWA KV
        (the cache handed out a prefix whose window was tombstoned: a contract breach)."""
        alloc = self.kv_allocator
        live = alloc.has_swa(full_slots)
        if not bool(live.all()):
            bad = full_slots[~live].tolist()[:4]
            raise ValueError(f"full slots {bad}... inside a sliding window have no live SWA KV")
        return alloc.translate(full_slots)


# ====================================================================== cache object
class PoolBackedCache(DynamicCache):
    """The architecture's own ``DynamicCache``, rebuilt from our pools, writing every new K/V
    through into them at ``out_cache_loc`` (the slots of the tokens being computed)."""

    def __init__(self, model: PreTrainedModel, pools: ModelPools, out_cache_loc: torch.Tensor) -> None:
        super().__init__(config=model.config)
        self.pools = pools
        self.out_cache_loc = out_cache_loc
        layout = pools.layout
        self._kv_index = {layer: i for i, layer in enumerate(layout.kv_layers)}
        self._swa_index = {layer: i for i, layer in enumerate(layout.swa_layers)}
        self._out_swa = pools.swa_slots(out_cache_loc) if layout.swa_layers else None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        n = key_states.shape[-2]
        if n != len(self.out_cache_loc):
            raise ValueError(f"layer {layer_idx} computed {n} tokens, out_cache_loc has "
                             f"{len(self.out_cache_loc)} slots")
        k, v = key_states[0].transpose(0, 1), value_states[0].transpose(0, 1)  # [n, heads, dim]
        if layer_idx in self._kv_index:
            self.pools.kv_pool.set_kv(self._kv_index[layer_idx], self.out_cache_loc, k, v)
        elif layer_idx in self._swa_index:
            assert self.pools.swa_pool is not None and self._out_swa is not None
            self.pools.swa_pool.set_kv(self._swa_index[layer_idx], self._out_swa, k, v)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    # ------------------------------------------------------------------ rebuild
    def load_prefix(self, prefix: torch.Tensor) -> None:
        """Fill the attention layers with the K/V of ``prefix`` (slots of tokens ``[0, n)``)."""
        n = len(prefix)
        if n == 0:
            return
        pools, layout = self.pools, self.pools.layout
        for i, layer_idx in enumerate(layout.kv_layers):
            k, v = pools.kv_pool.get_kv(i, prefix)
            self._layer(layer_idx, DynamicLayer).update(_bhsd(k), _bhsd(v))
        if layout.swa_layers:
            assert pools.swa_pool is not None and layout.sliding_window is not None
            window = prefix[max(0, n - (layout.sliding_window - 1)):]
            swa = pools.swa_slots(window)
            for i, layer_idx in enumerate(layout.swa_layers):
                layer = self._layer(layer_idx, DynamicSlidingWindowLayer)
                k, v = pools.swa_pool.get_kv(i, swa)
                layer.update(_bhsd(k), _bhsd(v))
                layer.cumulative_length = n  # tokens seen, of which only the window is kept

    def bind_state(self, slot: int, resume: bool) -> None:
        """Make every recurrent layer's conv and SSM state a view of state slot ``slot``; the
        model then updates our pool in place. ``resume``: the slot holds the state after the
        prefix (else the layer starts from nothing, exactly as a fresh prefill)."""
        pool = self.pools.state_pool
        assert pool is not None
        for i, layer_idx in enumerate(self.pools.layout.state_layers):
            layer = self._layer(layer_idx, LinearAttentionLayer)
            conv, ssm = pool.conv[i, slot:slot + 1], pool.ssm[i, slot:slot + 1]
            layer.conv_states[0], layer.recurrent_states[0] = conv, ssm
            layer.conv_kernel_size[0] = conv.shape[-1]
            layer.is_conv_states_initialized[0] = layer.is_recurrent_states_initialized[0] = True
            layer.has_previous_state[0] = resume
            # transformers annotates both as None (set lazily); they are plain attributes
            vars(layer).update(device=conv.device, dtype=conv.dtype)

    def _layer(self, layer_idx: int, kind: type[_Layer]) -> _Layer:
        layer = self.layers[layer_idx]
        if not isinstance(layer, kind):
            raise TypeError(f"layer {layer_idx} is a {type(layer).__name__}, expected {kind.__name__}")
        return layer


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    """``[n, heads, dim]`` (pool) -> ``[1, heads, n, dim]`` (transformers)."""
    return x.transpose(0, 1).unsqueeze(0)


# ====================================================================== adapter
class ModelAdapter:
    """One forward step of one request: ``tokens + req_to_token row + state slot -> logits``.

    Args:
        model: a transformers causal LM whose cache is a ``DynamicCache`` (see module doc).
        pools: :class:`ModelPools` built for ``CacheLayout.from_model(model)``.
    """

    def __init__(self, model: PreTrainedModel, pools: ModelPools) -> None:
        self.model = model
        self.pools = pools
        self.layout = pools.layout

    def forward(self, tokens: torch.Tensor, *, start: int, row: torch.Tensor,
                state_slot: int | None) -> torch.Tensor:
        """Compute tokens ``[start, start + len(tokens))`` of a sequence.

        Args:
            tokens: 1-D int64 token ids of the positions computed now.
            start: tokens before them, whose K/V is in ``row[:start]`` (and whose state is in
                ``state_slot`` for a hybrid model).
            row: KV slots of the sequence, ``len(row) >= start + len(tokens)``; the new K/V
                is written at ``row[start:start + len(tokens)]``.
            state_slot: the request's own state slot (updated in place); ``None`` exactly when
                the model has no recurrent layer.

        Returns:
            Logits ``[len(tokens), vocab]`` (float32).

        Raises:
            ValueError: a bad row length, a missing or unexpected state slot, or a sliding
                window whose SWA KV is gone.
        """
        end = start + len(tokens)
        if len(row) < end:
            raise ValueError(f"row has {len(row)} slots, need {end}")
        if (state_slot is None) == self.layout.hybrid:
            raise ValueError("state_slot must be given exactly when the model has recurrent layers")
        cache = PoolBackedCache(self.model, self.pools, row[start:end])
        cache.load_prefix(row[:start])
        if state_slot is not None:
            cache.bind_state(state_slot, resume=start > 0)
        with torch.no_grad():
            out = self.model(input_ids=tokens[None], cache=cache, use_cache=True,
                             position_ids=torch.arange(start, end)[None])
        return out.logits[0]

    def reference_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of a full forward over ``tokens`` without any cache: ``[len, vocab]``."""
        with torch.no_grad():
            out = self.model(input_ids=tokens[None], use_cache=False,
                             position_ids=torch.arange(len(tokens))[None])
        return out.logits[0]
