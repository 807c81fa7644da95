"""The ZMQ publisher (``components.event_publisher``) over real sockets on loopback.

* a subscriber (SUB on 127.0.0.1, the engines' ``[topic, seq, payload]`` frames, vLLM's
  schema from ``tests/helpers/engine_kv_schemas.py``) follows a seeded hybrid replay with a
  host tier, asks the replay socket for the batches it missed (the slow-joiner gap), and
  rebuilds the page set: it equals the tree's, page for page;
* the replay protocol: start sequence, the end marker, topic frames;
* a socket that fails, a batch that cannot be encoded, a full queue, a closed publisher:
  nothing raises into the caller, the batches are dropped and counted;
* ``kv_events_config``: the engines' keys, data-parallel ports, malformed endpoints and keys
  refused naming them.
"""

from __future__ import annotations

import random
import time
from typing import Any, cast

import pytest
import zmq

from components.event_publisher import (
    END_SEQ,
    KVEventsConfig,
    NullEventPublisher,
    ZmqEventPublisher,
    create_publisher,
    offset_endpoint,
)
from components.events import STATE_GROUP, AllBlocksCleared, BlockStored
from tests.components.test_kv_events import CONFIGS, build, step, tree_pages
from tests.helpers.engine_kv_schemas import DECODERS
from tests.helpers.isolated import run_python

LOOPBACK = "tcp://127.0.0.1:*"
#: An upper bound for what only has to arrive (a batch, a replay answer, the sender thread's
#: progress) on a loaded 2-core machine [s]: generous, and free when things are fast.
WAIT_S = 30.0


def wait_until(cond: Any, what: str) -> None:
    """Poll ``cond()`` until it holds; fail naming ``what`` after ``WAIT_S``."""
    deadline = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not within {WAIT_S} s"
        time.sleep(0.01)


