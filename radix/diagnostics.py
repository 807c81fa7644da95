# Mixin of RadixCache: its methods annotate ``self: RadixCache`` so their bodies are checked
# against the full cache. mypy reports such a self type, not a supertype of the mixin, as [misc]
# (RadixCache cannot be a base here: it inherits this mixin), so that one code is off in this file.
# mypy: disable-error-code="misc"
"""Counters, a readable dump of the tree, and the invariant check (mixed into RadixCache)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radix.cache import RadixCache
    from radix.node import TreeNode


class Diagnostics:
    """``stats``, ``pretty_print``, ``sanity_check``."""

    def stats(self: RadixCache) -> dict[str, Any]:
        """Counters: match calls, requested / usable-hit / KV-hit tokens, evicted tokens,
        states and SWA tokens, inserted tokens and states, sizes per component, the watermark."""
        st: dict[str, Any] = dict(self._stats)
        st.update(
            num_nodes=self.tree.num_nodes,
            kv_evictable=self.evictable_size(),
            kv_protected=self.protected_size(),
            state_evictable=self.state_evictable_size(),
            state_protected=self.state_protected_size(),
            swa_evictable=self.swa_evictable_size(),
            swa_protected=self.swa_protected_size(),
            watermark=self.watermark,
            policy=self.policy.name,
            host_tokens=self.host_size(),
        )
        return st

    def pretty_print(self: RadixCache, file: Any = None) -> str:
        """Render the tree (one line per node: span, tokens, locks, state, SWA); print it to
        ``file`` when given; return the text."""
        lines = [f"root  policy={self.policy.name} page_size={self.page_size}"]

        def rec(node: TreeNode, indent: int) -> None:
            for child in sorted(node.children.values(), key=lambda c: c.id):
                head = child.key[:6].tolist()
                swa = ""
                if self.hicache is not None:
                    where = ("dev+host" if child.host_value is not None else "dev") if (
                        child.kv_value is not None) else "host"
                    swa = f" at={where} host_state={child.host_state_slot}"
                if self.swa is not None:
                    swa = f" swa={'tomb' if child.swa_tombstone else 'live'} swa_lock={child.swa_lock}"
                lines.append(
                    f"{'  ' * indent}[{child.start},{child.depth}) id={child.id} "
                    f"key={head}{'...' if len(child.key) > 6 else ''} kv_lock={child.kv_lock} "
                    f"state={child.state_slot} state_lock={child.state_lock}{swa} "
                    f"t={child.last_access_time}"
                )
                rec(child, indent + 1)

        rec(self.root, 1)
        text = "\n".join(lines)
        if file is not None:
            print(text, file=file)
        return text

    def sanity_check(self: RadixCache) -> None:
        """Recompute every counter and check every invariant (SPEC section 6); raise
        ``AssertionError`` with the printed tree on failure."""
        from radix.invariants import check_cache

        try:
            check_cache(self)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.pretty_print()}") from None
