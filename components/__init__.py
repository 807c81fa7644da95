"""Components: one per kind of per-node data (``base.Component`` is the contract).

| module | component | value on a node |
|---|---|---|
| ``kv`` | ``KVComponent`` | full-attention KV slots (one per token) |
| ``state`` | ``StateComponent`` | a recurrent-state checkpoint (one slot) |
| ``swa`` | ``SWAComponent`` | sliding-window KV (live or tombstoned) |

``gds`` / ``gds_adaptive``: the GreedyDual-Size state walks; ``ordered``: the ordered node set
every LRU-like walk uses. Nothing here imports ``radix`` at run time.
"""
