"""The after-every-rule checks of the reliability harness (mixed into ``Harness``), and the
idle leak check that ends every example.

* ``check``: ``sanity_check()``; the library's tree equals the model's page by page; the slot
  ledger of every pool (free + the tree's + each request's == capacity, each slot once, no held
  slot free); the sizes (evictable / protected per component); the contents: every held slot
  (device KV, SWA KV, states, host KV and states) holds the label of its (namespace, prefix).
* ``wind_down`` + ``check_idle_leaks``: abort every request, land every copy; then with no
  lock held every pool ``available + evictable == capacity``, and after evicting everything
  every pool is whole again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from tests.helpers.reliability_harness import Harness
    from tests.helpers.reliability_refmodel import Page


def t64(xs: Any) -> torch.Tensor:
    return torch.tensor(list(xs), dtype=torch.int64)


class HarnessChecks:
    """Mixed into :class:`tests.helpers.reliability_harness.Harness`."""

    def check(self: Harness) -> None:
        """After every rule: invariants, the tree equals the model's, the slot ledger, sizes
        and contents."""
        c, model, ps = self.cache, self.model, self.ps
        c.sanity_check()
        view = self.view()
        model.require_equal(view)
        # ---- device KV: free + tree + requests == every slot, each exactly once
        tree = [s for ss in model.dev.values() for s in ss]
        owned = [s for r in self.reqs for s in r.cr.kv_indices.tolist() if s in r.own]
        assert len(owned) == sum(len(r.own) for r in self.reqs), "a request owns a slot it lost"
        held = tree + owned
        free_n = self.kv.full_available_size() if self.kind == "swa" else self.kv.available_size()
        assert len(set(held)) == len(held) and free_n + len(held) == self.kv.size, (
            f"KV ledger: {free_n} free + {len(tree)} tree + {len(owned)} requests "
            f"!= {self.kv.size}, or a slot held twice")
        held_t = t64(held)
        if held:
            assert not bool(self.kv.is_free(held_t).any()), "KV ledger: a held slot is free"
        # ---- states: free + tree + running == every slot
        sheld = list(model.dstate.values()) + [r.run for r in self.reqs]
        sheld_t = t64(sheld)
        assert len(set(sheld)) == len(sheld), "state ledger: a slot held twice"
        assert self.sp.available_size() + len(sheld) == self.sp.size, "state ledger"
        if sheld:
            assert not bool(self.sp.is_free(sheld_t).any()), "state ledger: a held slot is free"
        # ---- sizes
        locked_tokens = ps * len(model.locked_pages() & model.dev.keys())
        assert c.protected_size() == locked_tokens, (c.protected_size(), locked_tokens)
        assert c.evictable_size() == ps * len(model.dev) - locked_tokens
        assert c.state_protected_size() == sum(1 for p in model.dstate if model.locks[p])
        assert c.state_evictable_size() + c.state_protected_size() == len(model.dstate)
        # ---- contents: every held slot holds the label of its (namespace, prefix)
        want: list[float] = []
        live: list[bool] = []
        for p in model.dev:  # the same order as ``tree`` above
            want.extend(self.page_labels(p))
            live.extend([p not in model.tomb] * ps)
        for r in self.reqs:
            for s, w in zip(r.cr.kv_indices.tolist(), r.vals, strict=True):
                if s in r.own:
                    want.append(w)
                    live.append(s not in self.dead_own)
        if held:
            assert self.kvpool.k_all[0, held_t, 0, 0].tolist() == want, "device KV contents"
        if self.kind == "swa":
            assert self.dead_own <= set(owned)
            n_live = sum(live)
            assert self.kv.swa_used_size() == n_live, "SWA ledger"
            assert c.swa_evictable_size() + c.swa_protected_size() == ps * (
                len(model.dev) - len(model.tomb))
            if held:
                sw = self.kv.translate(held_t)
                has = sw != 0
                assert has.tolist() == live, "SWA slots live where the model says"
                got = self.swapool.k_all[0, sw[has], 0, 0].tolist()
                assert got == [w for w, ok in zip(want, live, strict=True) if ok], "SWA KV contents"
        st_want = [float(self.label(*p)) for p in model.dstate] + [r.vals_state for r in self.reqs]
        if sheld:
            assert self.sp.conv[0, sheld_t, 0].tolist() == st_want, "state contents"
        if self.kind == "host":
            hc = self.hc
            assert hc.host_kv.used_size() == ps * len(model.host) == c.host_size()
            assert hc.host_state.used_size() == len(model.hstate)  # type: ignore[union-attr]
            if view.host_slots:
                hs: list[int] = []
                hw: list[float] = []
                for p, ss in view.host_slots.items():
                    hs.extend(ss)
                    hw.extend(self.page_labels(p))
                host_pool = hc.host_kv.pool  # type: ignore[attr-defined]
                assert host_pool.k_all[0, t64(hs), 0, 0].tolist() == hw, "host KV contents"
            if view.hstate_slots:
                pages = list(view.hstate_slots)
                idx = t64([view.hstate_slots[p] for p in pages])
                got_h = hc.host_state.conv[0, idx, 0].tolist()  # type: ignore[union-attr]
                assert got_h == [float(self.label(*p)) for p in pages], "host state contents"

    def page_labels(self: Harness, p: Page) -> list[float]:
        got = self._page_labels.get(p)
        if got is None:
            ns, toks = p
            base = len(toks) - self.ps
            got = self._page_labels[p] = [float(self.label(ns, toks[:base + i + 1]))
                                          for i in range(self.ps)]
        return got

    # ================================================================ idle
    def wind_down(self: Harness) -> None:
        """Abort every request, land every copy, drop every pin: the cache is idle."""
        for r in list(self.reqs):
            self.abort(r)
        while self.pins:
            self.unpin(0)
        if self.kind == "host":
            self.hold(False)
            self.release_poll()
        self.check()

    def check_idle_leaks(self: Harness) -> None:
        """With no locks held, every pool's ``available + evictable == capacity``; and after
        evicting everything, every pool is whole again."""
        c, kv, sp = self.cache, self.kv, self.sp
        assert c.protected_size() == 0 and c.state_protected_size() == 0
        full_avail = kv.full_available_size() if self.kind == "swa" else kv.available_size()
        assert full_avail + c.evictable_size() == kv.size, "device KV leak"
        assert sp.available_size() + c.state_evictable_size() == sp.size, "state leak"
        if self.kind == "swa":
            assert kv.swa_available_size() + c.swa_evictable_size() == kv.swa_size, "SWA leak"
            assert c.swa_protected_size() == 0
        if self.kind == "host":
            hk, hs = self.hc.host_kv, self.hc.host_state
            assert hk.available_size() + c.host_size() == hk.size, "host KV leak"
            assert hs.available_size() + len(self.model.hstate) == hs.size, "host state leak"  # type: ignore[union-attr]
        c.evict(10**9)
        if self.kind == "host":
            c.evict_host(10**9)
        c.sanity_check()
        assert c.tree.num_nodes == 0, c.pretty_print()
        assert sp.available_size() == sp.size
        assert (kv.full_available_size() if self.kind == "swa" else kv.available_size()) == kv.size
        if self.kind == "swa":
            assert kv.swa_available_size() == kv.swa_size
        if self.kind == "host":
            assert self.hc.host_kv.available_size() == self.hc.host_kv.size
            assert self.hc.host_state.available_size() == self.hc.host_state.size  # type: ignore[union-attr]
