"""KV cache events: which pages this cache holds, published for cache-aware routers.

A router (SGLang's router, NVIDIA Dynamo, llm-d) keeps, per engine instance, the set of pages
the instance holds, and sends a request where its prefix already is. It learns that set from
three events, with the fields SGLang 0.5.23 and vLLM declare (``KVCacheEvent`` subclasses
there)::

    BlockStored(block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
                lora_name, cache_salt, group_idx)
    BlockRemoved(block_hashes, medium, group_idx)
    AllBlocksCleared()

``to_dict()`` gives the tagged map the engines encode; ``components.event_wire`` (msgspec, an
optional dependency) encodes whole batches in either engine wire shape, and
``components.event_publisher`` publishes them over ZMQ as the engines do. The tenant of a page
is published as ``lora_id`` / ``lora_name`` / ``cache_salt`` (:func:`namespace_labels`, for
every namespace kind the library accepts).

On a hybrid model a match is usable only up to a recurrent-state checkpoint, so the page set
alone overstates what a request can reuse. Checkpoints are published as their own cache group
(vLLM's ``group_idx``): KV pages are group :data:`KV_GROUP` (0); a state valid after a node's
last page is a ``BlockStored`` of that one page in group :data:`STATE_GROUP` (1), and a
``BlockRemoved`` of it when the state is freed (device states, ``medium="GPU"``). A router's
usable hit is then the longest chain of held KV pages that ends at a page held in group 1.

Block hashes form a chain over whole pages, seeded by the namespace, so a page's hash names
its whole prefix and is the same wherever and whenever the prefix is cached (a split of a
node changes nothing a router sees)::

    seed  = SHA-256(b"hpc-l3/1\\0" + len(tag) + tag + encode_namespace(extra_key))
    d[0]  = SHA-256(seed   + tokens[0:P]   as int64 little-endian)
    d[i]  = SHA-256(d[i-1] + tokens[iP:(i+1)P] as int64 little-endian)
    block_hash[i] = the first 8 bytes of d[i], big-endian, as a signed int64

(the chain of ``hicache.storage.keys``, the L3 page keys; the published int64 is how SGLang
turns its SHA-256 page hashes into event hashes). The first page of a namespace has
``parent_block_hash = None``. A namespace with no stable encoding (``encode_namespace``
returns ``None``) is seeded from its type and ``repr`` instead: its hashes are stable within
one process only.

When events are emitted (``medium``: ``"GPU"`` device pool, ``"CPU_PINNED"`` host pool)::

    a node's device KV is created (insert) or comes back (load-back, insert
    over a host-only node)                                 -> BlockStored  GPU
    a node gets a host copy (HiCache backup, L3 prefetch)  -> BlockStored  CPU_PINNED
    a node's device KV leaves (eviction, demotion)         -> BlockRemoved GPU
    a node's host copy leaves (host eviction)              -> BlockRemoved CPU_PINNED
    a node's device state is cached / freed                -> BlockStored / BlockRemoved
                                                              GPU, group 1 (last page)
    reset()                                                -> AllBlocksCleared

A sliding-window tombstone keeps the node's full-attention KV: no event (the pages are still
held; a match only cannot *end* there). Consecutive events that continue each other are
merged, as SGLang does: a store whose first parent is the previous store's last hash (same
medium, group and tenant) extends it, consecutive removals of one medium and group become one.

Differences from SGLang 0.5.23's recorder: one event covers a node's pages (SGLang emits one
per page and then merges them the same way); a host copy is published when its host slots are
assigned, while the copy may still be in flight (SGLang waits for the copy to land; the node
stays locked until it does, so nothing reads a partial copy); the hash chain is this
library's (the L3 key chain), not SGLang's.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from components.base import Component
from hicache.storage.keys import chain_seed, encode_namespace, page_hashes

if TYPE_CHECKING:
    from components.base import InsertPlan
    from radix.node import TreeNode

#: ``medium`` of a device (L1) page, as SGLang names it.
GPU = "GPU"
#: ``medium`` of a host (L2) page, as SGLang names it.
CPU = "CPU_PINNED"
#: ``group_idx`` of KV pages (vLLM's KV cache group id).
KV_GROUP = 0
#: ``group_idx`` of recurrent-state checkpoints (hybrid models).
STATE_GROUP = 1

_DIGEST = 32  # bytes of one SHA-256 digest


@dataclass
class BlockStored:
    """Pages now held (SGLang / vLLM ``BlockStored``).

    Attributes:
        block_hashes: one int64 chain hash per page, in order.
        parent_block_hash: hash of the page before the first one (``None``: the first page
            of its namespace).
        token_ids: the pages' token ids, ``len == block_size * len(block_hashes)``.
        block_size: tokens per page (the cache's ``page_size``).
        lora_id: the adapter's int id (:func:`namespace_labels`), else ``None``.
        medium: ``"GPU"`` or ``"CPU_PINNED"``.
        lora_name: the adapter's name (:func:`namespace_labels`), or ``None``.
        cache_salt: the namespace's salt (:func:`namespace_labels`), or ``None``.
        group_idx: :data:`KV_GROUP` (KV pages) or :data:`STATE_GROUP` (a recurrent-state
            checkpoint valid at the end of the one page named).
    """

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = GPU
    lora_name: str | None = None
    cache_salt: str | None = None
    group_idx: int = KV_GROUP

    def to_dict(self) -> dict[str, Any]:
        """The tagged map SGLang 0.5.23 and vLLM encode: ``type``, then every field the
        engines declare without a default (``lora_id``, ``medium``, ``lora_name`` included,
        ``None`` when unset), then ``cache_salt`` when set and ``group_idx``."""
        out = _tagged(self, _STORED_REQUIRED)
        if self.cache_salt is not None:
            out["cache_salt"] = self.cache_salt
        out["group_idx"] = self.group_idx
        return out


@dataclass
class BlockRemoved:
    """Pages no longer held in ``medium`` (SGLang / vLLM ``BlockRemoved``), of ``group_idx``."""

    block_hashes: list[int]
    medium: str | None = GPU
    group_idx: int = KV_GROUP

    def to_dict(self) -> dict[str, Any]:
        """The tagged map (``type``, ``block_hashes``, ``medium``, ``group_idx``)."""
        return _tagged(self, ("block_hashes", "medium", "group_idx"))


@dataclass
class AllBlocksCleared:
    """Every page is gone (``reset``)."""

    def to_dict(self) -> dict[str, Any]:
        return {"type": "AllBlocksCleared"}


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared

_STORED_REQUIRED = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                    "medium", "lora_name")


def _tagged(ev: Any, fields: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {"type": type(ev).__name__}
    for k in fields:
        v = getattr(ev, k)
        out[k] = list(v) if isinstance(v, list) else v
    return out


def namespace_labels(extra_key: Any, lora_names: Mapping[Any, str] | None = None
                     ) -> tuple[int | None, str | None, str | None]:
    """``(lora_id, lora_name, cache_salt)`` published for a namespace (``extra_key``).

    The block hashes already separate namespaces; these labels tell a router *which* tenant
    a page belongs to. Every namespace kind the library accepts maps to them:

    * ``None``: no labels;
    * an ``int`` (not ``bool``): vLLM's LoRA id, ``lora_id``;
    * a ``LoraUid`` (``allocators.lora``; any frozen dataclass with ``name: str`` and
      ``serial: int``): ``lora_name = name``, ``lora_id = serial`` (unique per load);
    * a ``str``: SGLang's ``cache_salt``; any other value (``bytes`` as hex, ``bool``,
      ``float``, a dataclass: its ``repr``) a salt too;
    * a tuple: its parts, each as above; the first int or adapter names the adapter, the
      remaining parts (in order, joined by ``"/"``) form the salt.

    ``lora_names`` (namespace -> adapter name, ``KVEventRecorder(lora_names=)``, as the
    ``radix.sglang`` front end's ``kv_event_lora_names``): a namespace it lists is that
    adapter's, ``lora_name`` the name given and no salt.
    """
    lora_id: int | None = None
    lora_name: str | None = None
    salts: list[str] = []
    for part in (extra_key if type(extra_key) is tuple else (extra_key,)):
        if part is None:
            continue
        name, serial = getattr(part, "name", None), getattr(part, "serial", None)
        if lora_id is None and lora_name is None:
            if isinstance(part, int) and not isinstance(part, bool):
                lora_id = int(part)
                continue
            if (dataclasses.is_dataclass(part) and isinstance(name, str)
                    and isinstance(serial, int)):
                lora_id, lora_name = serial, name
                continue
        salts.append(_salt_text(part))
    if lora_names:
        try:
            listed = lora_names.get(extra_key)
        except TypeError:  # an unhashable namespace is never listed
            listed = None
        if listed is not None:
            return lora_id, listed, None
    return lora_id, lora_name, "/".join(salts) if salts else None


def _salt_text(part: Any) -> str:
    if isinstance(part, str):
        return str(part)
    if isinstance(part, bytes):
        return part.hex()
    return repr(part)


def _hashes(rec: _Pages) -> list[int]:
    """The published int64 of every page of a record: the first 8 bytes (big-endian) of
    each 32-byte digest, read in one pass."""
    return np.frombuffer(rec.digests, dtype=">i8")[:: _DIGEST // 8].tolist()


def block_hash(digest: bytes) -> int:
    """The published int64 of a page's SHA-256 digest (its first 8 bytes, big-endian,
    signed)."""
    return int.from_bytes(digest[:8], "big", signed=True)


def _exact(extra_key: Any) -> Any:
    """A dict key for a namespace as exact as the tree's namespaces
    (``radix.tree.namespace_key``): its typed encoding, else its type and ``repr``. Keying by
    ``(type, extra_key)`` merged namespaces that ``==`` merges inside a container (``(1,)``
    and ``(1.0,)``, ``(1, True)`` and ``(True, 1)``) and ``0.0`` with ``-0.0``."""
    enc = encode_namespace(extra_key)
    return enc if enc is not None else (type(extra_key), repr(extra_key))


def event_seed(tag: str, extra_key: Any) -> bytes:
    """The chain's seed for a namespace: ``hicache.storage.keys.chain_seed``, or, for a
    namespace with no stable encoding, a digest of its type and ``repr`` (stable within one
    process)."""
    seed = chain_seed(tag, extra_key)
    if seed is not None:
        return seed
    t = type(extra_key)
    raw = f"{t.__module__}.{t.__qualname__}:{extra_key!r}".encode("utf-8", "surrogatepass")
    return hashlib.sha256(b"hpc-events/local\x00" + raw).digest()


@dataclass
class _Pages:
    """What the component knows of one node: its pages' digests (32 bytes each, in order)
    and the media it has published them in."""

    digests: bytes
    gpu: bool = False
    cpu: bool = False
    state: bool = False


class KVEventRecorder(Component):
    """Publishes the cache's page set as KV events (see the module docstring).

    Args:
        page_size: tokens per page (the cache's).
        tag: names the model/layout in the chain seed (``""`` by default): caches whose
            events a router compares must use the same tag.
        host_tier: the cache has a host tier (pages move between media, nodes may leave while
            host-only); without one the residency hooks are skipped.
        lora_names: namespace -> adapter name, published as ``lora_name``.
        max_events: events kept until :meth:`take`; when more accumulate, the oldest are
            dropped and ``dropped`` counts them (a router that falls that far behind must
            resynchronise). ``None``: unbounded.
        states: the cache has a recurrent-state component whose observer is
            :meth:`state_changed`: checkpoints are published as :data:`STATE_GROUP`.

    Raises:
        TypeError / ValueError: a bad argument, naming it.
    """

    name = "kv_events"

    def __init__(self, page_size: int, *, tag: str = "", host_tier: bool = False,
                 lora_names: Mapping[Any, str] | None = None,
                 max_events: int | None = None, states: bool = False) -> None:
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
        if not isinstance(tag, str):
            raise TypeError(f"tag must be a str, got {type(tag).__name__}")
        if max_events is not None and (
            isinstance(max_events, bool) or not isinstance(max_events, int) or max_events < 1
        ):
            raise ValueError(f"max_events must be an int >= 1 or None, got {max_events!r}")
        self.page_size = page_size
        self.tag = tag
        self.host_tier = host_tier
        self._lora_names: Mapping[Any, str] = dict(lora_names or {})
        self.max_events = max_events
        #: Recurrent-state checkpoints are published (:meth:`state_changed` is the state
        #: component's observer).
        self.states = states
        if not host_tier:
            self.skip_hooks = frozenset({"refresh", "on_detach"})
        self._seeds: dict[Any, bytes] = {}
        self._labels: dict[Any, tuple[int | None, str | None, str | None]] = {}
        self._pages: dict[int, _Pages] = {}
        self._queue: list[KVEvent] = []
        self._clearing = False
        self.dropped = 0
        self.emitted = 0
        #: Optional observer called with every event as it is queued (tests, publishers).
        self.on_event: Callable[[KVEvent], None] | None = None

    @property
    def lora_names(self) -> Mapping[Any, str]:
        """Namespace -> adapter name, published as ``lora_name`` (settable: later events use
        the new names)."""
        return self._lora_names

    @lora_names.setter
    def lora_names(self, names: Mapping[Any, str]) -> None:
        self._lora_names = dict(names)
        self._labels = {}

    # ----------------------------------------------------------------- queue
    def take(self) -> list[KVEvent]:
        """The events queued since the last call, oldest first; the queue is emptied."""
        out, self._queue = self._queue, []
        return out

    def pending(self) -> int:
        """Events queued and not yet taken."""
        return len(self._queue)

    def _enqueue(self, ev: KVEvent) -> None:
        self.emitted += 1
        observer = self.on_event
        observed = observer is not None
        if observer is not None:
            observer(ev)
        q = self._queue
        if q:
            tail = q[-1]
            if isinstance(ev, BlockRemoved) and isinstance(tail, BlockRemoved):
                if tail.medium == ev.medium and tail.group_idx == ev.group_idx:
                    if observed:  # the observer holds ``tail``: merge into a new event
                        q[-1] = BlockRemoved(tail.block_hashes + ev.block_hashes, tail.medium,
                                             tail.group_idx)
                    else:
                        tail.block_hashes.extend(ev.block_hashes)
                    return
            elif isinstance(ev, BlockStored) and isinstance(tail, BlockStored):
                if (tail.medium == ev.medium and tail.lora_id == ev.lora_id
                        and tail.lora_name == ev.lora_name and tail.cache_salt == ev.cache_salt
                        and tail.group_idx == ev.group_idx and tail.block_size == ev.block_size
                        and ev.parent_block_hash == tail.block_hashes[-1]):
                    if observed:
                        q[-1] = BlockStored(
                            tail.block_hashes + ev.block_hashes, tail.parent_block_hash,
                            tail.token_ids + ev.token_ids, tail.block_size, tail.lora_id,
                            tail.medium, tail.lora_name, tail.cache_salt, tail.group_idx)
                    else:
                        tail.block_hashes.extend(ev.block_hashes)
                        tail.token_ids.extend(ev.token_ids)
                    return
        q.append(ev)
        if self.max_events is not None and len(q) > self.max_events:
            drop = len(q) - self.max_events
            del q[:drop]
            self.dropped += drop

    # ---------------------------------------------------------------- hashes
    def seed(self, extra_key: Any) -> bytes:
        """The chain seed of a namespace (cached)."""
        k = _exact(extra_key)
        s = self._seeds.get(k)
        if s is None:
            s = self._seeds[k] = event_seed(self.tag, extra_key)
        return s

    def _record(self, node: TreeNode) -> _Pages:
        """The node's record, computed from its parent's (recursively) when missing: a node
        a tier attached without the insert's hooks (an L3 prefetch)."""
        rec = self._pages.get(node.id)
        if rec is None:
            parent = node.parent
            assert parent is not None, node
            prev = self.seed(node.extra_key) if parent.parent is None else (
                self._record(parent).digests[-_DIGEST:])
            rec = _Pages(b"".join(page_hashes(prev, node.key, self.page_size)))
            self._pages[node.id] = rec
        return rec

    def hashes(self, node: TreeNode) -> list[int]:
        """The published block hashes of ``node``'s pages."""
        return _hashes(self._record(node))

    def _parent_hash(self, node: TreeNode) -> int | None:
        parent = node.parent
        if parent is None or parent.parent is None:
            return None
        return block_hash(self._record(parent).digests[-_DIGEST:])

    def labels(self, extra_key: Any) -> tuple[int | None, str | None, str | None]:
        """``(lora_id, lora_name, cache_salt)`` of a namespace (:func:`namespace_labels`,
        cached)."""
        k = _exact(extra_key)
        got = self._labels.get(k)
        if got is None:
            got = self._labels[k] = namespace_labels(extra_key, self._lora_names)
        return got

    def _store(self, node: TreeNode, rec: _Pages, medium: str) -> None:
        lora_id, lora_name, salt = self.labels(node.extra_key)
        self._enqueue(BlockStored(
            _hashes(rec), self._parent_hash(node), node.key.tolist(), self.page_size,
            lora_id, medium, lora_name, salt))

    def _remove(self, rec: _Pages, medium: str) -> None:
        self._enqueue(BlockRemoved(_hashes(rec), medium))

    def state_changed(self, node: TreeNode, held: bool) -> None:
        """A recurrent state was cached on ``node`` (``held``) or freed from it (the state
        component's observer): one :data:`STATE_GROUP` event naming the node's last page,
        the page whose end the checkpoint is valid at."""
        if self._clearing or node.parent is None or held == self._record(node).state:
            return
        rec = self._record(node)
        rec.state = held
        last = rec.digests[-_DIGEST:]
        if not held:
            self._enqueue(BlockRemoved([block_hash(last)], GPU, STATE_GROUP))
            return
        if len(rec.digests) > _DIGEST:
            parent: int | None = block_hash(rec.digests[-2 * _DIGEST:-_DIGEST])
        else:
            parent = self._parent_hash(node)
        lora_id, lora_name, salt = self.labels(node.extra_key)
        self._enqueue(BlockStored(
            [block_hash(last)], parent, node.key[-self.page_size:].tolist(), self.page_size,
            lora_id, GPU, lora_name, salt, STATE_GROUP))

    # ----------------------------------------------------------------- hooks
    def on_new_node(self, node: TreeNode, plan: InsertPlan, lo: int, hi: int) -> None:
        rec = self._record(node)
        rec.gpu = True
        self._store(node, rec, GPU)

    def on_split(self, upper: TreeNode, lower: TreeNode, split_len: int) -> None:
        rec = self._pages.get(lower.id)
        if rec is None:
            return
        cut = split_len // self.page_size * _DIGEST
        self._pages[upper.id] = _Pages(rec.digests[:cut], rec.gpu, rec.cpu)
        rec.digests = rec.digests[cut:]

    def refresh(self, node: TreeNode) -> None:
        """With a host tier: publish a change of residency (load-back, backup, revival)."""
        if node.parent is None or not node.owner:
            return
        rec = self._record(node)
        on_gpu = node.kv_value is not None
        if on_gpu != rec.gpu:
            rec.gpu = on_gpu
            (self._store(node, rec, GPU) if on_gpu else self._remove(rec, GPU))
        on_cpu = node.host_value is not None
        if on_cpu != rec.cpu:
            rec.cpu = on_cpu
            (self._store(node, rec, CPU) if on_cpu else self._remove(rec, CPU))

    def on_remove(self, node: TreeNode) -> int:
        """The node's device KV leaves (it leaves the tree, or is demoted to host)."""
        if self._clearing:
            return 0
        rec = self._pages.get(node.id)
        if rec is None:
            return 0
        if rec.gpu:
            rec.gpu = False
            self._remove(rec, GPU)
        if not self.host_tier:
            del self._pages[node.id]  # without a host tier the node is leaving
        return 0

    def on_detach(self, node: TreeNode) -> None:
        """The node left the tree: its host copy went with it."""
        if self._clearing:
            return
        rec = self._pages.pop(node.id, None)
        if rec is None:
            return
        if rec.gpu:
            self._remove(rec, GPU)
        if rec.cpu:
            self._remove(rec, CPU)

    def before_reset(self) -> None:
        self._clearing = True

    def reset(self) -> None:
        """Every page is gone: one ``AllBlocksCleared`` (no removal per node)."""
        self._clearing = False
        self._pages = {}
        self._enqueue(AllBlocksCleared())

    # ---------------------------------------------------------------- checks
    def stats(self) -> dict[str, Any]:
        return {"kv_events_emitted": self.emitted, "kv_events_pending": len(self._queue),
                "kv_events_dropped": self.dropped}

    def check(self, nodes: list[TreeNode]) -> None:
        """Every node's record matches its residency and its chain recomputed from the root."""
        live = {n.id for n in nodes}
        assert set(self._pages) <= live, f"event records of removed nodes: {set(self._pages) - live}"
        for n in nodes:
            rec = self._pages.get(n.id)
            if rec is None:
                assert n.kv_value is None, f"device node without an event record: {n}"
                continue
            assert rec.gpu == (n.kv_value is not None), f"published GPU state wrong: {n}"
            if self.states:
                assert rec.state == (n.state_slot is not None), f"published checkpoint wrong: {n}"
            if self.host_tier:
                assert rec.cpu == (n.host_value is not None), f"published CPU state wrong: {n}"
            p = n.parent
            assert p is not None
            if p.parent is None:
                prev = self.seed(n.extra_key)
            else:
                prec = self._pages.get(p.id)
                assert prec is not None, f"event record of {n} without its parent's"
                prev = prec.digests[-_DIGEST:]
            want = b"".join(page_hashes(prev, n.key, self.page_size))
            assert rec.digests == want, f"page hashes of {n} differ from their recomputation"
