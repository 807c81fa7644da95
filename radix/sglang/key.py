"""SGLang's ``RadixKey``: a list-like key of token ids in a namespace.

The key keeps ``token_ids`` as given (a list, an ``array('q')``, a 1-D tensor), so
``RadixKey([1, 2]).token_ids == [1, 2]``; ``len`` / iteration / ``key[i]`` / ``key[a:b]`` read
it (an index gives a one-token key, as SGLang's does); ``limit`` caps the tokens without a
copy. The namespace is ``extra_key`` (a LoRA id, a cache salt of the engine's choosing) and
``cache_salt``: keys whose namespaces differ never share nodes. EAGLE bigram keys
(``is_bigram=True``) are refused: this library keys tokens.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from typing import Any

from radix.tree import as_tokens


class RadixKey:
    """Token ids plus a namespace (SGLang 0.5.23's ``RadixKey``).

    Args:
        token_ids: the tokens (kept as given).
        extra_key: namespace (hashable), or ``None``.
        is_bigram: must be ``False``.
        limit: use only ``token_ids[:limit]`` (``None``: all).
        cache_salt: a second namespace part, or ``None`` (an empty salt is ``None``).

    Raises:
        ValueError: ``is_bigram=True``, or a negative ``limit``.
    """

    __slots__ = ("token_ids", "extra_key", "cache_salt", "is_bigram", "limit")

    def __init__(self, token_ids: Any, extra_key: Any = None, is_bigram: bool = False,
                 limit: int | None = None, cache_salt: str | None = None) -> None:
        if is_bigram:
            raise ValueError("is_bigram=True: EAGLE bigram keys are not supported by this cache")
        if limit is not None and limit < 0:
            raise ValueError(f"limit must be >= 0 or None, got {limit}")
        self.token_ids = token_ids
        self.extra_key = extra_key
        self.cache_salt = cache_salt or None
        self.is_bigram = False
        self.limit = limit

    def __len__(self) -> int:
        n = len(self.token_ids)
        return n if self.limit is None else min(n, self.limit)

    def __iter__(self) -> Iterator[Any]:
        t = self.token_ids
        for i in range(len(self)):
            yield t[i]

    def __getitem__(self, idx: int | slice) -> RadixKey:
        n = len(self)
        if isinstance(idx, int):
            if idx < 0:
                idx += n
            if not 0 <= idx < n:
                raise IndexError(f"RadixKey index out of range: {idx}")
            idx = slice(idx, idx + 1)
        start, stop, step = idx.indices(n)
        if step != 1:
            raise ValueError("RadixKey slice step must be 1")
        return RadixKey(self.token_ids[start:stop], self.extra_key, cache_salt=self.cache_salt)

    def __repr__(self) -> str:
        preview = self.token_ids[:10]
        if isinstance(preview, array):
            preview = preview.tolist()
        elif hasattr(preview, "tolist"):
            preview = preview.tolist()
        more = "..." if len(self.token_ids) > 10 else ""
        return (f"RadixKey(extra_key={self.extra_key!r}, cache_salt={self.cache_salt!r}, "
                f"token_ids={preview}{more}, is_bigram=False)")

    def page_aligned(self, page_size: int) -> RadixKey:
        """The key cut to whole pages."""
        if page_size == 1:
            return self
        return self[: len(self) // page_size * page_size]

    def match(self, other: RadixKey, page_size: int = 1) -> int:
        """Tokens shared with ``other`` from the start, rounded down to whole pages.

        Raises:
            ValueError: the namespaces differ.
        """
        if (self.extra_key, self.cache_salt) != (other.extra_key, other.cache_salt):
            raise ValueError("RadixKey operations require matching extra_key and cache_salt")
        a, b = list(self), list(other)
        n = 0
        for x, y in zip(a, b, strict=False):
            if x != y:
                break
            n += 1
        return n // page_size * page_size

    # ---------------------------------------------------------------- library side
    @property
    def namespace(self) -> Any:
        """The library's ``extra_key`` of this key: ``extra_key``, or ``(extra_key,
        cache_salt)`` when salted."""
        return self.extra_key if self.cache_salt is None else (self.extra_key, self.cache_salt)

    def tokens(self) -> array:
        """The token ids (cut to ``limit``) as the library's validated ``array('q')``.

        Raises:
            TypeError / ValueError: not token ids (ints >= 0).
        """
        t = self.token_ids
        if self.limit is not None and self.limit < len(t):
            t = t[: self.limit]
        return as_tokens(t, "key.token_ids")


def as_radix_key(key: Any) -> RadixKey:
    """``key`` itself when it is a :class:`RadixKey`, else a key over the token ids given.

    Raises:
        TypeError: ``None`` or another non-sequence.
    """
    if isinstance(key, RadixKey):
        return key
    if key is None or not hasattr(key, "__len__"):
        raise TypeError(f"key must be a RadixKey or token ids, got {type(key).__name__}")
    return RadixKey(key)
