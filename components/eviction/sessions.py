"""The session hint as evidence for the ``gds_adaptive`` walk (:mod:`components.eviction.
adaptive`): which live state is the latest each session stored.

An engine that knows which conversation or agent a request belongs to passes it as the hint
``extra={"session_id": sid}`` (:mod:`radix.hints`). Every state stored while serving a
request of session ``sid`` is *of* that session; per session the states are kept in the
order they were stored, and each state with a session has a *tag*:

* ``latest``: the most recent live state of its session (where a conversation or agent loop
  is most likely to resume: its next request extends the context its last one ended with);
* ``stale``: its session has stored a later state since (an older turn, a chunk checkpoint
  of a prompt that went on): a continuing session rarely comes back to it;
* ``none``: stored without a session (no hint): the walk weighs it as before.

When a session's latest state leaves, the one stored before it becomes the latest (the
session would now resume there). Whether the tags predict reuse is *learned*, as the walk
learns the hit rate of its kinds: hits per state per store of each tag (exposure and hits
decayed with the walk's half-life; prior: ``prior`` state-stores at the rate of all tagged
states, so a tag is believed average until watched for as long as that), and the tag's
weight is its rate relative to that of all tagged states, quantised to quarter powers of two in ``[1/64, 64]`` so that a state's
weight changes (and its heap entry is refreshed) only when the evidence moved by about 19 %.
A workload where sessions carry no information gets weights near 1; without hints every
state is ``none`` and the walk is exactly the one without this module.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from typing import Any

__all__ = ["LATEST", "NONE", "STALE", "SessionEvidence", "TAG_NAMES"]

NONE, LATEST, STALE = 0, 1, 2
TAGS = (NONE, LATEST, STALE)
TAG_NAMES = ("none", "latest", "stale")
STEPS_PER_OCTAVE = 4
"""Tag weights are quantised to ``2 ** (k / STEPS_PER_OCTAVE)``."""
WEIGHT_RANGE = 64.0
"""Tag weights are clamped to ``[1 / WEIGHT_RANGE, WEIGHT_RANGE]``."""


class SessionEvidence:
    """Per live state: its session and tag; per tag: the learned hit rate and weight
    (module docstring). The walk calls :meth:`on_hint` per request, :meth:`on_set`,
    :meth:`on_hit`, :meth:`on_remove` per state event and :meth:`tick` per store, and reads
    :meth:`weight`."""

    def __init__(self, decay: float) -> None:
        self._decay = decay
        #: The session of the request being served (``None``: no hint).
        self.current: Hashable | None = None
        self.session_of: dict[int, Hashable] = {}
        #: Session -> its live states, oldest first (dict as an ordered set).
        self.states: dict[Hashable, dict[int, None]] = {}
        self.count = [0] * len(TAGS)
        self.exposure = [0.0] * len(TAGS)
        self.rate_hits = [0.0] * len(TAGS)
        self.weights = [1.0] * len(TAGS)

    def on_hint(self, extra: Mapping[str, Any] | None) -> None:
        self.current = None if extra is None else extra.get("session_id")

    def tag(self, nid: int) -> int:
        s = self.session_of.get(nid)
        if s is None:
            return NONE
        return LATEST if next(reversed(self.states[s])) == nid else STALE

    def weight(self, nid: int) -> float:
        return self.weights[self.tag(nid)]

    def on_set(self, nid: int) -> int | None:
        """A state was stored on node ``nid`` for the current request. Returns the node whose
        state turned ``stale`` by it (to be reweighed), or ``None``."""
        s = self.current
        if s is None:
            self.count[NONE] += 1
            return None
        self.session_of[nid] = s
        states = self.states.setdefault(s, {})
        prev = next(reversed(states)) if states else None
        states[nid] = None
        self.count[LATEST] += 1
        if prev is not None:
            self.count[LATEST] -= 1
            self.count[STALE] += 1
        return prev

    def on_hit(self, nid: int) -> None:
        self.rate_hits[self.tag(nid)] += 1.0

    def on_remove(self, nid: int) -> int | None:
        """The state on ``nid`` left. Returns the node that became its session's ``latest``
        by it (its weight rose: the lazy heap needs no fresh entry), or ``None``."""
        s = self.session_of.get(nid)
        if s is None:
            self.count[NONE] -= 1
            return None
        tag = self.tag(nid)
        del self.session_of[nid]
        states = self.states[s]
        del states[nid]
        self.count[tag] -= 1
        if not states:
            del self.states[s]
            return None
        if tag != LATEST:
            return None
        promoted = next(reversed(states))
        self.count[STALE] -= 1
        self.count[LATEST] += 1
        return promoted

    def tagged_rate(self) -> float:
        """Hits per state per store of all states with a session (one pseudo-hit)."""
        return (self.rate_hits[LATEST] + self.rate_hits[STALE] + 1.0) / \
            (self.exposure[LATEST] + self.exposure[STALE] + 1.0)

    def rate(self, t: int, prior: float) -> float:
        """Hits per state per store of tag ``t``, with ``prior`` pseudo-state-stores at the
        tagged rate."""
        return (self.rate_hits[t] + prior * self.tagged_rate()) / (self.exposure[t] + prior)

    def tick(self, prior: float) -> list[int]:
        """One store: age the rates, learn the weights (``prior``: see :meth:`rate`).
        Returns the tags whose weight changed (their states are to be reweighed)."""
        f = self._decay
        for t in TAGS:
            self.exposure[t] = self.exposure[t] * f + self.count[t]
            self.rate_hits[t] *= f
        if not self.session_of:
            return []
        tagged = self.tagged_rate()
        changed = []
        for t in (LATEST, STALE):
            k = round(STEPS_PER_OCTAVE * math.log2(self.rate(t, prior) / tagged))
            w = min(max(2.0 ** (k / STEPS_PER_OCTAVE), 1.0 / WEIGHT_RANGE), WEIGHT_RANGE)
            if w != self.weights[t]:
                self.weights[t] = w
                changed.append(t)
        return changed

    def check(self, live: set[int]) -> None:
        assert set(self.session_of) <= live, "session evidence holds a state that left"
        tags = [self.tag(n) for n in live]
        assert self.count == [tags.count(t) for t in TAGS], "session tag counts wrong"
        assert sum(len(v) for v in self.states.values()) == len(self.session_of), \
            "session state lists out of step"
