"""A host KV pool with the page calls SGLang's storage backends make on one (no pytest: the
anchor interpreter imports it too)."""

from __future__ import annotations

import torch


class HostPool:
    """A host KV pool with the page calls SGLang's storage backends make on one:
    ``[slots, 2 (K/V), layers, heads, head_dim]`` float16, pages of ``page_size`` slots."""

    def __init__(self, slots: int, page_size: int, layers: int = 2, heads: int = 2, dim: int = 4) -> None:
        self.page_size = page_size
        self.buf = torch.zeros(slots, 2, layers, heads, dim, dtype=torch.float16)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self.buf[index:index + self.page_size]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(self.buf[: self.page_size].numel(), dtype=self.buf.dtype)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self.buf[index:index + self.page_size] = data_page.reshape(self.buf[: self.page_size].shape)
