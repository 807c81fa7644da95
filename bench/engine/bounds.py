"""Infinite-memory bounds on the prefix hit of a trace, at trace-block granularity.

Requests are taken in order. Before request ``i`` is inserted, a trie over the block-id lists
of requests ``0 .. i-1`` gives its longest matched prefix of ``m`` blocks, and

* **every-block bound** (KV-only cache of unlimited size: any prefix is reusable):
  ``hit_i = min(m * B, cap_i)``;
* **sparse-checkpoint bound** (a hybrid model with unlimited memory that keeps recurrent
  states only where Marconi's admission rule puts them): the match may only stop at a trie
  node that is the last *full* block of an earlier request (depth ``input_length // B``) or
  that already had two or more children (a branch point created by earlier requests);
  ``hit_i = (deepest such depth d <= m with d * B <= cap_i) * B``.

Both are summed over requests and divided by the total prompt tokens. Output tokens are
ignored (the traces do not hash them).

Two conventions, chosen by ``exclude_last_token``:

* ``False`` (the trace notes' method, ``cap_i = input_length``): reproduces their figures
  for the Mooncake conversation trace, 0.3736 (every block) and 0.3586 (sparse).
* ``True`` (the replay's convention): an engine matches ``prompt[:-1]`` so that at least one
  token is recomputed for the logits, hence ``cap_i = input_length - 1``; a checkpoint exactly
  at the prompt's end is then unusable for an identical later prompt, so the sparse bound
  only counts stop points ``d * B <= input_length - 1``. Hits are also aligned down to
  ``page_size``. This is the ceiling to read the replay's token hit rate against.

Complexity: O(total blocks) time and O(unique block prefixes) memory (a dict keyed by
``(parent node, block id)``); about 0.5 s for the 288,500 blocks of the Mooncake trace.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bench.traces.loader import TraceRequest

__all__ = ["Bounds", "compute_bounds"]


@dataclass(frozen=True, slots=True)
class Bounds:
    """Infinite-memory prefix-hit bounds of one trace (all counts in tokens)."""

    prompt_tokens: int
    every_block_hit_tokens: int
    sparse_hit_tokens: int
    exclude_last_token: bool
    page_size: int

    @property
    def every_block_hit_rate(self) -> float:
        """Token hit rate if every cached block were reusable (KV-only ceiling)."""
        return self.every_block_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def sparse_hit_rate(self) -> float:
        """Token hit rate with states only at earlier prompt ends and branch points."""
        return self.sparse_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def as_dict(self) -> dict[str, float | int | bool]:
        """Plain JSON-ready values, rates included."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "every_block_hit_tokens": self.every_block_hit_tokens,
            "sparse_hit_tokens": self.sparse_hit_tokens,
            "every_block_hit_rate": self.every_block_hit_rate,
            "sparse_hit_rate": self.sparse_hit_rate,
            "exclude_last_token": self.exclude_last_token,
            "page_size": self.page_size,
        }


def compute_bounds(
    trace: Sequence[TraceRequest], *, exclude_last_token: bool = False, page_size: int = 1
) -> Bounds:
    """Both infinite-memory bounds of ``trace`` (see the module docstring).

    Args:
        trace: requests in replay order; each request's ``block_ids`` and ``block_size`` are
            used (requests may not mix block sizes).
        exclude_last_token: ``True`` for the replay's convention (match ``prompt[:-1]``).
        page_size: hits are aligned down to a multiple of this many tokens (``>= 1``).

    Raises:
        ValueError: ``page_size < 1`` or requests with different block sizes.
    """
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    if len({r.block_size for r in trace}) > 1:
        raise ValueError("all requests of a trace must share one block size")
    child_of: dict[tuple[int, int], int] = {}  # (parent node, block id) -> node; root is 0
    num_children: list[int] = [0]
    is_prompt_end: list[bool] = [False]  # last full block of some earlier request
    prompt_tokens = every_tokens = sparse_tokens = 0
    for req in trace:
        block = req.block_size
        cap = req.input_length - 1 if exclude_last_token else req.input_length
        ids = req.block_ids
        full = req.input_length // block  # depth of the request's last full block
        node = depth = stop_depth = end_node = 0
        # 1. match against earlier requests only
        for b in ids:
            nxt = child_of.get((node, b))
            if nxt is None:
                break
            node = nxt
            depth += 1
            if (is_prompt_end[node] or num_children[node] >= 2) and depth * block <= cap:
                stop_depth = depth
            if depth == full:
                end_node = node
        prompt_tokens += req.input_length
        every_tokens += max(0, min(depth * block, cap)) // page_size * page_size
        sparse_tokens += min(stop_depth * block, cap) // page_size * page_size
        # 2. insert the rest of the request, then mark its last full block
        for b in ids[depth:]:
            new = len(num_children)
            child_of[(node, b)] = new
            num_children[node] += 1
            num_children.append(0)
            is_prompt_end.append(False)
            node = new
            depth += 1
            if depth == full:
                end_node = node
        if full:
            is_prompt_end[end_node] = True
    return Bounds(prompt_tokens, every_tokens, sparse_tokens, exclude_last_token, page_size)
