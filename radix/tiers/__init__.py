"""Tiers below the device pools, as the cache holds them: the host tier (HiCache L2,
:mod:`radix.tiers.host`) and the shared storage tier below it (L3, :mod:`radix.tiers.storage`).
Both are tree-aware (they know nodes); the pools, copies and storage backends they drive are in
:mod:`hicache`."""
