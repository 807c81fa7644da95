"""HiCache configuration (SGLang's server-argument names)."""

from __future__ import annotations

import math
from dataclasses import dataclass

#: Write policies (SGLang ``--hicache-write-policy``).
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")


@dataclass(frozen=True)
class HiCacheConfig:
    """Host (L2) tier of the prefix cache.

    Args:
        hicache_ratio: host pool size as a multiple of the device pool (default 2.0, SGLang's
            default); must be > 1 so the host can hold more than the device.
        hicache_size_bytes: host KV pool size in bytes instead of the ratio (``None``: use the
            ratio). Must also exceed the device pool.
        hicache_write_policy: ``write_through`` (back up a node when it is inserted),
            ``write_through_selective`` (once its hit count reaches 2), ``write_back`` (only
            when it is evicted from device).
        load_back_threshold: host-only chains shorter than this are not loaded back [tokens]
            (SGLang's default 10: reloading a few tokens costs more than recomputing them).

    Raises:
        TypeError / ValueError: naming the argument.
    """

    hicache_ratio: float = 2.0
    hicache_size_bytes: int | None = None
    hicache_write_policy: str = "write_through"
    load_back_threshold: int = 10

    def __post_init__(self) -> None:
        r = self.hicache_ratio
        if isinstance(r, bool) or not isinstance(r, (int, float)):
            raise TypeError(f"hicache_ratio must be a number > 1, got {type(r).__name__}")
        if not math.isfinite(r) or r <= 1.0:
            raise ValueError(f"hicache_ratio must be a finite number > 1 (host larger than device), got {r}")
        b = self.hicache_size_bytes
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b <= 0):
            raise ValueError(f"hicache_size_bytes must be a positive int or None, got {b!r}")
        if self.hicache_write_policy not in WRITE_POLICIES:
            raise ValueError(
                f"hicache_write_policy={self.hicache_write_policy!r} is unknown; expected one of "
                f"{list(WRITE_POLICIES)}"
            )
        t = self.load_back_threshold
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise ValueError(f"load_back_threshold must be an int >= 0 [tokens], got {t!r}")
