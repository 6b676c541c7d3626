"""memory_pool.threads.InOrder: calls run in the order fed, one at a time beside the feeder, and
a failure reaches the feeder."""

from __future__ import annotations

import hashlib
import threading
import time

import pytest

from memory_pool.threads import InOrder


def test_in_order_runs_every_call_in_the_order_fed_on_one_other_thread_and_equals_the_serial_hash():
    pieces = [bytes([i]) * (1 << 16) for i in range(40)]
    serial = hashlib.blake2b(digest_size=32)
    for p in pieces:
        serial.update(p)
    h, seen, threads = hashlib.blake2b(digest_size=32), [], set()

    def update(i, p):
        time.sleep(0.001 * (i % 3))  # (uneven: a later call must still wait for an earlier one)
        seen.append(i)
        threads.add(threading.get_ident())
        h.update(p)

    with InOrder("test-in-order") as q:
        for i, p in enumerate(pieces):
            q.feed(update, i, p)
    assert seen == list(range(40)) and h.digest() == serial.digest()
    assert len(threads) == 1 and threading.get_ident() not in threads


def test_in_order_keeps_at_most_one_call_waiting_beside_the_feeder():
    running, most = [0], [0]
    lock = threading.Lock()

    def slow():
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.01)
        with lock:
            running[0] -= 1

    with InOrder("test-in-order") as q:
        for _ in range(10):
            q.feed(slow)
            with lock:
                assert running[0] <= 1
    assert most[0] == 1


def test_a_failed_call_reaches_the_feeder_at_its_next_feed_or_drain():
    def boom():
        raise ValueError("piece 3 was bad")

    with pytest.raises(ValueError, match="piece 3"):
        with InOrder("test-in-order") as q:
            q.feed(boom)
            q.feed(lambda: None)   # (the next feed waits for it and raises)
    q2 = InOrder("test-in-order")
    q2.feed(boom)
    with pytest.raises(ValueError, match="piece 3"):
        q2.drain()
    q2.drain()  # (reported once)
    q2.__exit__(None, None, None)
