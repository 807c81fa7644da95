"""Eviction orders, in one place: which node goes first when the cache needs room.

| module | what it holds |
|---|---|
| ``registry`` | the policy registry (``POLICY_REGISTRY``: name -> KV key function, state walk, knobs) and ``resolve_policy``; the KV key functions (``lru``, ``lfu``, ``slru``, ``priority``, ``tlru``, ``fifo``, ``mru``, ``filo``) |
| ``gds`` | ``GreedyDualHeap`` (the one GreedyDual-Size lazy heap) and the ``gds`` / ``gdsf`` state walks on it |
| ``adaptive`` | the ``gds_adaptive`` state walk: a duel of GreedyDual orders, one heap each |
| ``duel`` | the duel's ghosts and its KV-leaf order (``KVOrderDuel``) |

A policy is a KV key function (smaller key evicted first; the KV component keeps the leaves in
one ordered set, ``components.ordered``) plus the name of its recurrent-state walk (``lru`` on
the state's own stamps, ``joint`` on the node's, or a GreedyDual walk here). Nothing here
imports ``radix`` at run time.
"""
