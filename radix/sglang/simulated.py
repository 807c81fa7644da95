"""The allocator of a simulated cache (SGLang's ``create_simulated``): no pool behind it.

The tree stores the caller's opaque values shifted by ``page_size`` (the library's slot ids
start after the padding page; SGLang's simulated caches take any int >= 0, token ids
included); the front end shifts them back on the way out. Nothing is ever handed out here;
``free`` forwards what the tree gives back, shifted back, to the mock allocator a test
passed (and keeps it in ``freed``).
"""

from __future__ import annotations

from typing import Any

import torch


class SimulatedAllocator:
    """A stand-in KV allocator with no pool: every id >= ``page_size`` is in range, nothing
    is checked beyond that (no free mask: the tree cannot tell held slots from free ones).

    Args:
        page_size: tokens per page.
        mock: an object whose ``free(indices)`` sees what the tree frees, or ``None``.
    """

    #: Slot ids are accepted up to here (the tree's range check).
    size = 1 << 62

    def __init__(self, page_size: int, mock: Any = None) -> None:
        self.page_size = page_size
        self.device = torch.device("cpu")
        self.mock = mock
        self.freed: list[int] = []

    def alloc(self, n: int) -> torch.Tensor | None:
        """Nothing to hand out: always ``None``."""
        return None

    def available_size(self) -> int:
        return 0

    def free(self, indices: torch.Tensor) -> None:
        out = indices - self.page_size
        self.freed.extend(out.tolist())
        free = getattr(self.mock, "free", None)
        if callable(free):
            free(out)
