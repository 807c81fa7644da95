"""Host (L2) tier: host pools mirroring the device pools and the copies between them.

Contract: ``device slots <-> host slots`` (and, later, ``host slots <-> storage pages``).
"""

from hicache.config import WRITE_POLICIES, HiCacheConfig
from hicache.controller import HiCacheController, Transfer
from hicache.host_pools import PoolPair, copy_kv, copy_state, mirror_kv, mirror_state

__all__ = [
    "WRITE_POLICIES",
    "HiCacheConfig",
    "HiCacheController",
    "PoolPair",
    "Transfer",
    "copy_kv",
    "copy_state",
    "mirror_kv",
    "mirror_state",
]
