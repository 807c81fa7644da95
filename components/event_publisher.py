"""Publishing KV events over ZMQ, with the engines' protocol and ``kv_events_config`` keys
(needs ``msgspec`` and ``pyzmq``: the ``events`` extra).

An engine calls ``publisher.publish(cache.take_events())`` once per scheduler step. The
protocol is SGLang 0.5.23's (vLLM's differs only in the replay reply, see below):

* a PUB socket sends each batch as three frames ``[topic, seq, payload]``: ``topic`` the
  configured topic (UTF-8), ``seq`` the batch's sequence number (8 bytes, big-endian, from 0,
  one per batch), ``payload`` the msgpack batch (``components.event_wire.encode_batch``);
* a ROUTER socket on ``replay_endpoint`` (optional) answers a request ``[start_seq]`` (8
  bytes, big-endian, from a DEALER / REQ) with every batch still buffered whose sequence
  number is ``>= start_seq``, each as ``[topic, seq, payload]`` (vLLM: ``[seq, payload]``),
  then the end marker ``[b"", -1 as 8 signed big-endian bytes, b""]``;
* data-parallel rank ``r`` publishes on its own port: ``tcp://host:port`` becomes
  ``tcp://host:(port + r)``, ``inproc://name`` becomes ``inproc://name_dp{r}``;
* the PUB socket binds when ``bind`` says so, else (as the engines' heuristic) when the
  endpoint is a wildcard (``*``, ``0.0.0.0``, ``::``), ``ipc://`` or ``inproc://``, and
  connects otherwise.

``kv_events_config`` (a JSON object, as ``--kv-events-config`` takes, or a mapping): the
engines' keys ``publisher`` (``"null"`` / ``"zmq"``), ``endpoint``, ``bind``,
``replay_endpoint``, ``buffer_steps`` (batches kept for replay), ``hwm`` (the PUB socket's
high-water mark), ``max_queue_size`` (batches waiting for the sender thread), ``topic``,
``format`` (``"default"`` only: SGLang's ``"dynamo"`` re-hashes pages with its own namespace
seed, which this library's chain does not reproduce); this library's ``shape`` (``"map"`` /
``"array"``) and ``state_group`` (``components.event_wire``). A bad key or value is refused
when the config is built, naming it.

Never raising into the engine: :meth:`ZmqEventPublisher.publish` only encodes and enqueues.
A batch that cannot be encoded, finds the queue full, or arrives after :meth:`close` is
dropped and counted (``dropped_batches``); a send that fails on the socket is counted
(``send_failures``) and its batch stays in the replay buffer under its sequence number, so a
subscriber that sees the gap can ask for it again.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

try:
    import zmq
except ImportError as _e:  # the optional dependency: a clear error, only when used
    raise ImportError(
        "components.event_publisher needs pyzmq (pip install 'hybrid-prefix-cache[events]')"
    ) from _e

from components.event_wire import SHAPES, encode_batch
from components.events import KVEvent

__all__ = ["END_SEQ", "KVEventsConfig", "NullEventPublisher", "ZmqEventPublisher",
           "create_publisher", "offset_endpoint"]

logger = logging.getLogger(__name__)

#: The replay socket's end-of-replay sequence number (-1, 8 bytes, signed big-endian).
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "[::]")


@dataclass(frozen=True)
class KVEventsConfig:
    """``kv_events_config`` (see the module docstring); validated when built.

    Raises:
        TypeError / ValueError: a bad value, naming its key.
    """

    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    bind: bool | None = None
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    format: str = "default"
    shape: str = "map"
    state_group: bool = True

    def __post_init__(self) -> None:
        if self.publisher not in ("null", "zmq"):
            raise ValueError(f"kv_events_config publisher must be 'null' or 'zmq', "
                             f"got {self.publisher!r}")
        check_endpoint(self.endpoint, "endpoint")
        if self.replay_endpoint is not None:
            check_endpoint(self.replay_endpoint, "replay_endpoint")
        if self.bind is not None and not isinstance(self.bind, bool):
            raise TypeError(f"kv_events_config bind must be a bool or null, got {self.bind!r}")
        for key, low in (("buffer_steps", 1), ("hwm", 0), ("max_queue_size", 1)):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"kv_events_config {key} must be an int >= {low}, got {v!r}")
        if not isinstance(self.topic, str):
            raise TypeError(f"kv_events_config topic must be a str, got {self.topic!r}")
        if self.format != "default":
            raise ValueError(
                f"kv_events_config format must be 'default', got {self.format!r} (the 'dynamo' "
                "format re-hashes pages with SGLang's namespace seed, not this library's chain)")
        if self.shape not in SHAPES:
            raise ValueError(f"kv_events_config shape must be one of {SHAPES}, got {self.shape!r}")
        if not isinstance(self.state_group, bool):
            raise TypeError(f"kv_events_config state_group must be a bool, "
                            f"got {self.state_group!r}")

    @classmethod
    def from_cli(cls, value: str | Mapping[str, Any]) -> KVEventsConfig:
        """From the JSON text ``--kv-events-config`` takes, or a mapping.

        Raises:
            TypeError / ValueError: not a JSON object, an unknown key, or a bad value,
                naming it.
        """
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"kv_events_config must be a JSON object: {e}") from None
        if not isinstance(value, Mapping):
            raise TypeError(f"kv_events_config must be a JSON object or a mapping, "
                            f"got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"kv_events_config has unknown keys {unknown}; known: {sorted(known)}")
        return cls(**dict(value))


def check_endpoint(endpoint: Any, name: str) -> None:
    """Refuse a malformed ZMQ endpoint: ``tcp://host:port`` (port 0-65535 or ``*``),
    ``ipc://path`` or ``inproc://name``.

    Raises:
        TypeError / ValueError: naming ``name``.
    """
    if not isinstance(endpoint, str):
        raise TypeError(f"kv_events_config {name} must be a str, got {type(endpoint).__name__}")
    scheme, sep, rest = endpoint.partition("://")
    if not sep or scheme not in ("tcp", "ipc", "inproc") or not rest:
        raise ValueError(f"kv_events_config {name} must be tcp://host:port, ipc://path or "
                         f"inproc://name, got {endpoint!r}")
    if scheme == "tcp":
        host, colon, port = rest.rpartition(":")
        if not colon or not host or not (port == "*" or (port.isdigit() and int(port) <= 65535)):
            raise ValueError(f"kv_events_config {name} must be tcp://host:port with a port in "
                             f"0-65535 or '*', got {endpoint!r}")


def offset_endpoint(endpoint: str | None, dp_rank: int) -> str | None:
    """The endpoint of data-parallel rank ``dp_rank`` (see the module docstring): a tcp port
    moves up by the rank (a ``*`` port stays), an inproc name gets ``_dp{rank}``."""
    if endpoint is None or dp_rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{dp_rank}"
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.rpartition(":")
        if port == "*":
            return endpoint
        if int(port) + dp_rank > 65535:
            raise ValueError(f"kv_events_config endpoint {endpoint!r} + dp_rank {dp_rank} "
                             "passes port 65535")
        return f"{host}:{int(port) + dp_rank}"
    return f"{endpoint}_dp{dp_rank}"


class NullEventPublisher:
    """``publisher: "null"``: events are discarded."""

    def publish(self, events: Sequence[KVEvent]) -> None:
        """Discard ``events``."""

    def close(self) -> None:
        """Nothing to release."""

    def stats(self) -> dict[str, int]:
        return {}


class ZmqEventPublisher:
    """PUB socket + optional replay ROUTER socket + a sender thread (module docstring).

    Args:
        config: a :class:`KVEventsConfig`, its JSON text or a mapping.
        dp_rank: this publisher's data-parallel rank (offsets the ports; written in every
            batch).

    Raises:
        TypeError / ValueError: a bad config or ``dp_rank``, naming it.
        zmq.ZMQError: the socket could not bind / connect its endpoint (when built, never
            later).
    """

    SHUTDOWN_TIMEOUT_S = 1.0

    def __init__(self, config: KVEventsConfig | str | Mapping[str, Any] | None = None,
                 dp_rank: int = 0) -> None:
        if config is None:
            config = KVEventsConfig(publisher="zmq")
        elif not isinstance(config, KVEventsConfig):
            config = KVEventsConfig.from_cli(config)
        if isinstance(dp_rank, bool) or not isinstance(dp_rank, int) or dp_rank < 0:
            raise ValueError(f"dp_rank must be an int >= 0, got {dp_rank!r}")
        self.config = config
        self.dp_rank = dp_rank
        endpoint = offset_endpoint(config.endpoint, dp_rank)
        assert endpoint is not None
        replay = offset_endpoint(config.replay_endpoint, dp_rank)
        self._topic = config.topic.encode("utf-8")
        self._queue: queue.Queue[tuple[bytes] | None] = queue.Queue(config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = 0
        self._lock = threading.Lock()
        self.published = 0
        self.dropped_batches = 0
        self.dropped_events = 0
        self.send_failures = 0
        self.replays = 0
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            self._pub.setsockopt(zmq.SNDHWM, config.hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            bind = config.bind
            if bind is None:
                host = endpoint.partition("://")[2].rpartition(":")[0]
                bind = (host in _WILDCARD_HOSTS or not endpoint.startswith("tcp://")
                        or endpoint.endswith(":*"))
            if bind:
                self._pub.bind(endpoint)
                endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                self._pub.connect(endpoint)
            if replay is not None:
                self._replay = ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(replay)
                replay = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        #: The endpoint the PUB socket bound (the OS's port for a ``*`` port) or connected.
        self.endpoint: str = endpoint
        #: The replay socket's bound endpoint (``None``: no replay).
        self.replay_endpoint: str | None = replay
        self._running = True
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"kv-events-pub-dp{dp_rank}")
        self._thread.start()

    # ------------------------------------------------------------------ engine side
    def publish(self, events: Sequence[KVEvent]) -> None:
        """Queue one batch (nothing when ``events`` is empty). Never raises: a batch that
        cannot be encoded or queued is dropped and counted."""
        try:
            if not events:
                return
            if not self._running:
                raise RuntimeError("publisher closed")
            payload = encode_batch(events, dp_rank=self.dp_rank, shape=self.config.shape,
                                   state_group=self.config.state_group)
            self._queue.put_nowait((payload,))
        except Exception as e:  # the engine's step must go on: drop and count
            with self._lock:
                self.dropped_batches += 1
                try:
                    self.dropped_events += len(events)
                except TypeError:
                    pass
            logger.warning("KV event batch dropped: %s", e)

    def close(self) -> None:
        """Send what is queued (up to ``SHUTDOWN_TIMEOUT_S``), stop the thread, close the
        sockets. Later batches are dropped and counted."""
        if not self._running:
            return
        self._running = False
        try:
            self._queue.put(None, timeout=self.SHUTDOWN_TIMEOUT_S)
        except queue.Full:
            pass
        self._thread.join(self.SHUTDOWN_TIMEOUT_S)
        self._close_sockets()

    shutdown = close

    def stats(self) -> dict[str, int]:
        """Batches published, dropped (with their events), failed sends, replays served,
        batches queued, the next sequence number."""
        with self._lock:
            return {"kv_events_published_batches": self.published,
                    "kv_events_dropped_batches": self.dropped_batches,
                    "kv_events_dropped_events": self.dropped_events,
                    "kv_events_send_failures": self.send_failures,
                    "kv_events_replays": self.replays,
                    "kv_events_queued_batches": self._queue.qsize(),
                    "kv_events_next_seq": self._seq}

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        while True:
            if self._replay is not None:
                try:
                    while self._replay.poll(0):
                        self._serve_replay()
                except Exception as e:
                    logger.warning("KV event replay failed: %s", e)
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                if not self._running:
                    return
                continue
            if item is None:
                return
            self._send(item[0])

    def _send(self, payload: bytes) -> None:
        seq = self._seq
        self._buffer.append((seq, payload))
        try:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            ok = True
        except Exception as e:
            ok = False
            logger.warning("KV event batch %d not sent: %s", seq, e)
        with self._lock:
            self._seq = seq + 1
            if ok:
                self.published += 1
            else:
                self.send_failures += 1

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("malformed KV event replay request: %d frames", len(frames))
            return
        ident, start = frames[0], int.from_bytes(frames[2], "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart((ident, b"", self._topic, seq.to_bytes(8, "big"),
                                             payload))
        with self._lock:  # counted before the end marker: a client that saw it sees the count
            self.replays += 1
        self._replay.send_multipart((ident, b"", b"", END_SEQ, b""))

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)


def create_publisher(kv_events_config: str | Mapping[str, Any] | KVEventsConfig | None,
                     dp_rank: int = 0) -> ZmqEventPublisher | NullEventPublisher:
    """The publisher a ``kv_events_config`` names (``None`` / empty: the null publisher).

    Raises:
        TypeError / ValueError: a bad config, naming the key.
    """
    if not kv_events_config:
        return NullEventPublisher()
    config = (kv_events_config if isinstance(kv_events_config, KVEventsConfig)
              else KVEventsConfig.from_cli(kv_events_config))
    if config.publisher == "null":
        return NullEventPublisher()
    return ZmqEventPublisher(config, dp_rank)
