"""Components: one per kind of per-node data (``base.Component`` is the contract).

| module | component | value on a node |
|---|---|---|
| ``kv`` | ``KVComponent`` | full-attention KV slots (one per token) |
| ``state`` | ``StateComponent`` | a recurrent-state checkpoint (one slot) |
| ``swa`` | ``SWAComponent`` | sliding-window KV (live or tombstoned) |

``eviction``: every eviction order (the policy registry, the KV key functions, the
GreedyDual-Size state walks and their heap); ``ordered``: the ordered node set every LRU-like
walk uses. Nothing here imports ``radix`` at run time.
"""