def replay(endpoint: str, start: int) -> list[list[bytes]]:
    """Ask the replay socket for every batch from ``start``; the frames up to the end marker."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        got = []
        while True:
            assert dealer.poll(int(WAIT_S * 1000)), "no replay answer"
            frames = dealer.recv_multipart()[1:]  # the empty delimiter
            if frames[1] == END_SEQ:
                assert frames == [b"", END_SEQ, b""]
                return got
            got.append(frames)
    finally:
        dealer.close()


def apply(pages: set[tuple[int, str, int]], payload: bytes) -> int:
    """A router's update from one batch decoded with vLLM's schema; returns its events."""
    batch = DECODERS["vllm"].decode(payload)
    for ev in batch.events:
        name = type(ev).__name__
        if name.endswith("AllBlocksCleared"):
            pages.clear()
        elif name.endswith("BlockStored"):
            pages.update((h, ev.medium, ev.group_idx) for h in ev.block_hashes)
        else:
            pages.difference_update((h, ev.medium, ev.group_idx) for h in ev.block_hashes)
    return len(batch.events)


def test_a_subscriber_rebuilds_the_page_set_over_loopback() -> None:
    """After every step the subscriber's page set (live batches) equals the tree's; at the end
    a second subscriber rebuilds it from the replay socket alone."""
    cache, kv, sp = build(CONFIGS["hicache-back-state"])
    pub = ZmqEventPublisher({"publisher": "zmq", "endpoint": LOOPBACK, "topic": "kv",
                             "replay_endpoint": LOOPBACK}, dp_rank=0)
    assert pub.endpoint.startswith("tcp://127.0.0.1:") and pub.replay_endpoint is not None
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(pub.endpoint)
    try:
        # the subscription takes a moment to reach the PUB socket (slow joiner): probe with a
        # batch that changes nothing until one arrives; the probes are batches 0 .. probes - 1
        # (those sent before the subscription arrived are lost), so the subscriber then reads
        # up to the last one, however late the sender thread sends it
        pages: set[tuple[int, str, int]] = set()
        seen = -1
        probes = 0
        deadline = time.monotonic() + WAIT_S
        while seen < 0:
            assert time.monotonic() < deadline, "the subscription never reached the publisher"
            pub.publish([AllBlocksCleared()])
            probes += 1
            if sub.poll(100):
                seen = int.from_bytes(sub.recv_multipart()[1], "big")
        while seen < probes - 1:  # probes still in flight
            assert sub.poll(int(WAIT_S * 1000)), f"probe {seen + 1} of {probes} not received"
            seen = int.from_bytes(sub.recv_multipart()[1], "big")
        assert seen == probes - 1
        rng = random.Random("publisher")
        locks: list[Any] = []
        history: list[Any] = []
        batches = events = peak = 0
        for i in range(300):
            step(cache, kv, sp, rng, locks, history, "reset" if i == 150 else None)
            evs = cache.take_events()
            if not evs:
                continue
            pub.publish(evs)
            assert sub.poll(int(WAIT_S * 1000)), f"batch of step {i} not received"
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv" and int.from_bytes(seq, "big") == seen + 1  # no gap
            seen += 1
            batches += 1
            events += apply(pages, payload)
            assert pages == tree_pages(cache), f"step {i}"
            peak = max(peak, len(pages))
        # a late subscriber: everything from the replay socket
        late: set[tuple[int, str, int]] = set()
        replayed = replay(pub.replay_endpoint, 0)
        assert [int.from_bytes(q, "big") for _, q, _ in replayed] == list(range(seen + 1))
        for _, _, payload in replayed:
            apply(late, payload)
        want = tree_pages(cache)
        assert late == pages == want
        st = pub.stats()
        assert st["kv_events_published_batches"] == seen + 1
        assert st["kv_events_dropped_batches"] == st["kv_events_send_failures"] == 0
        print(f"\nsubscriber: {batches} batches, {events} events, equal to the tree after "
              f"every step (up to {peak} pages held); at the end {len(pages)} pages held "
              f"({sum(g == STATE_GROUP for _, _, g in pages)} state checkpoints); "
              f"replay: {len(replayed)} batches, equal: {late == want}")
    finally:
        sub.close()
        pub.close()


def test_replay_returns_from_the_start_sequence_with_topic_frames() -> None:
    pub = ZmqEventPublisher({"publisher": "zmq", "endpoint": LOOPBACK, "topic": "t",
                             "replay_endpoint": LOOPBACK, "buffer_steps": 3})
    try:
        for k in range(5):
            pub.publish([BlockStored([k], None, [k], 1)])
        wait_until(lambda: pub.stats()["kv_events_next_seq"] == 5, "5 batches sent")
        assert pub.replay_endpoint is not None
        got = replay(pub.replay_endpoint, 3)
        assert [(t, int.from_bytes(s, "big")) for t, s, _ in got] == [(b"t", 3), (b"t", 4)]
        hashes = [DECODERS["sglang"].decode(p).events[0].block_hashes for _, _, p in got]
        assert hashes == [[3], [4]]
        # only buffer_steps batches are kept
        assert [int.from_bytes(s, "big") for _, s, _ in replay(pub.replay_endpoint, 0)] == [2, 3, 4]
        assert pub.stats()["kv_events_replays"] == 2
    finally:
        pub.close()


def test_failures_never_raise_into_the_caller() -> None:
    pub = ZmqEventPublisher({"publisher": "zmq", "endpoint": LOOPBACK})
    ev = [BlockStored([1], None, [1], 1)]
    pub.publish(ev)
    pub.publish(cast(Any, [object()]))  # cannot be encoded: dropped
    wait_until(lambda: pub.stats()["kv_events_next_seq"] == 1, "the first batch sent")
    pub._pub.close(linger=0)  # the socket fails under the sender thread
    pub.publish(ev)
    wait_until(lambda: pub.stats()["kv_events_next_seq"] == 2, "the second batch tried")
    st = pub.stats()
    assert (st["kv_events_published_batches"], st["kv_events_send_failures"],
            st["kv_events_dropped_batches"], st["kv_events_dropped_events"]) == (1, 1, 1, 1)
    pub.close()
    pub.publish(ev + ev)  # after close: dropped, counted
    assert pub.stats()["kv_events_dropped_events"] == 3
    pub.publish([])  # nothing to send: not a batch
    assert pub.stats()["kv_events_dropped_batches"] == 2


def test_a_full_queue_drops_and_counts() -> None:
    pub = ZmqEventPublisher({"publisher": "zmq", "endpoint": LOOPBACK, "max_queue_size": 1})
    pub._running = False  # the thread leaves after its current wait: nothing drains the queue
    pub._thread.join(WAIT_S)
    assert not pub._thread.is_alive()
    pub._running = True
    ev = [BlockStored([1], None, [1], 1)]
    pub.publish(ev)
    pub.publish(ev)
    pub.publish(ev)
    st = pub.stats()
    assert (st["kv_events_queued_batches"], st["kv_events_dropped_batches"]) == (1, 2)
    pub._running = False
    pub._close_sockets()


def test_config_keys_and_data_parallel_ports() -> None:
    c = KVEventsConfig.from_cli('{"publisher": "zmq", "endpoint": "tcp://*:5557", '
                                '"replay_endpoint": "tcp://*:5600", "buffer_steps": 5, '
                                '"hwm": 10, "max_queue_size": 7, "topic": "kv", "bind": null}')
    assert (c.publisher, c.endpoint, c.replay_endpoint, c.buffer_steps, c.hwm,
            c.max_queue_size, c.topic, c.bind) == ("zmq", "tcp://*:5557", "tcp://*:5600", 5, 10,
                                                    7, "kv", None)
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("tcp://*:5557", 3) == "tcp://*:5560"
    assert offset_endpoint("tcp://[::1]:5557", 1) == "tcp://[::1]:5558"
    assert offset_endpoint("inproc://kv", 2) == "inproc://kv_dp2"
    assert offset_endpoint(None, 2) is None
    with pytest.raises(ValueError, match="65535"):
        offset_endpoint("tcp://*:65535", 1)
    assert isinstance(create_publisher(None), NullEventPublisher)
    assert isinstance(create_publisher('{"publisher": "null"}'), NullEventPublisher)
    # two ranks on one base port: each its own socket
    a = create_publisher({"publisher": "zmq", "endpoint": "inproc://hpc-kv"}, dp_rank=0)
    b = create_publisher({"publisher": "zmq", "endpoint": "inproc://hpc-kv"}, dp_rank=1)
    try:
        assert isinstance(a, ZmqEventPublisher) and isinstance(b, ZmqEventPublisher)
        assert (a.endpoint, b.endpoint) == ("inproc://hpc-kv", "inproc://hpc-kv_dp1")
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize(("config", "exc", "names"), [
    ({"endpoint": "tcp://127.0.0.1"}, ValueError, "endpoint"),
    ({"endpoint": "tcp://:5557"}, ValueError, "endpoint"),
    ({"endpoint": "tcp://h:70000"}, ValueError, "endpoint"),
    ({"endpoint": "udp://h:5557"}, ValueError, "endpoint"),
    ({"endpoint": 5557}, TypeError, "endpoint"),
    ({"replay_endpoint": "tcp://h:x"}, ValueError, "replay_endpoint"),
    ({"publisher": "kafka"}, ValueError, "publisher"),
    ({"buffer_steps": 0}, ValueError, "buffer_steps"),
    ({"hwm": -1}, ValueError, "hwm"),
    ({"max_queue_size": True}, ValueError, "max_queue_size"),
    ({"topic": 3}, TypeError, "topic"),
    ({"bind": "yes"}, TypeError, "bind"),
    ({"format": "dynamo"}, ValueError, "format"),
    ({"shape": "json"}, ValueError, "shape"),
    ({"state_group": 1}, TypeError, "state_group"),
    ({"endpont": "tcp://*:1"}, ValueError, "endpont"),
])
def test_bad_configs_are_refused_naming_the_key(config: dict[str, Any], exc: type,
                                                 names: str) -> None:
    with pytest.raises(exc, match=names):
        KVEventsConfig.from_cli({"publisher": "zmq", **config})


def test_bad_config_text_and_rank() -> None:
    with pytest.raises(ValueError, match="JSON object"):
        KVEventsConfig.from_cli("{publisher: zmq}")
    with pytest.raises(TypeError, match="JSON object"):
        KVEventsConfig.from_cli("[1]")
    with pytest.raises(ValueError, match="dp_rank"):
        ZmqEventPublisher({"publisher": "zmq", "endpoint": LOOPBACK}, dp_rank=-1)


def test_without_pyzmq_only_the_publisher_refuses() -> None:
    code = """
import sys
sys.modules['zmq'] = None
import components.event_wire
try:
    import components.event_publisher
except ImportError as e:
    print('refused:', e)
"""
    assert "refused: components.event_publisher needs pyzmq" in run_python(code)
