"""Per-request hints: what an engine knows about a request besides its tokens.

A hint is evidence for the eviction walk, never part of a key: two requests with different
hints and the same ``(extra_key, tokens)`` share every node. An engine passes the hints of
the request a call serves as ``extra`` (``RadixCache.match_prefix(..., extra=...)``,
``insert(..., extra=...)``, ``CacheRequest.extra`` for the request helpers)::

    extra = {"session_id": req.session_id}   # SGLang's Req.session_id, a vLLM conversation id

Keys (every one optional; any other key is refused, so a misspelt hint is not silently lost):

* ``session_id``: the conversation / agent the request belongs to (``str`` or ``int``, not
  ``bool``). The ``gds_adaptive`` walk reads "the latest state each session stored" as
  evidence of where the session resumes (:mod:`components.eviction.adaptive`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["HINT_KEYS", "check_extra"]

HINT_KEYS = ("session_id",)
"""The hint keys the cache understands."""


def check_extra(extra: Any, name: str = "extra") -> Mapping[str, Any] | None:
    """``extra`` itself once it is ``None`` or a valid hint mapping (module docstring).

    Raises:
        TypeError: ``extra`` is not a mapping, or ``session_id`` is not a ``str`` / ``int``
            (``bool`` refused).
        ValueError: a key that is not one of :data:`HINT_KEYS`.
    """
    if extra is None:
        return None
    if not isinstance(extra, Mapping):
        raise TypeError(f"{name} must be a mapping of hints such as {{'session_id': ...}} "
                        f"or None, got {type(extra).__name__}")
    for k in extra:
        if k not in HINT_KEYS:
            raise ValueError(f"{name} has an unknown hint {k!r}; known: {', '.join(HINT_KEYS)}")
    sid = extra.get("session_id")
    if sid is not None and (isinstance(sid, bool) or not isinstance(sid, (str, int))):
        raise TypeError(f"{name}['session_id'] must be a str or an int, got {type(sid).__name__}")
    return extra
